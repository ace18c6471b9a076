"""Checkpoints of hybrid-sharded `DistMesh` states over real gloo processes (fzero/checkpoint/hybrid.py): a
`DistMesh` (2, 2) run of hybrid stages 1-3 saved at a step's boundary resumes bitwise (offloaded to NVMe too); a
state mid-window is refused on every rank; `SimMesh((2, 2))` and `DistMesh` (2, 2) checkpoints are the same files
and load into each other; and the (2, 2) checkpoint continues on (1, 4), (4, 1) and a 1-D mesh of 3 as a `SimMesh`
of that shape continues it (tests/hybrid_ckpt_worker.py)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

import fzero
from fzero.checkpoint import named_leaves, read_manifest, rng
from tests import hybrid_ckpt_worker as worker
from tests.bounds import reorder_bound
from tests.spawn import spawn
from tests.test_checkpoint import assert_same

FILES = ["manifest.json", "manifest.json.sha256", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]


@contextlib.contextmanager
def one_thread():
    """As the workers: matmul's reduction order may depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sim_run(shape, stage, micro, start, stop, state=None):
    """A `SimMesh` run of the workers' model and data (`shape` None: 1-D of 3), from `state` (default a fresh one)
    through micro-steps `start..stop`."""
    mesh = worker.make_mesh(shape, True, 3)
    tx = worker.make_tx(stage, micro, shape is not None)
    state = fzero.init(worker.model(), tx, mesh) if state is None else state
    return worker.train(mesh, tx, state, worker.batches(micro)[start:stop], None), mesh, tx


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The 4 processes of `worker.resume`, after the parent saved the `SimMesh((2, 2))` checkpoint they load."""
    out = tmp_path_factory.mktemp("hybrid-resume")
    stage, micro = worker.CASES[0]
    with one_thread():
        sim, _, _ = sim_run(worker.SHAPE, stage, micro, 0, worker.AT * micro)
    fzero.save(sim, out / "sim", data_position=worker.AT * micro)
    spawn(worker.resume, (4, str(out)), 4)
    return out, [json.loads((out / f"results-{r}.json").read_text()) for r in range(4)], sim


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "micro"), worker.CASES)
def test_resumes_bitwise_on_2x2(resumed, stage, micro):
    out, results, _ = resumed
    case = worker.name(stage, micro)
    for rank, got in enumerate(results):  # every leaf of every rank, loaded and after the steps that follow
        assert got[case]["loaded"] == [] and got[case]["resumed"] == [], (rank, got[case])
        assert got[case]["world"] == 2 and got[case]["files"] == FILES, (rank, got[case])  # replica 0's 2 files
        # restore_rng: rank r gets saved process r % 2's generators (replica 0's ranks saved theirs)
        assert got[case]["restored"] == results[rank % 2][case]["generator"], rank
    assert len({got[case]["generator"] for got in results}) == 4  # (the test can fail: the ranks' generators differ)
    manifest = read_manifest(out / case / f"step{worker.AT * micro}")
    assert manifest.mesh == {"axis": "shard", "replicas": 2}
    assert (manifest.world, manifest.processes, manifest.simulated) == (2, 2, False)
    params = load_file(out / f"{case}.st")
    names = [k.removeprefix("straight/") for k in params if k.startswith("straight/")]
    assert names and all(torch.equal(params[f"straight/{k}"], params[f"resumed/{k}"]) for k in names)
    at_save = fzero.consolidate(out / case)  # (the test can fail: the steps after the save moved every tensor)
    assert all(not torch.equal(at_save[k], params[f"straight/{k}"]) for k in names)


@pytest.mark.timeout(120)
def test_resumes_bitwise_offloaded_to_nvme(resumed):
    _, results, _ = resumed
    for rank, got in enumerate(results):
        assert got["nvme"] == {"offloaded": "Offloaded", "resumed": []}, (rank, got["nvme"])


@pytest.mark.timeout(120)
def test_refuses_a_state_mid_window_or_without_its_mesh_on_every_rank(resumed):
    _, results, _ = resumed
    messages = {got["mid"] for got in results}
    assert len(messages) == 1, messages  # every rank raises the same error: none waits in a collective
    message = messages.pop()
    assert message is not None and "['tx_state']['accumulate']" in message, message
    assert "differs between the replicas of this hybrid state" in message and "step's boundary" in message
    assert all(got["mid_left"] == [] for got in results)  # refused before anything was written
    assert all("pass mesh=fzero.DistMesh(shape=...)" in got["no_mesh"] for got in results)


@pytest.mark.timeout(120)
def test_sim_mesh_and_dist_mesh_checkpoints_interchange(resumed):
    out, results, sim = resumed
    stage, micro = worker.CASES[0]
    case, tag = worker.name(stage, micro), f"step{worker.AT * micro}"
    assert all(got["from_sim"] == [] for got in results)  # each DistMesh rank loaded its part of SimMesh's, bitwise
    # the same files: DistMesh (2, 2)'s replica 0 wrote what SimMesh((2, 2)) wrote (the two runs are bitwise equal)
    for name in FILES[2:]:
        a, b = load_file(out / case / tag / name), load_file(out / "sim" / tag / name)
        state_keys = [k for k in a if not k.startswith(rng.PREFIX)]
        assert state_keys and state_keys == [k for k in b if not k.startswith(rng.PREFIX)], name
        assert all(torch.equal(a[k], b[k]) for k in state_keys), name
    dist_manifest, sim_manifest = read_manifest(out / case / tag), read_manifest(out / "sim" / tag)
    assert dist_manifest.mesh == sim_manifest.mesh and dist_manifest.layout == sim_manifest.layout
    stored = lambda m: [(e.key, e.kind, e.shape, e.dtype, e.storage) for e in m.leaves]  # noqa: E731 (world_axis differs)
    assert stored(dist_manifest) == stored(sim_manifest)
    mesh = worker.make_mesh(worker.SHAPE, True, 4)
    like = fzero.init(worker.model(), worker.make_tx(stage, micro, True), mesh)
    for source in (out / case, out / "from-sim"):  # the DistMesh's checkpoints load into SimMesh((2, 2)), bitwise
        loaded, _ = fzero.load(source, like)
        assert_same(named_leaves(loaded), named_leaves(sim), str(source))
    with one_thread():
        final, _, _ = sim_run(worker.SHAPE, stage, micro, worker.AT * micro, None, loaded)
    params = load_file(out / f"{case}.st")
    assert all(torch.equal(v, params[f"resumed/{k}"]) for k, v in worker.params(final, mesh).items())


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    """The 4 processes of `worker.reshard`: the (2, 2) checkpoint `ckpt`, continued on (1, 4) and (4, 1)."""
    out = tmp_path_factory.mktemp("hybrid-reshard")
    spawn(worker.reshard, (4, str(out)), 4)
    return out


# (4, 1): each gradient element is the mean of the R = 4 replicas' terms, which gloo's all-reduce over 4 processes
# adds in its own order, SimMesh in rank order: two orders of a 4-term float64 sum, per step after the checkpoint
# (tests/bounds.py, kind 2). Observed: <= 8e-15. The other targets reduce as SimMesh does (a single replica; gloo
# reduce-scatters as an all-to-all and a rank-ordered sum): bitwise.
ATOL = {(4, 1): reorder_bound(1e-2, terms=4, steps=worker.STEPS - worker.AT)}


def assert_close(a, b, atol: float, where: str) -> None:
    """`assert_same` (bitwise), or within `atol` for floating-point tensors when `atol` is given."""
    if not atol:
        assert_same(a, b, where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_close(a[k], b[k], atol, f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, atol, f"{where}[{i}]")
    elif a.is_floating_point():
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert (a - b).abs().max().item() <= atol if a.numel() else True, where
    else:
        assert_same(a, b, where)


def check_continues_as_sim_mesh(out, shape, world):
    """The DistMesh run that continued `out/ckpt` on `shape` ended where a SimMesh of that shape ends: every leaf
    (the final state's checkpoint, loaded into the SimMesh) and the consolidated parameters, bitwise (within `ATOL`
    for (4, 1))."""
    stage, micro = worker.CASES[0]
    mesh = worker.make_mesh(shape, True, world)
    tx = worker.make_tx(stage, micro, shape is not None)
    like = fzero.init(worker.model(), tx, mesh)
    loaded, extra = fzero.load(out / "ckpt", like)
    assert extra["world"] == 2 and extra["manifest"].mesh == {"axis": "shard", "replicas": 2}
    with one_thread():
        want, _, _ = sim_run(shape, stage, micro, extra["data_position"], None, loaded)
    label = worker.shape_name(shape, world)
    got, _ = fzero.load(out / f"final-{label}", like)
    atol = ATOL.get(shape, 0.0)
    assert_close(named_leaves(got), named_leaves(want), atol, label)
    params = load_file(out / f"final-{label}.st")
    assert_close(params, worker.params(want, mesh), atol, label)
    assert not torch.equal(params["wte.weight"], fzero.consolidate(out / "ckpt")["wte.weight"])  # it trained on


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", worker.TARGETS[4])
def test_continues_on_1x4_and_4x1_as_a_resharded_run(continued, shape):
    check_continues_as_sim_mesh(continued, shape, 4)


@pytest.mark.timeout(120)
def test_continues_on_a_1d_mesh_of_3_as_a_resharded_run(continued):
    spawn(worker.reshard, (3, str(continued)), 3)
    check_continues_as_sim_mesh(continued, None, 3)

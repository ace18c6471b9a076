"""Hybrid sharding (`hybrid=True`: shard over the mesh axis "shard", average the shards over "replicate") against
the 1-D presets on R * S ranks, its ledger, its errors, and a 4-process gloo `DistMesh` of shape (2, 2) against
`SimMesh` bitwise (docs/hybrid.md)."""

from __future__ import annotations

import json

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

import fzero
from tests import hybrid_worker
from tests.spawn import spawn
from tests.support import lm_batches, lm_loss, mlp, regression_batches, regression_loss, tiny_gpt

LR = 1e-2
STEPS = 3

# float64 tolerance, derived as in tests/test_stages.py: the hybrid mean (sum over the S ranks of a shard group,
# / S, then over the R groups, / R) and the 1-D mean (one rank-ordered sum of W = R * S terms, / W) are two
# associations of the same W * k <= 18 terms (k <= 2 micro-steps, with |terms| G <= 10 here) plus one extra
# rounded division: they differ by at most (18 + 2) * u * G = 2.2e-14 per gradient element (u = 1.1e-16); Adam's
# update lr * m / (sqrt(v) + eps) changes by at most lr * that / eps = 1e-2 * 2.2e-14 / 1e-8 = 2.2e-8 per step in
# the worst (|g| ~ eps) case. Observed: <= 5e-15. A real bug (a wrong mean, a shard from the wrong rank) moves
# parameters by ~lr = 1e-2.
ATOL64 = 2.2e-8 * STEPS


def run(model, loss_of, batches, mesh, stage, micro, hybrid):
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(LR), accumulate=micro, hybrid=hybrid)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh)
    for batch in batches:
        state, metrics = step(state, batch)
    return fzero.state_dict(state), state, metrics


def check(model, loss_of, batches, R, S, stage, micro):
    hybrid = run(model, loss_of, batches, fzero.SimMesh(shape={"replicate": R, "shard": S}), stage, micro, True)[0]
    flat = run(model, loss_of, batches, fzero.SimMesh(R * S), stage, micro, False)[0]
    assert hybrid.keys() == flat.keys()
    if R == 1 or S == 1:
        # one of the two reductions is over a single rank (x / 1 is x: skipped), the other is the 1-D mean's very
        # sum in rank order; Adam is elementwise: bitwise
        assert all(torch.equal(hybrid[k], flat[k]) for k in flat), (R, S, stage, micro)
    else:
        diff = max((hybrid[k] - flat[k]).abs().max().item() for k in flat)
        assert diff <= ATOL64, (R, S, stage, micro, diff)


@given(
    R=st.integers(1, 3),
    S=st.integers(1, 3),
    stage=st.integers(1, 3),
    micro=st.integers(1, 2),
    widths=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_hybrid_equals_the_1d_preset_on_r_times_s_ranks(R, S, stage, micro, widths, seed):
    model = mlp(widths, seed, torch.float64)
    batches = regression_batches(model, R * S, micro, 2, STEPS, seed + 1)
    check(model, regression_loss, batches, R, S, stage, micro)


def test_hybrid_transformer_stage3():
    """Stage 3's unit-by-unit gathering and reduction over `shard` (the property test above covers every stage on
    MLPs; this one a model of several units)."""
    model = tiny_gpt(1, torch.float64)
    batches = lm_batches(model, 6, 2, 2, STEPS, 2)
    check(model, lm_loss, batches, 2, 3, 3, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_per_axis(stage):
    """Per step, fp32 gradients, no accumulation (Psi: the padded parameter count, S = 3, R = 2): the gradient is
    reduce-scattered over `shard` (Psi elements in, 4 Psi bytes) and its 1/S shard all-reduced over `replicate`
    (Psi / S elements, 4 Psi / S bytes: the ledger's `elements` count an all-reduce twice, the ZeRO paper's
    accounting); parameters are all-gathered over `shard` only (Psi elements once at stages 1-2; at stage 3 in the
    forward and again in the backward, but for the units still gathered when their backward starts); only the
    one-element gradient-norm sum and the loss cross every rank."""
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    batches = lm_batches(model, 6, 1, 2, 2, 3)
    _, state, metrics = run(model, lm_loss, batches, mesh, stage, 1, True)
    psi, shard = state.layout.numel, state.layout.shard_numel
    assert psi == 3 * shard and state.layout.world == 3 and state.layout.axis == "shard"
    comm = metrics["comm"]
    rep, sh = comm["all_reduce:replicate"], comm["reduce_scatter:shard"]
    assert (rep["bytes"], rep["elements"], rep["sent"]) == (4 * shard, 2 * shard, shard)
    assert (sh["bytes"], sh["elements"], sh["sent"]) == (4 * psi, psi, psi * 2 // 3)
    gather = comm["all_gather:shard"]
    if stage == 3:
        assert psi < gather["elements"] < 2 * psi and "all_gather:replicate" not in comm
    else:
        assert gather["elements"] == psi
    assert set(comm) == {"reduce_scatter:shard", "all_reduce:replicate", "all_gather:shard", "all_reduce:shard",
                         "all_reduce"}  # fmt: skip
    assert comm["all_reduce"]["elements"] == 2  # the loss's mean


def test_state_dict_eval_and_errors():
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = fzero.zero3(fzero.adamw(), hybrid=True)
    state = fzero.init(model, tx, mesh)
    assert state.params.shape == (4, state.layout.shard_numel)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fzero.state_dict(state).items())
    evaluate = fzero.eval_step(model, lambda p, b: torch.func.functional_call(model, p, (b,)), mesh)
    x = torch.randint(0, 32, (4, 1, 8))
    assert torch.equal(evaluate(state, x)[3], model(x[3]))
    with pytest.raises(ValueError, match="shards over mesh axis 'shard', but SimMesh\\(world=4\\) has no named axes"):
        fzero.init(model, tx, fzero.SimMesh(4))
    with pytest.raises(ValueError, match="must be the mesh's last \\(innermost\\) axis"):
        fzero.init(model, tx, fzero.SimMesh(shape={"shard": 2, "replicate": 2}))
    with pytest.raises(ValueError, match="sharded over 2 ranks of mesh axis 'shard', but the mesh is SimMesh"):
        fzero.train_step(model, lm_loss(model), tx, fzero.SimMesh(4))(state, lm_batches(model, 4, 1, 1, 1, 0)[0])
    with pytest.raises(ValueError, match="hybrid must be False, True or a pair"):
        fzero.zero2(fzero.adamw(), hybrid="yes")
    with pytest.raises(ValueError, match="needs the axis to shard over"):
        fzero.reduce_scatter(replicate="replicate")


def test_hybrid_with_other_axis_names_and_a_single_axis():
    model = mlp([3, 4, 2], 0)
    batches = regression_batches(model, 4, 1, 2, 2, 1)
    named = run(model, regression_loss, batches, fzero.SimMesh(shape={"node": 2, "gpu": 2}), 2, 1, ("node", "gpu"))
    plain = run(model, regression_loss, batches, fzero.SimMesh(shape={"replicate": 2, "shard": 2}), 2, 1, True)
    assert all(torch.equal(named[0][k], plain[0][k]) for k in plain[0])
    assert "all_reduce:node" in named[2]["comm"]


def sim_reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul's reduction order may depend on the thread count
    try:
        mesh = fzero.SimMesh(shape=hybrid_worker.SHAPE)
        got = hybrid_worker.collectives(mesh, hybrid_worker.inputs(mesh.world))
        trained = {hybrid_worker.name(*case): hybrid_worker.train(mesh, *case, None) for case in hybrid_worker.CASES}
        return got, trained
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(300)
def test_dist_mesh_2x2_equals_sim_mesh_bitwise(tmp_path):
    spawn(hybrid_worker.run, (4, str(tmp_path)), 4)
    collectives, trained = sim_reference()
    for rank in range(4):
        got = load_file(tmp_path / f"collectives-{rank}.st")
        assert got.keys() == collectives.keys()
        for name, value in got.items():
            # gloo sums two ranks (a + b == b + a); reduce-scatter is an all-to-all and a rank-ordered sum
            assert torch.equal(value, collectives[name][rank]), (rank, name)
    ledgers = json.loads((tmp_path / "ledgers.json").read_text())
    for case in hybrid_worker.CASES:  # hybrid presets, also with qgZ and qwZ (all-to-alls on the sub-groups)
        want, comm = trained[hybrid_worker.name(*case)]
        got = load_file(tmp_path / f"{hybrid_worker.name(*case)}.st")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), case
        assert ledgers[hybrid_worker.name(*case)] == comm, case


def train_steps(mesh, tx, model, batches, state=None):
    state = state if state is not None else fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    return state


def leaves(state):
    return optree.tree_leaves(state, namespace="fzero")


def equal_leaves(a, b):
    """`named_leaves` equal: the same training state whatever the meshes (fzero.checkpoint.named_leaves)."""
    a, b = fzero.checkpoint.named_leaves(a), fzero.checkpoint.named_leaves(b)
    flat_a, flat_b = optree.tree_leaves(a), optree.tree_leaves(b)
    return a.keys() == b.keys() and len(flat_a) == len(flat_b) and all(map(torch.equal, flat_a, flat_b))


def test_checkpoint_resumes_bitwise_and_records_the_mesh(tmp_path):
    model, mesh = tiny_gpt(0), fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = fzero.zero2(fzero.adamw(1e-2), accumulate=2, hybrid=True)
    batches = lm_batches(model, 4, 2, 2, 3, 4)
    whole = train_steps(mesh, tx, model, batches)
    half = train_steps(mesh, tx, model, batches[:4])
    path = fzero.save(half, tmp_path)
    manifest = fzero.checkpoint.read_manifest(path)
    assert manifest.mesh == {"axis": "shard", "replicas": 2} and manifest.world == 2
    loaded, extra = fzero.load(tmp_path, fzero.init(model, tx, mesh))
    assert extra["world"] == 2
    assert loaded.params.shape == half.params.shape and loaded.layout == half.layout
    assert all(torch.equal(x, y) for x, y in zip(leaves(loaded), leaves(half), strict=True))
    resumed = train_steps(mesh, tx, model, batches[4:], loaded)
    assert all(torch.equal(x, y) for x, y in zip(leaves(resumed), leaves(whole), strict=True))


@pytest.mark.parametrize(("source", "target"), [((2, 3), None), (None, (3, 2)), ((3, 2), (2, 2))])
def test_checkpoints_reshard_between_1d_and_2d_meshes(tmp_path, source, target):
    """A hybrid (R, S) checkpoint is its shard group's world-S one: it loads into a 1-D mesh of any world, a 1-D one
    into any hybrid mesh, and hybrid into hybrid of another shape, holding the same training state."""

    def mesh_tx(shape, stage):
        if shape is None:
            return fzero.SimMesh(4), getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2))
        mesh = fzero.SimMesh(shape={"replicate": shape[0], "shard": shape[1]})
        return mesh, getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), hybrid=True)

    model = tiny_gpt(0)
    mesh, tx = mesh_tx(source, 2)
    state = train_steps(mesh, tx, model, lm_batches(model, mesh.world, 1, 2, 2, 6))
    fzero.save(state, tmp_path)
    mesh2, tx2 = mesh_tx(target, 3)
    loaded, _ = fzero.load(tmp_path, fzero.init(model, tx2, mesh2))
    assert equal_leaves(loaded, state)
    assert equal_leaves(fzero.checkpoint.reshard(state, fzero.init(model, tx2, mesh2)), state)
    sd = fzero.state_dict(loaded)
    assert all(torch.equal(sd[k], v) for k, v in fzero.state_dict(state).items())
    train_steps(mesh2, tx2, model, lm_batches(model, mesh2.world, 1, 2, 1, 7), loaded)  # and it trains on


def test_checkpoint_mid_window_is_refused_naming_the_leaf(tmp_path):
    model, mesh = mlp([3, 2], 0), fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = fzero.zero1(fzero.adamw(), accumulate=2, hybrid=True)  # full local gradients accumulate on each rank
    state = fzero.init(model, tx, mesh)
    state, _ = fzero.train_step(model, regression_loss(model), tx, mesh)(
        state, regression_batches(model, 4, 1, 2, 1, 0)[0]
    )
    with pytest.raises(ValueError, match="differs between the replicas of this hybrid state .* step's boundary"):
        fzero.save(state, tmp_path)


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_construction_from_meta(stage):
    """A meta-device model is constructed unit by unit into each rank's chunk along `shard`
    (fzero.sharding.construct)."""
    from fzero.examples.gpt import GPT
    from tests.test_zero3 import copy_initializer

    source = tiny_gpt(5)
    with torch.device("meta"):
        meta = GPT(source.cfg)
    init = copy_initializer(source)
    init.target = meta
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(), hybrid=True)
    built = fzero.init(meta, tx, mesh, initializer=init)
    plain = fzero.init(source, tx, mesh)
    assert all(torch.equal(x, y) for x, y in zip(leaves(built), leaves(plain), strict=True))

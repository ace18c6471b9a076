"""Checkpoints in one process: save at world W and stage s, load at W' and s' (hypothesis), resume bitwise,
consolidate to a plain state_dict (function and command), and the directory a save leaves."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import fzero
from fzero.checkpoint import CheckpointError, IncompatibleCheckpointError, named_leaves, reshard
from fzero.cli import main as cli
from fzero.optim.schedules import warmup_lr
from tests.bounds import adam_drift, max_diff
from tests.support import lm_batches, lm_loss, mlp, tiny_gpt

PRESETS = [fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3]
GLOBAL = 12  # examples per micro-step, split over the ranks: divisible by every world size 1-4


def assert_same(a, b, where="state"):
    """Bitwise equality of nested dicts / lists of tensors (dtype included)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where


def global_batches(model: nn.Module, n: int, seed: int) -> list[dict]:
    """`n` micro-batches of `GLOBAL` examples, without a world axis (split by `for_world`)."""
    g = torch.Generator().manual_seed(seed)
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
    dtype = lin[0].weight.dtype
    return [
        {
            "x": torch.randn(GLOBAL, lin[0].in_features, generator=g).to(dtype),
            "y": torch.randn(GLOBAL, lin[-1].out_features, generator=g).to(dtype),
        }
        for _ in range(n)
    ]


def for_world(batch: dict, world: int) -> dict:
    return {k: v.unflatten(0, (world, -1)) for k, v in batch.items()}


def regression(model: nn.Module, compute: torch.dtype | None):
    def loss_fn(params, batch):
        x = batch["x"] if compute is None else batch["x"].to(compute)
        out = torch.func.functional_call(model, params, (x,))
        return F.mse_loss(out.to(batch["y"].dtype), batch["y"])

    return loss_fn


def run(model, tx, world, state, data, compute):
    mesh = fzero.SimMesh(world)
    step = fzero.train_step(model, regression(model, compute), tx, mesh)
    for batch in data:
        state, _ = step(state, for_world(batch, world))
    return state


BITWISE_PAIRS = {frozenset({0, 1}), frozenset({2, 3})}  # docs/equivalence.md: same arithmetic per element


@settings(max_examples=20)
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    stages=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    worlds=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    micro=st.integers(1, 2),
    steps=st.integers(1, 2),
    precision=st.sampled_from([None, "bf16", "fp16"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_world_any_stage(widths, stages, worlds, micro, steps, precision, seed):
    (s, s2), (w, w2) = stages, worlds
    model = mlp(widths, seed, torch.float64 if precision is None else torch.float32)
    compute = None if precision is None else fzero.get_policy(precision).compute_dtype
    tx, tx2 = (PRESETS[i](fzero.adamw(1e-2), accumulate=micro, precision=precision) for i in (s, s2))
    data = global_batches(model, (steps + 1) * micro, seed)
    state = run(model, tx, w, fzero.init(model, tx, fzero.SimMesh(w)), data[: steps * micro], compute)

    with tempfile.TemporaryDirectory() as d:
        fzero.save(state, d, data_position=steps * micro)
        loaded, extra = fzero.load(d, fzero.init(model, tx2, fzero.SimMesh(w2)))
        consolidated = fzero.consolidate(d)
    # every leaf (parameters, compute copy, optimizer moments and counts, accumulator, loss scale), per parameter
    assert_same(named_leaves(loaded), named_leaves(state))
    assert_same(consolidated, fzero.state_dict(state))
    assert extra["data_position"] == steps * micro and extra["world"] == w
    # resharding in memory is the same operation without files
    assert_same(named_leaves(reshard(state, fzero.init(model, tx2, fzero.SimMesh(w2)))), named_leaves(state))

    # training continues at W' as it would have at W
    rest = data[steps * micro :]
    here = fzero.state_dict(run(model, tx, w, state, rest, compute))
    there = fzero.state_dict(run(model, tx2, w2, loaded, rest, compute))
    if w == w2 and (s == s2 or micro == 1 or frozenset({s, s2}) in BITWISE_PAIRS):
        assert_same(there, here)
    elif precision is None:
        # float64: the ranks' sums reassociate W*k <= 8 gradient terms: <= 1.3e-8 per Adam step at lr 1e-2
        # (the derivation in docs/equivalence.md)
        for k in here:
            torch.testing.assert_close(there[k], here[k], rtol=0, atol=3.9e-8)
    else:
        # bf16/fp16: a gradient below the compute dtype's noise can flip sign and Adam turns it into a full lr step
        # (docs/equivalence.md): Adam's step bound over the steps after the checkpoint (tests/bounds.py)
        scale = max(v.abs().max().item() for v in here.values())
        assert max_diff(there, here) <= adam_drift(1e-2, len(rest) // micro, scale=scale)


def noisy_lm(model):
    """The LM loss times a random factor: the run depends on the generator state, as dropout makes it."""
    inner = lm_loss(model)

    def loss_fn(params, batch):
        return inner(params, batch) * (1 + 0.1 * torch.rand(()))

    return loss_fn


@pytest.mark.parametrize(("preset", "at"), [(fzero.zero1, 3), (fzero.zero3, 4)])
def test_resume_is_bitwise(tmp_path, preset, at):
    """Save at micro-step `at` (3: in the middle of an accumulation), resume in a 'fresh process' (other RNG state,
    fresh init), run to the end: bitwise the uninterrupted run, fp16 dynamic loss scale and warm-up schedule
    included. The step draws its randomness from the state's stream (fzero.state.rng), so the global generators need not
    be restored; a different stream gives a different run (so the test can fail)."""
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(2)
    opt = fzero.adamw(warmup_lr(warmup_min_lr=1e-3, warmup_max_lr=1e-2, warmup_num_steps=4))
    scale = fzero.DynamicLossScale.create(initial_scale_power=8, loss_scale_window=2)  # doubles during the run
    tx = preset(opt, accumulate=2, precision="fp16", loss_scale=scale)
    step = fzero.train_step(model, noisy_lm(model), tx, mesh)
    data = [fzero.get_policy("fp16").cast_to_compute(b) for b in lm_batches(model, 2, 2, 2, 5, 5)]

    torch.manual_seed(1)
    state = fzero.init(model, tx, mesh)
    for batch in data[:at]:
        state, _ = step(state, batch)
    fzero.save(state, tmp_path, data_position=at)
    straight = state
    for batch in data[at:]:
        straight, _ = step(straight, batch)

    results = {}
    for restore in (True, False):
        torch.manual_seed(12345)
        resumed, extra = fzero.load(tmp_path, fzero.init(model, tx, mesh), restore_rng=restore)
        for batch in data[extra["data_position"] :]:
            resumed, _ = step(resumed, batch)
        results[restore] = resumed
    assert_same(named_leaves(results[True]), named_leaves(straight))
    assert_same(named_leaves(results[False]), named_leaves(straight))
    assert int(results[True].step) == len(data)
    assert fzero.transforms.current_loss_scale(results[True].tx_state).loss_scale > 256
    other, _ = fzero.load(tmp_path, fzero.init(model, tx, mesh))
    other = other.replace(seed=other.seed + 1)
    for batch in data[at:]:
        other, _ = step(other, batch)
    assert not torch.equal(other.params, straight.params)


class Tagged(nn.Module):
    """Frozen parameters, buffers (BatchNorm, whose statistics differ per rank), a tied weight, two units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.norm = nn.BatchNorm1d(6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(6, 6)
        self.out.weight = self.blocks[0].weight  # tied

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(self.frozen(self.norm(h)))


def test_consolidate_function_and_command(tmp_path):
    model = Tagged()
    tx = fzero.zero3(fzero.adamw(1e-2), accumulate=1)
    mesh = fzero.SimMesh(3)
    state = run(model, tx, 3, fzero.init(model, tx, mesh), global_batches(model, 2, 0), None)
    want = fzero.state_dict(state)
    fzero.save(state, tmp_path / "ckpt")

    got = fzero.consolidate(tmp_path / "ckpt")
    assert_same(got, want)  # parameters, the frozen layer, rank 0's BatchNorm statistics, the tied name
    assert got["out.weight"] is got["blocks.0.weight"]
    fresh = Tagged()
    fresh.load_state_dict(got)  # strict
    assert_same({k: v.detach() for k, v in fresh.state_dict().items()}, want)

    assert cli(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    assert_same(load_file(tmp_path / "model.safetensors"), want)
    assert cli(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "half.safetensors"), "--dtype", "bf16"]) == 0
    half = load_file(tmp_path / "half.safetensors")
    assert_same(half, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()})
    assert cli(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.safetensors")]) == 1


def test_buffers_that_differ_per_rank(tmp_path):
    """BatchNorm statistics differ per rank: kept per rank (bitwise at the same world), rank 0's at another."""
    model = Tagged()
    tx = fzero.zero2(fzero.sgd(0.1))
    state = run(model, tx, 2, fzero.init(model, tx, fzero.SimMesh(2)), global_batches(model, 1, 1), None)
    assert not torch.equal(state.buffers["norm.running_mean"][0], state.buffers["norm.running_mean"][1])
    fzero.save(state, tmp_path)
    same, _ = fzero.load(tmp_path, fzero.init(model, tx, fzero.SimMesh(2)))
    assert_same(same.buffers, state.buffers)
    other, _ = fzero.load(tmp_path, fzero.init(model, tx, fzero.SimMesh(3)))
    for name, value in state.buffers.items():
        assert_same(list(other.buffers[name]), [value[0]] * 3, name)


def test_the_directory_a_save_leaves(tmp_path):
    model = mlp([8, 16, 4], 0)
    tx = fzero.zero3(fzero.adamw(1e-2), precision="bf16")
    state = fzero.init(model, tx, fzero.SimMesh(4))
    path = fzero.save(state, tmp_path, data_position=5, user_state={"epoch": 1}, config={"zero_optimization": 3})
    assert path == tmp_path / "step0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step0"]  # no temporaries left
    assert (tmp_path / "latest").read_text() == "step0\n"
    m = json.loads((path / "manifest.json").read_text())
    assert (m["format"], m["version"], m["world"], m["step"], m["data_position"]) == ("fzero-checkpoint", 3, 4, 0, 5)
    assert m["precision"] == {"master": "float32", "compute": "bfloat16"}
    assert m["user_state"] == {"epoch": 1} and m["config"] == {"zero_optimization": 3}
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json", "manifest.json.sha256"] + [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)]
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert (path / "manifest.json.sha256").read_text() == f"{digest}  manifest.json\n"  # sha256sum -c reads it
    for info in m["files"]:
        data = (path / info["name"]).read_bytes()
        assert len(data) == info["bytes"] and hashlib.sha256(data).hexdigest() == info["sha256"]
    # stage 3: every leaf the size of the parameters is split evenly; the files hold the state once
    sizes = [sum(t.numel() * t.element_size() for t in load_file(path / i["name"]).values()) for i in m["files"]]
    shard_bytes = state.layout.shard_numel * (4 + 2 + 4 + 4)  # master, bf16 compute, two moments
    assert all(size - shard_bytes < 6000 for size in sizes[1:])  # plus small counters in rank 0's file
    storage = {e["key"]: e["storage"] for e in m["leaves"]}
    assert storage["params"] == storage["compute"] == storage["tx_state/shard_update/exp_avg"] == "split"
    assert storage["step"] == "rank0"


def test_tags_latest_and_overwrite(tmp_path):
    model = mlp([3, 2], 0)
    tx = fzero.zero1(fzero.sgd(0.1))
    state = fzero.init(model, tx, fzero.SimMesh(2))
    fzero.save(state, tmp_path, tag="a")
    fzero.save(state.replace(params=state.params + 1), tmp_path, tag="b", data_position=1)
    assert fzero.load(tmp_path, state)[1]["tag"] == "b"  # latest
    assert fzero.load(tmp_path, state, tag="a")[1]["data_position"] is None
    assert fzero.load(tmp_path / "a", state)[1]["tag"] == "a"  # a checkpoint directory itself
    fzero.save(state, tmp_path, tag="c", latest=False)
    assert fzero.load(tmp_path, state)[1]["tag"] == "b"
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        fzero.save(state, tmp_path, tag="b")
    fzero.save(state, tmp_path, tag="b", overwrite=True, data_position=2)
    assert fzero.load(tmp_path, state)[1]["data_position"] == 2
    for bad in ("../x", ".hidden", "latest", "a/b", ""):
        with pytest.raises(CheckpointError, match="not a valid checkpoint tag"):
            fzero.save(state, tmp_path, tag=bad)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        fzero.save(state, tmp_path, tag="d", user_state={"x": object()})


def test_structure_mismatch_strict_and_select(tmp_path):
    model = mlp([4, 5, 3], 0)
    saved = fzero.init(model, fzero.zero2(fzero.adamw(1e-2), accumulate=2), fzero.SimMesh(2))
    saved = saved.replace(params=saved.params + 0.5)
    fzero.save(saved, tmp_path)
    like = fzero.init(model, fzero.zero2(fzero.adamw(1e-2)), fzero.SimMesh(2))  # no accumulator
    with pytest.raises(IncompatibleCheckpointError, match="tx_state/accumulate/count, tx_state/accumulate"):
        fzero.load(tmp_path, like)
    loaded, _ = fzero.load(tmp_path, like, strict=False)
    assert_same(loaded.params, saved.params)

    sgd = fzero.init(model, fzero.zero2(fzero.sgd(0.1)), fzero.SimMesh(3))  # new optimizer, the model's weights
    loaded, _ = fzero.load(tmp_path, sgd, select=lambda k: k in ("params", "compute"))
    assert_same(named_leaves(loaded)["params"], named_leaves(saved)["params"])
    with pytest.raises(IncompatibleCheckpointError, match="lacks leaves"):
        fzero.load(tmp_path, sgd, select=lambda k: k.startswith("tx_state"))  # SGD's momentum is not there

    bf16 = fzero.init(model, fzero.zero2(fzero.adamw(1e-2), accumulate=2, precision="bf16"), fzero.SimMesh(2))
    with pytest.raises(IncompatibleCheckpointError, match="'compute' is float32 in the checkpoint but bfloat16"):
        fzero.load(tmp_path, bf16)


def test_load_into_dist_state_without_mesh_is_explained(tmp_path):
    model = mlp([3, 2], 0)
    state = fzero.init(model, fzero.zero2(fzero.sgd(0.1)), fzero.SimMesh(2))
    plan = dataclasses.replace(state.plan, stacked=False)
    fake = state.replace(params=state.params[0], compute=state.compute[0], plan=plan)  # one DistMesh rank's form
    with pytest.raises(TypeError, match="needs its mesh"):
        fzero.save(fake, tmp_path)
    with pytest.raises(TypeError, match="needs its mesh"):
        fzero.load(tmp_path, fake)
    assert not list(Path(tmp_path).iterdir())


class Legacy(nn.Module):
    """The model tests/data/legacy-v1 was saved from (by fzero before frozen parameters had a flat buffer and the
    state a random stream): a frozen embedding and head, two units, BatchNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.norm = nn.BatchNorm1d(4)
        self.frozen_head = nn.Linear(4, 3)
        self.frozen_head.requires_grad_(False)


LEGACY = Path(__file__).parent / "data" / "legacy-v1"


@pytest.mark.parametrize("preset", [fzero.zero2, fzero.zero3])
def test_checkpoints_written_before_the_frozen_buffer_still_load(preset):
    """A checkpoint of the first format (frozen parameters as one leaf each, no seed) loads into today's state, at
    its stage or another, with the values it was saved with; consolidation reads it too."""
    from safetensors.torch import load_file

    expected = load_file(LEGACY / "expected.safetensors")
    like = fzero.init(Legacy(), preset(fzero.adamw(1e-2)), fzero.SimMesh(2))
    with pytest.warns(UserWarning, match="before fzero kept the step's random stream"):
        state, extra = fzero.load(LEGACY, like)
    assert extra["data_position"] == 2 and int(state.step) == 2
    assert_same(fzero.state_dict(state), expected)
    assert_same(fzero.consolidate(LEGACY), expected)

"""ZeRO-3 for real: one unit at a time in forward and backward, prefetch, sharded construction, memory."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.examples.gpt import GPT, GPTConfig
from tests import zero3_worker
from tests.spawn import spawn
from tests.support import lm_batches, lm_loss, tiny_gpt
from tests.test_stages import equal

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16)


def copy_initializer(source: torch.nn.Module):
    """An initializer that writes a reference model's values: sharded construction must reproduce them."""
    names = {id(m): n for n, m in source.named_modules()}
    by_name = dict(source.named_modules())
    del names

    def init(module: torch.nn.Module) -> None:
        path = next(n for n, m in init.target.named_modules() if m is module)
        ref = by_name[path]
        for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            t.copy_(dict([*ref.named_parameters(recurse=False), *ref.named_buffers(recurse=False)])[n])

    return init


def train(model, world, preset="zero3", steps=2, micro=1, gather=None, initializer=None, source=None):
    mesh = fzero.SimMesh(world)
    tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
    state = fzero.init(model, tx, mesh, initializer=initializer)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, gather=gather)
    peaks = []
    for batch in lm_batches(source or model, world, micro, 2, steps, 1):
        state, metrics = step(state, batch)
        peaks.append(metrics["gathered_peak"])
    return state, fzero.state_dict(state), max(peaks)


@given(
    world=st.integers(1, 3),
    prefetch=st.integers(0, 3),
    micro=st.integers(1, 2),
    seed=st.integers(0, 99),
    reuse=st.sampled_from([0, 3_000, 10**9]),
)
def test_unit_gathering_is_bitwise_the_whole_gather(world, prefetch, micro, seed, reuse):
    """Per-unit gathering changes where parameters live, not the arithmetic: the same parameters as gathering
    everything at the step's start (autodiff="func" takes that path) and as stage 2, whichever units stay gathered
    from their forward into their backward."""
    model = torch.manual_seed(seed) and GPT(CFG)
    policy = fzero.GatherPolicy(prefetch=prefetch, reuse_distance=reuse)
    _, per_unit, _ = train(model, world, micro=micro, gather=policy)
    mesh = fzero.SimMesh(world)
    tx = fzero.zero3(fzero.adamw(1e-2), accumulate=micro)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, autodiff="func")
    for batch in lm_batches(model, world, micro, 2, 2, 1):
        state, _ = step(state, batch)
    assert equal(per_unit, fzero.state_dict(state))
    assert equal(per_unit, train(model, world, "zero2", micro=micro)[1])


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathered_elements_stay_bounded(prefetch):
    model = GPT(CFG)
    state, _, peak = train(model, 2, gather=fzero.GatherPolicy(prefetch=prefetch))
    units = state.layout.units
    root, blocks = units[0].size, max(u.size for u in units[1:])
    assert peak <= root + (1 + prefetch) * blocks  # the root unit stays; at most 1 + prefetch blocks live
    assert peak < state.layout.numel or prefetch + 1 >= len(units) - 1
    if prefetch == 0:
        assert peak == root + blocks
    bounded = fzero.GatherPolicy(prefetch=2, max_live_elements=root + blocks)
    assert train(model, 2, gather=bounded)[2] == root + blocks  # prefetches that would exceed the bound wait


def test_reuse_distance_keeps_the_units_deepspeed_keeps():
    """A unit stays gathered into its backward when fewer elements than the distance are gathered between its two
    uses (the later blocks' forwards and backwards: 2 blocks' worth per later block), the last always: with prefetch
    0 the peak shows which stayed."""
    model = GPT(CFG)
    state = train(model, 2)[0]
    units = state.layout.units
    root, block = units[0].size, units[1].size
    assert all(u.size == block for u in units[1:])  # (3 equal blocks)
    for distance, kept in [(0, 1), (2 * block, 1), (2 * block + 1, 2), (4 * block + 1, 3), (10**9, 3)]:
        policy = fzero.GatherPolicy(prefetch=0, reuse_distance=distance)
        assert train(model, 2, gather=policy)[2] == root + kept * block, distance


def test_sharded_construction_reproduces_the_model():
    source = tiny_gpt(5)
    with torch.device("meta"):
        meta = GPT(source.cfg)
    init = copy_initializer(source)
    init.target = meta
    for preset in ("zero1", "zero2", "zero3"):
        a = train(meta, 3, preset, initializer=init, source=source)[1]
        b = train(source, 3, preset)[1]
        assert equal(a, b), preset
    assert all(p.is_meta for p in meta.parameters()) and meta.head.weight is meta.wte.weight  # left as it was


def test_meta_errors():
    with torch.device("meta"):
        meta = GPT(CFG)
    with pytest.raises(ValueError, match="meta device; pass initializer=fn"):
        fzero.init(meta, fzero.zero3(fzero.adamw()), fzero.SimMesh(2))
    reset = lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None  # noqa: E731
    with pytest.raises(ValueError, match="only be constructed sharded under a chain with reduce_scatter"):
        fzero.init(meta, fzero.zero0(fzero.adamw()), fzero.SimMesh(2), initializer=reset)
    # an initializer that misses tensors (here: everything but the Linear layers) is caught, naming them
    linear_only = lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None  # noqa: E731
    with pytest.raises(ValueError, match=r"left 4 tensors of unit '<root>' uninitialised \(wte.weight, wpe.weight"):
        fzero.init(meta, fzero.zero3(fzero.adamw()), fzero.SimMesh(2), initializer=linear_only)
    with pytest.raises(ValueError, match="GatherPolicy.prefetch must be an int >= 0"):
        fzero.GatherPolicy(prefetch=-1)


@pytest.mark.timeout(900)
def test_memory_on_two_gloo_processes(tmp_path):
    """A model of ~1.5 GB of fp32 parameters in 12 units, 2 gloo processes, AdamW with donation.

    Stage 3's peak resident memory per rank stays within
        baseline + (model states) / world + optimizer temporary + (1 + prefetch) x largest unit + slack
    where model states = 4 (params) + 4 (gradients) + 8 (Adam moments) bytes per parameter, the optimizer
    temporary is Adam's one shard-sized denominator, and slack (64 MiB) covers activations and allocator rounding.
    Stage 2 holds full parameters and full gradients on every rank, and is visibly higher. Sharded construction
    peaks below baseline + its shards (parameters and the two Adam moments: 12 bytes per parameter / world) + two
    copies of one unit (the module's tensors and the unit's flat buffer) + slack."""
    d, layers, world, prefetch = 5600, 12, 2, 1
    results = {}
    for stage in (3, 2):
        spawn(zero3_worker.run, (world, str(tmp_path), stage, d, layers, prefetch, 1), world)
        results[stage] = [json.loads((tmp_path / f"rank{r}-stage{stage}-prefetch{prefetch}.json").read_text())
                          for r in range(world)]  # fmt: skip
    mib = 2**20
    for r in range(world):
        z3, z2 = results[3][r], results[2][r]
        psi, unit = z3["numel"], z3["largest_unit"] * 4
        states = 16 * psi // world
        temporary = 4 * psi // world
        bound = z3["baseline"] + states + temporary + (1 + prefetch) * unit + 64 * mib
        init_bound = z3["baseline"] + 12 * psi // world + 2 * unit + 64 * mib
        print(f"rank {r}: Psi {z3['psi'] / 1e6:.1f}M ({4 * z3['psi'] / 2**30:.2f} GiB fp32), largest unit "
              f"{unit / mib:.0f} MiB, baseline {z3['baseline'] / mib:.0f} MiB")  # fmt: skip
        print(
            f"  stage 3 step peak {z3['step_peak'] / mib:.0f} MiB <= bound {bound / mib:.0f} MiB "
            f"= baseline + 16 Psi/W {states / mib:.0f} + 4 Psi/W {temporary / mib:.0f} + (1+{prefetch}) x unit + 64"
        )
        print(f"  stage 2 step peak {z2['step_peak'] / mib:.0f} MiB")
        print(f"  sharded construction peak {z3['init_peak'] / mib:.0f} MiB <= {init_bound / mib:.0f} MiB "
              f"= baseline + 12 Psi/W + 2 x unit + 64")  # fmt: skip
        assert z3["step_peak"] <= bound
        assert z2["step_peak"] > z3["step_peak"] + 2 * psi  # stage 2 keeps >= full params + full grads extra
        assert z3["init_peak"] <= init_bound
        assert z3["loss"] == z2["loss"]  # same training either way


@pytest.mark.timeout(300)
def test_init_of_a_model_in_memory_adds_little_on_two_gloo_processes(tmp_path, monkeypatch):
    """`fzero.init` of a model built in memory (67M fp32 parameters in 16 units, 2 gloo processes) at stage 3.

    On top of the model it holds, the state is this rank's shard of the parameters and Adam's two moments
    (12 bytes per parameter / world); on the way, the full flat buffer the parameters are copied into (4 bytes per
    parameter, needed to broadcast rank 0's values) and this rank's shard cut from it, unit by unit. So the peak
    added stays within
        4 Psi (flat buffer) + 4 Psi/W (its shard) + 2 x largest unit (a unit's broadcast, its shard) + slack,
    which W = 2 makes the same as the state's own 12 Psi/W, and slack (64 MiB) covers allocator rounding. A whole
    second copy of the model on the way (the broadcast's result, a rank-major copy, the flat buffer kept while the
    moments are made) costs another 4 Psi and breaks it.

    The workers run with glibc's mmap threshold fixed at 1 MiB: every freed block of 1 MiB or more goes back to the
    system at once, so the resident set is what init holds. (Left dynamic, glibc serves the unit-sized temporaries
    from its heap after the first and keeps up to twice the largest there: the allocator's retention, not init's.)"""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # (read by each spawned worker's glibc at start)
    d, layers, world = 2048, 16, 2
    spawn(zero3_worker.run_init, (world, str(tmp_path), 3, d, layers), world)
    results = [json.loads((tmp_path / f"init-rank{r}-stage3.json").read_text()) for r in range(world)]
    mib = 2**20
    for r, res in enumerate(results):
        psi, unit = 4 * res["numel"], 4 * res["largest_unit"]  # bytes
        bound = psi + psi // world + 2 * unit + 64 * mib
        added, kept = res["init_peak"] - res["before"], res["after"] - res["before"]
        print(f"rank {r}: model {psi / mib:.0f} MiB fp32, init's peak adds {added / mib:.0f} MiB <= {bound / mib:.0f}, "
              f"its state {kept / mib:.0f} MiB (12 Psi/W = {3 * psi // world / mib:.0f})")  # fmt: skip
        assert added <= bound
        assert kept <= 3 * psi // world + 64 * mib
    assert results[0]["rank0_exact"]  # every rank's state holds rank 0's model (each rank built its own)


def test_unit_timings_on_request():
    model = GPT(CFG)
    mesh = fzero.SimMesh(2)
    tx = fzero.zero3(fzero.adamw(1e-2))
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, gather=fzero.GatherPolicy(timings=True))
    _, metrics = step(state, lm_batches(model, 2, 1, 2, 1, 0)[0])
    assert set(metrics["unit_times"]) == {"blocks.0", "blocks.1", "blocks.2"}
    assert all(f > 0 and b > 0 for f, b in metrics["unit_times"].values())
    _, metrics = fzero.train_step(model, lm_loss(model), tx, mesh)(state, lm_batches(model, 2, 1, 2, 1, 0)[0])
    assert "unit_times" not in metrics

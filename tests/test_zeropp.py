"""ZeRO++ at stage 3 (`fzero.zero3(..., hpz=, qwz=, qwz_frozen=, qgz=)`): hpZ is bitwise plain stage 3 and moves the
backward's gathers onto the `shard` axis; qwZ's unit gathers stay within the bound derived in `fzero.gather`, and
are those of stage 2's qwZ; the hierarchical qgZ stays within its bound; the ledger's slow-axis bytes; the errors.
(The same chains on a 2-D `DistMesh` of 4 processes: tests/test_hybrid.py's `zero++` cases.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.layout import make_layout
from fzero.mesh.ranks import ranks_of
from fzero.transforms.base import Context
from tests.support import differing, lm_batches, lm_loss, tiny_gpt
from tests.test_quantize import SLACK, block_max


def run(tx, mesh, micro=1, steps=2, precision_dtype=torch.float32, frozen=False, seed=0):
    """`steps` steps of the tiny GPT; the consolidated parameters, the last metrics, the ledger, the state."""
    model = tiny_gpt(seed)
    if frozen:
        model.blocks[0].ln2.requires_grad_(False)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    with mesh.record() as ledger:
        for batch in lm_batches(model, mesh.world, micro, 2, steps, seed + 1):
            state, metrics = step(state, batch)
    return fzero.state_dict(state), metrics, ledger, state


@settings(max_examples=6, deadline=None)
@given(
    shape=st.sampled_from([(1, 2), (2, 1), (2, 2), (3, 2), (2, 3)]),
    micro=st.sampled_from([1, 2]),
    precision=st.sampled_from([None, "bf16"]),
    clip=st.sampled_from([None, 0.5]),
    frozen=st.booleans(),
    prefetch=st.sampled_from([0, 1, 2]),
)
def test_hpz_is_bitwise_plain_stage3_and_regathers_within_the_shard_axis(shape, micro, precision, clip, frozen,
                                                                          prefetch):  # fmt: skip
    R, S = shape
    policy = fzero.GatherPolicy(prefetch=prefetch)
    results = {}
    for hpz in (False, True):
        mesh = fzero.SimMesh(shape={"replicate": R, "shard": S})
        tx = fzero.zero3(fzero.adamw(1e-2), accumulate=micro, precision=precision, clip=clip, hpz=hpz)
        model = tiny_gpt(0)
        if frozen:
            model.blocks[0].ln2.requires_grad_(False)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, lm_loss(model), tx, mesh, gather=policy)
        with mesh.record() as ledger:
            for batch in lm_batches(model, mesh.world, micro, 2, 2, 1):
                state, metrics = step(state, batch)
        results[hpz] = fzero.state_dict(state), metrics, ledger, state
    (plain, _, lp, _), (hpz, metrics, lh, state) = results[False], results[True]
    assert not differing(hpz, plain)  # the secondary copies hold exactly what the forward gathered
    # the backward's gathers moved from every rank to the shard axis: the same payload in all
    gathered = lp.entries["all_gather"]["bytes"]
    assert lh.entries["all_gather"]["bytes"] + lh.entries["all_gather:shard"]["bytes"] == gathered
    assert lh.entries["all_gather"]["calls"] < lp.entries["all_gather"]["calls"]
    if R > 1:  # nothing of the backward's gathers crosses the replicate axis
        assert lh.crossing(mesh.shape, "shard") < lp.crossing(mesh.shape, "shard")
    # the memory it costs: at most Psi / S compute elements (and frozen) per rank, as state_bytes says
    frozen_numel = state.layout.frozen_layout.numel if frozen else 0
    assert 0 < metrics["secondary_peak"] <= (state.layout.numel + frozen_numel) // S
    item = state.plan.compute_dtype.itemsize
    assert fzero.state_bytes(state)["secondary"] == (state.layout.numel + frozen_numel) * item // S


@settings(max_examples=8, deadline=None)
@given(world=st.integers(2, 4), micro=st.sampled_from([1, 2]), frozen=st.booleans())
def test_qwz_at_stage3_equals_qwz_at_stage2(world, micro, frozen):
    """fp32: stage 3 gathers each unit's piece int8 in blocks of 16 for the forward and again for the backward;
    stage 2 gathers the whole shard so at the end of each step: the same blocks (every unit's piece starts at a
    multiple of `align` = 16), so the same compute parameters, bitwise; and not the exact ones."""
    z3, *_ = run(fzero.zero3(fzero.adamw(1e-2), accumulate=micro, qwz=True), fzero.SimMesh(world), micro, frozen=frozen)
    z2, *_ = run(fzero.zero2(fzero.adamw(1e-2), accumulate=micro, qwz=True), fzero.SimMesh(world), micro, frozen=frozen)
    exact, *_ = run(fzero.zero3(fzero.adamw(1e-2), accumulate=micro), fzero.SimMesh(world), micro, frozen=frozen)
    assert not differing(z3, z2)
    assert differing(z3, exact)


@given(
    world=st.integers(2, 6),
    numel=st.integers(1, 300),
    block=st.sampled_from([1, 5, 16, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    heavy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_unit_gather_is_within_the_bound(world, numel, block, dtype, heavy, seed):
    """`gather(quantize=block)`'s bound, element by element: `max|w_b| / 254` of the element's block in its rank's
    piece, plus, in bf16, the rounding of the dequantized value to bf16 (half an ulp: `|w| 2^-8`, the value being
    at most `|w| + max|w_b| / 254`)."""
    g = torch.Generator().manual_seed(seed)
    layout = make_layout([("w", (numel,), dtype)], world=world, align=4)
    shards = torch.randn(world, layout.shard_numel, generator=g)
    if heavy:
        shards = shards * torch.logspace(-4, 2, layout.shard_numel)
    shards = shards.to(dtype)
    out = torch.empty(layout.numel, dtype=dtype)
    ranks = ranks_of(fzero.SimMesh(world))
    ranks.gather_into(out, shards, layout.unit_shard_slice(0), 0, False, None, block)
    exact = shards[:, layout.unit_shard_slice(0)].reshape(-1).double()
    bmax = block_max(shards[:, layout.unit_shard_slice(0)].reshape(1, -1).float(), world, block)[0].double()
    bound = bmax / 254 * (1 + SLACK)
    if dtype == torch.bfloat16:
        bound = bound + (exact.abs() + bmax / 254) * 2.0**-8
    assert ((out.double() - exact).abs() <= bound).all()


@given(
    R=st.integers(1, 3),
    S=st.integers(1, 3),
    numel=st.integers(1, 600),
    block=st.sampled_from([1, 7, 32, 256]),
    heavy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_two_level_qgz_is_within_its_bound(R, S, numel, block, heavy, seed):
    """`quantized_reduce_scatter(levels=...)`, element by element against the float64 mean over every rank: fp32
    within the node (`shard`), then one int8 exchange of the nodes' means across `replicate`, so the error is the
    mean over the nodes of their mean's block max / 254; each rank gets its own 1-D chunk. On one node (R = 1)
    nothing is quantized: bitwise the plain fp32 reduce-scatter."""
    g = torch.Generator().manual_seed(seed)
    mesh = fzero.SimMesh(shape={"replicate": R, "shard": S})
    W = R * S
    layout = make_layout([("w", (numel,), torch.float32)], world=W, align=4)
    x = torch.randn(W, layout.numel, generator=g)
    if heavy:
        x = x * torch.logspace(-4, 2, layout.numel)
    tx = fzero.quantized_reduce_scatter(block, levels=("replicate", "shard"))
    got = tx.unit(x, 0, Context(mesh, layout))
    if R == 1:
        assert torch.equal(got, fzero.reduce_scatter().unit(x, 0, Context(mesh, layout)))
    exact = fzero.reduce_scatter().unit(x.double(), 0, Context(mesh, layout))
    # the node's mean of the chunks in (shard, replicate) order: R chunks of s, one per node, quantized across nodes
    y = x.double().unflatten(-1, (R, S, -1)).transpose(-3, -2).flatten(-3)
    node_mean = mesh.reduce_scatter(y, "mean", axis="shard")  # [W, R * s]
    e = mesh.reduce_scatter(block_max(node_mean, R, block) / 254, "mean", axis="replicate") if R > 1 else 0
    M = x.abs().max().item()
    assert ((got.double() - exact).abs() <= e + SLACK * M).all()


def test_zeropp_slow_axis_bytes_against_plain_stage3():
    """ZeRO++'s tutorial setting (hpZ over 2, qwZ, qgZ) against plain stage 3 on the same 4 ranks (2 nodes of 2):
    the bytes a rank receives from the other node per step (`Ledger.crossing`). fp32 here: the forward gather goes
    from 4 to 1.25 bytes per element (int8 and a 4-byte scale per 16), the backward gather stays within the node
    (hpZ), and the gradient's reduction is fp32 within the node and sends 1/2 of it int8 (blocks of 256) across,
    where the plain one sends 1/2 of it in fp32: in all more than 4x less (docs/hybrid.md)."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    _, _, lp, _ = run(fzero.zero3(fzero.adamw(1e-2)), mesh, steps=3)
    _, metrics, lz, _ = run(fzero.zero3(fzero.adamw(1e-2), hpz=True, qwz=True, qgz=True), mesh, steps=3)
    slow_plain, slow_zpp = lp.crossing(mesh.shape, "shard"), lz.crossing(mesh.shape, "shard")
    assert slow_plain >= 4 * slow_zpp
    assert lz.on("shard")["all_gather"]["bytes"] > 0
    # qgZ: fp32 within the node (the plain reduce-scatter's bytes), int8 only across nodes
    assert lz.on("shard")["reduce_scatter"]["bytes"] == lp.entries["reduce_scatter"]["bytes"]
    assert list(lz.on("replicate")) == ["all_to_all"] and "all_to_all:shard" not in lz.entries
    # and it trains: within 2% of the exact run's loss (a few steps of a tiny model)
    exact_loss = float(run(fzero.zero3(fzero.adamw(1e-2)), fzero.SimMesh(4), steps=3)[1]["loss"].mean())
    assert abs(float(metrics["loss"].mean()) - exact_loss) <= 0.02 * exact_loss


def test_errors():
    with pytest.raises(ValueError, match="hybrid sharding already gathers within the shard axis"):
        fzero.zero3(fzero.adamw(), hybrid=True, hpz=True)
    with pytest.raises(ValueError, match="need lazy=True and keep=False"):
        fzero.gather(lazy=True, keep=True, quantize=16)
    with pytest.raises(ValueError, match=r"gather\(quantize=...\) needs None or an int >= 1"):
        fzero.gather(lazy=True, quantize=0)
    with pytest.raises(ValueError, match="has no named axes"):
        fzero.init(tiny_gpt(0), fzero.zero3(fzero.adamw(), hpz=True), fzero.SimMesh(4))
    with pytest.raises(ValueError, match=r"needs a mesh whose axes are exactly \['replicate', 'shard'\]"):
        fzero.init(tiny_gpt(0), fzero.zero3(fzero.adamw(), qgz=True, hpz=True), fzero.SimMesh(4))
    with pytest.raises(ValueError, match="takes no axis or replicate"):
        fzero.quantized_reduce_scatter(axis="shard", levels=("replicate", "shard"))
    for bad in (("shard",), ("shard", "shard"), "shard", 1):
        with pytest.raises(ValueError, match=r"qgz must be False, True or a pair \(outer_axis, inner_axis\)"):
            fzero.zero3(fzero.adamw(), qgz=bad)
    with pytest.raises(ValueError, match="takes no axis or replicate"):  # hybrid shards over the node already
        fzero.zero2(fzero.adamw(), hybrid=True, qgz=("replicate", "shard"))


def test_qwz_reads_the_same_weights_in_every_path():
    """Every way a stage-3 state's compute parameters are read quantizes them alike: the per-unit gathers of the
    step, the whole-buffer gather of `autodiff="func"`, and evaluation (`eval_step`)."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = fzero.zero3(fzero.adamw(1e-2), qwz=True, hpz=True)
    by_path = {}
    for autodiff in ("autograd", "func"):
        model = tiny_gpt(0)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, lm_loss(model), tx, mesh, autodiff=autodiff)
        for batch in lm_batches(model, mesh.world, 1, 2, 2, 1):
            state, _ = step(state, batch)
        by_path[autodiff] = fzero.state_dict(state)
        loss = fzero.eval_step(model, lm_loss(model), mesh)(state, batch)
        mean = loss[0]
        for r in range(1, mesh.world):  # the step's loss: the ranks' mean, summed in rank order
            mean = mean + loss[r]
        assert torch.equal(mean / mesh.world, step(state, batch)[1]["loss"])
    assert not differing(by_path["func"], by_path["autograd"])

"""Quantized collectives (qgZ, qwZ): each reduction's error against the exact mean stays within the bound derived in
`fzero.transforms.quantize`, the compute weights stay within theirs, and the presets' options compose."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.layout import make_layout
from fzero.transforms.base import Context
from fzero.transforms.quantize import dequantize, quantize
from tests.support import lm_batches, lm_loss, tiny_gpt

# the bounds are exact in real arithmetic; fp32 adds a relative rounding of the order of n u (u = 2^-24) to the
# terms (the quantized values, the sum of n of them, the division): 1e-5 of M covers n <= 9 with a wide margin
SLACK = 1e-5


@given(n=st.integers(1, 700), block=st.integers(1, 300), scale=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16))
def test_quantize_error_is_within_half_a_step(n, block, scale, seed):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = quantize(x, block)
    back = dequantize(q, s, block, n)
    assert q.dtype == torch.int8 and back.shape == x.shape
    pad = torch.nn.functional.pad(x, (0, -n % block)).unflatten(-1, (-1, block))
    bmax = pad.abs().amax(-1, keepdim=True).expand_as(pad).flatten(-2)[..., :n]  # each element's block max
    assert ((back - x).abs() <= bmax / 254 * (1 + SLACK)).all()


def block_max(x: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Per rank and element of `[W, n * s]`: the max |x| of the quantization block (within its chunk) holding it."""
    chunks = x.unflatten(-1, (n, -1))
    s = chunks.shape[-1]
    pad = torch.nn.functional.pad(chunks, (0, -s % block)).unflatten(-1, (-1, block))
    return pad.abs().amax(-1, keepdim=True).expand_as(pad).flatten(-2)[..., :s].flatten(-2)


@given(
    R=st.integers(1, 3),
    S=st.integers(1, 3),
    hybrid=st.booleans(),
    quantize_replicate=st.booleans(),
    numel=st.integers(1, 900),
    block=st.sampled_from([1, 7, 32, 256]),
    heavy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_qgz_error_is_within_the_stated_bound(R, S, hybrid, quantize_replicate, numel, block, heavy, seed):
    """The bound of `quantized_reduce_scatter`'s docstring, element by element, against the float64 mean."""
    g = torch.Generator().manual_seed(seed)
    if hybrid:
        mesh, kw, n = fzero.SimMesh(shape={"replicate": R, "shard": S}), {"axis": "shard", "replicate": "replicate"}, S
    else:
        mesh, kw, n = fzero.SimMesh(R * S), {}, R * S
    layout = make_layout([("w", (numel,), torch.float32)], world=n, align=4)
    layout = layout.on_axis("shard") if hybrid else layout
    x = torch.randn(mesh.world, layout.numel, generator=g)
    if heavy:  # gradients of very different sizes in one buffer: the blockwise scales' case
        x = x * torch.logspace(-4, 2, layout.numel)
    tx = fzero.quantized_reduce_scatter(block, quantize_replicate=quantize_replicate, **kw)
    got = tx.unit(x, 0, Context(mesh, layout)).double()
    exact = fzero.reduce_scatter(**kw).unit(x.double(), 0, Context(mesh, layout))
    # e1: the mean over the shard group of each rank's block max / 254, then averaged over the replicate groups
    e1 = mesh.reduce_scatter(block_max(x, n, block).double() / 254, "mean", **({"axis": "shard"} if hybrid else {}))
    if hybrid:
        e1 = mesh.all_reduce(e1, "mean", axis="replicate")
    M = x.abs().max().item()
    bound = e1 + (2 * M * (1 + 1 / 254) / 254 if hybrid and quantize_replicate and R > 1 else 0)
    assert ((got - exact).abs() <= bound + SLACK * M).all()
    if n == 1 and not (hybrid and quantize_replicate and R > 1):
        # one rank per group: nothing is quantized on the way (its own chunk), the reduction is exact fp32
        assert torch.equal(got.float(), fzero.reduce_scatter(**kw).unit(x, 0, Context(mesh, layout)))


def test_qwz_compute_weights_are_within_the_bound_and_masters_exact():
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    plain = fzero.init(model, fzero.zero2(fzero.adamw(), hybrid=True), mesh)
    state = fzero.init(model, fzero.zero2(fzero.adamw(), hybrid=True, qwz=True), mesh)
    assert torch.equal(state.params, plain.params)  # the master shards are exact
    full = fzero.layout.unshard(state.layout, state.params[:2])
    compute = state.compute[0]
    assert state.layout.is_full(state.compute) and all(torch.equal(c, compute) for c in state.compute)
    # blocks of `align` (the default) elements along each rank's shard, in rank-major order
    rank_major = fzero.layout.to_rank_major(state.layout, full)[None]
    bound = fzero.layout.to_unit_major(state.layout, block_max(rank_major, 2, state.layout.align))[0]
    assert ((compute - full).abs() <= bound / 254 * (1 + SLACK)).all()
    assert not torch.equal(compute, full)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_presets_train_with_quantized_collectives(stage):
    """qgZ and qwZ train; the loss after a few steps is within 2% of fp32 communication's, and the ledger shows
    int8 payloads on both axes."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    losses = {}
    for name, opts in {"fp32": {}, "q": {"qgz": True, "qwz": True}}.items():
        model = tiny_gpt(0)
        tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), hybrid=True, **opts)
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
        for batch in lm_batches(model, 4, 1, 2, 4, 3):
            state, metrics = step(state, batch)
        losses[name] = float(metrics["loss"])
        comm = metrics["comm"]
    assert abs(losses["q"] - losses["fp32"]) <= 0.02 * losses["fp32"]
    shard = state.layout.shard_numel
    # int8 over replicate: the all-to-all and the all-gather each carry Psi / S bytes, plus 4 bytes of scale per
    # 256, plus each unit's chunk for each of the R = 2 ranks padded to a whole block (< 256 + 4 bytes): against
    # 4 Psi / S for fp32 (8 Psi / S counting the all-reduce twice)
    rep = comm["all_to_all:replicate"]["bytes"] + comm["all_gather:replicate"]["bytes"]
    units = len(state.layout.units)
    assert 2 * shard <= rep <= 2 * (shard * (1 + 4 / 256) + units * 2 * (256 + 4))
    assert "all_reduce:replicate" not in comm and "reduce_scatter:shard" not in comm


def test_errors():
    with pytest.raises(ValueError, match="block=...\\) needs an int >= 1, got 0"):
        fzero.quantized_reduce_scatter(block=0)

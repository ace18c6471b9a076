"""`fzero.Average`: where the gradients' mean divides by the world size (DeepSpeed's `prescale_gradients` and
`gradient_predivide_factor`), exactly DeepSpeed's operations, at every stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.transforms import Context, Flow, StepInfo
from tests.bounds import assert_adam_close
from tests.support import differing, mlp, reference_run, regression_batches, regression_loss

AVERAGES = [fzero.Average(), fzero.Average(prescale=True), fzero.Average(predivide=2.0),
            fzero.Average(predivide=3.0), fzero.Average(prescale=True, predivide=8.0)]  # fmt: skip


def _rank_ordered(parts: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """The partial sums of `parts` in rank order (gloo's, and the mesh's)."""
    sums = [parts[0]]
    for p in parts[1:]:
        sums.append(sums[-1] + p)
    return sums


def transcription(grads: torch.Tensor, average: fzero.Average) -> torch.Tensor:
    """DeepSpeed's engine (`allreduce_bucket`), operation for operation, the sum in rank order."""
    world = grads.shape[0]
    if average.prescale:
        parts = [g * (1.0 / world) for g in grads]
    else:
        parts = [g * (1.0 / average.predivide) if average.predivide != 1.0 else g for g in grads]
    total = _rank_ordered(parts)[-1]
    if average.prescale:
        return total
    if average.is_default:
        return total / world
    return total if average.predivide == world else total * (average.predivide / world)


@settings(deadline=None)
@given(world=st.integers(1, 4), n=st.integers(1, 8), index=st.integers(0, len(AVERAGES) - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 99),
       overlap=st.booleans())  # fmt: skip
def test_reductions_are_deepspeeds_operations(world, n, index, dtype, seed, overlap):
    """All-reduce, reduce-scatter and their unit forms (blocking or a handle) give DeepSpeed's values, bitwise."""
    average = AVERAGES[index]
    g = torch.Generator().manual_seed(seed)
    grads = (torch.randn(world, n * world, generator=g) * 100).to(dtype)
    want = transcription(grads, average)
    mesh = fzero.SimMesh(world)
    layout = fzero.layout.make_layout([("w", (n * world,), dtype)], world=world, align=1)
    ctx = Context(mesh, layout, overlap=overlap)
    flow = Flow(grads, torch.zeros(world, n * world, dtype=dtype), None, info=StepInfo())
    got = fzero.all_reduce(average=average).update(flow, None, ctx)[0].grads
    assert torch.equal(got, want.expand_as(got))
    unit = fzero.all_reduce(average=average).unit(grads, 0, ctx)
    assert torch.equal(unit if isinstance(unit, torch.Tensor) else unit.wait(), got)
    shards = fzero.reduce_scatter(average=average).unit(grads, 0, ctx)
    shards = shards if isinstance(shards, torch.Tensor) else shards.wait()
    assert torch.equal(shards.reshape(-1), want)


def test_prescaling_keeps_a_half_precision_sum_finite():
    """The reason DeepSpeed has the option: two fp16 gradients of 40000 sum past fp16's 65504 (the mean, 40000, is
    representable); prescaled, each is halved first and the sum is exact."""
    grads = torch.full((2, 4), 40000.0, dtype=torch.float16)
    mesh, layout = fzero.SimMesh(2), fzero.layout.make_layout([("w", (4,), torch.float16)], world=2, align=1)
    flow = Flow(grads, torch.zeros(2, 4, dtype=torch.float16), None, info=StepInfo())
    plain = fzero.reduce_scatter().update(flow, None, Context(mesh, layout))[0].grads
    pre = fzero.reduce_scatter(average=fzero.Average(prescale=True)).update(flow, None, Context(mesh, layout))[0]
    assert torch.isinf(plain).all()
    assert torch.equal(pre.grads, torch.full((2, 2), 40000.0, dtype=torch.float16))


@settings(deadline=None, max_examples=12)
@given(world=st.integers(2, 3), micro=st.integers(1, 2), index=st.integers(1, len(AVERAGES) - 1),
       seed=st.integers(0, 9))  # fmt: skip
def test_every_stage_averages_alike(world, micro, index, seed):
    """Stages 0-3 with one `Average` train bitwise alike where they do without one (docs/equivalence.md: 0 = 1 and
    2 = 3 at any accumulation, all four at one micro-step; each element's mean is the same operations at every
    stage), and like full-batch AdamW within Adam's step bound (tests/bounds.py, kind 3: the mean rounds
    differently from the reference's one backward over the whole batch)."""
    average = AVERAGES[index]
    model = mlp([6, 5, 3], seed)
    batches = regression_batches(model, world, micro, 2, 3, seed)
    results = []
    for preset in (fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3):
        tx = preset(fzero.adamw(1e-2), accumulate=micro, average=average)
        mesh = fzero.SimMesh(world)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, regression_loss(model), tx, mesh)
        for batch in batches:
            state, _ = step(state, batch)
        results.append(fzero.state_dict(state))
    assert differing(results[1], results[0]) == [] and differing(results[3], results[2]) == []
    if micro == 1:
        assert differing(results[2], results[1]) == []
    ref = reference_run(model, regression_loss, batches, micro, lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert_adam_close(results[0], ref, model.state_dict(), 1e-2, 3)


def test_bad_averages_are_refused():
    with pytest.raises(ValueError, match="predivide must be a positive finite number, got 0"):
        fzero.Average(predivide=0)
    with pytest.raises(ValueError, match="qgz=True .* no prescale or predivide"):
        fzero.zero2(fzero.adamw(), qgz=True, average=fzero.Average(prescale=True))


@settings(deadline=None, max_examples=60)
@given(world=st.sampled_from([2, 4, 8]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       exponent=st.integers(-135, 124), seed=st.integers(0, 99), overlap=st.booleans())  # fmt: skip
def test_a_power_of_two_world_divides_before_the_sum_bitwise(world, dtype, exponent, seed, overlap):
    """The default mean over a power-of-two world divides in the copy to the result's place (one pass fewer,
    `fzero.layout.pieces.exact_division`): bitwise `(sum_r g_r) / world` on every element where no value
    of either order is subnormal or infinite (the exponents here reach both ends of float32's range, so some
    elements are excluded and most are not); and at gradients' usual magnitudes, on every element."""
    g = torch.Generator().manual_seed(seed)
    grads = (torch.randn(world, 256, generator=g) * 2.0**exponent).to(dtype)
    ctx = Context(fzero.SimMesh(world), fzero.layout.make_layout([("w", (256,), dtype)], world=world, align=1),
                  overlap=overlap, place=lambda shape, dt: torch.empty(shape, dtype=dt))  # fmt: skip
    got = fzero.all_reduce().unit(grads, 0, ctx)
    got = (got if isinstance(got, torch.Tensor) else got.wait())[0]
    post = _rank_ordered(grads)[-1] / world
    values = [*_rank_ordered(grads), post, *(grads / world), *_rank_ordered(grads / world)]
    tiny = torch.finfo(dtype).tiny
    fine = torch.stack([(v == 0) | ((v.abs() >= tiny) & v.isfinite()) for v in values]).all(0)
    assert torch.equal(got[fine], post[fine])
    if -90 <= exponent <= 100:  # (|g| >= ~2^-120: a sum that cancels to below 2^-126 cancels to 0)
        assert fine.all()


def test_the_division_moves_before_the_sum_only_where_it_is_exact():
    exact = fzero.layout.pieces.exact_division
    assert exact(2, torch.float32) and exact(4, torch.bfloat16) and exact(8, torch.float64)
    assert not exact(1, torch.float32) and not exact(3, torch.float32) and not exact(6, torch.bfloat16)
    assert not exact(2, torch.float16)  # (float16's subnormals, below 6.1e-5, are within a gradient's range)
    # why: a subnormal halved rounds to even first; the sum of two, halved, does not
    s = torch.tensor([2.0**-149, 2.0**-149])
    assert (s / 2).sum() == 0 and s.sum() / 2 == 2.0**-149

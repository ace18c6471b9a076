"""`fzero.Average`: where the gradients' mean divides by the world size (DeepSpeed's `prescale_gradients` and
`gradient_predivide_factor`), exactly DeepSpeed's operations, at every stage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.transforms import Context, Facts, Flow
from tests.bounds import assert_adam_close
from tests.support import differing, mlp, reference_run, regression_batches, regression_loss

AVERAGES = [fzero.Average(), fzero.Average(prescale=True), fzero.Average(predivide=2.0),
            fzero.Average(predivide=3.0), fzero.Average(prescale=True, predivide=8.0)]  # fmt: skip


def transcription(grads: torch.Tensor, average: fzero.Average) -> torch.Tensor:
    """DeepSpeed's engine (`allreduce_bucket`), operation for operation, the sum in rank order."""
    world = grads.shape[0]
    if average.prescale:
        parts = [g * (1.0 / world) for g in grads]
    else:
        parts = [g * (1.0 / average.predivide) if average.predivide != 1.0 else g for g in grads]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
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
    flow = Flow(grads, torch.zeros(world, n * world, dtype=dtype), None, facts=Facts())
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
    flow = Flow(grads, torch.zeros(2, 4, dtype=torch.float16), None, facts=Facts())
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

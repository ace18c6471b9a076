"""The five transforms of docs/extending.md: gradient noise, clipping by value, a gradient mask, a top-k reduction
with error feedback and per-unit gradient norms. The page shows this file's code; tests/test_extending.py checks that
the two are the same, and trains each at stages 0-3 on a `SimMesh` and on 2 gloo processes.

Each uses only the public transform API (`fzero.Transform`, `fzero.stateless`, `Flow`, `StepInfo`, `Context`), the
layout and the mesh's collectives, and knows no other transform's fields or state.
"""

from __future__ import annotations

import functools

import torch

import fzero
from fzero.layout import to_rank_major

__all__ = ["clip_by_value", "grad_mask", "gradient_noise", "topk_reduce", "unit_norms"]


def gradient_noise(std):
    """Add Gaussian noise of standard deviation `std` to the gradient at its true scale, drawn with `ctx.key`: the
    same on every rank that holds the same values (replicas stay equal) and on every mesh. Padding stays zero."""

    def update(flow, ctx):
        flow = flow.unscaled()  # the noise is relative to the true gradient, not to a loss-scaled one
        grads, real = flow.gradients("gradient_noise"), ~ctx.layout.padding_mask()  # real: not padding
        if flow.sharded:  # this rank's shard of the mask, as reduce_scatter() cut the gradient
            real = ctx.mesh.local_shard(to_rank_major(ctx.layout, real), axis=ctx.layout.axis)
        g = torch.Generator(grads.device).manual_seed(ctx.key)
        noise = torch.randn(grads.shape, generator=g, dtype=grads.dtype, device=grads.device) * std
        return flow._replace(grads=grads + noise * real.to(grads.device))

    return fzero.stateless(update, "gradient_noise")


def clip_by_value(limit):
    """Clamp every gradient element to `[-limit, limit]` at its true scale (the factor the gradients still owe is
    folded into the bound, not paid: no extra pass)."""

    def update(flow, ctx):
        bound = limit / flow.info.grad_factor  # under a loss scale s the gradients are s times their true values
        return flow._replace(grads=flow.gradients("clip_by_value").clamp(-bound, bound))

    return fzero.stateless(update, "clip_by_value")


def grad_mask(keep):
    """Zero the gradient wherever `keep[name]` (a bool tensor broadcastable to parameter `name`'s shape) is False:
    those elements never learn under an optimizer whose step is zero for a zero gradient (Adam, SGD; without weight
    decay). Parameters not named in `keep` learn as usual. Works on the full gradient, per unit (stage 3) and on
    this rank's shard after the reduction."""

    @functools.cache
    def full(layout, device):  # the mask over the full flat buffer, `[numel]`; padding True (its gradient is 0)
        names = {leaf.name for leaf in layout.leaves}
        if not keep.keys() <= names:
            raise ValueError(f"grad_mask: the model has no trainable parameter {sorted(keep.keys() - names)}")
        mask = torch.ones(layout.numel, dtype=torch.bool)
        for leaf in layout.leaves:
            if leaf.name in keep:
                mask[leaf.offset : leaf.offset + leaf.numel] = keep[leaf.name].expand(leaf.shape).reshape(-1)
        return mask.to(device)

    def update(flow, ctx):
        grads = flow.gradients("grad_mask")
        mask = full(ctx.layout, grads.device)
        if flow.sharded:  # after reduce_scatter(): this rank's shard of the mask
            mask = ctx.mesh.local_shard(to_rank_major(ctx.layout, ctx.mesh.replicate(mask)), axis=ctx.layout.axis)
        return flow._replace(grads=torch.where(mask, grads, 0))

    def unit(grads, index, ctx):  # stage 3: one unit's full gradient, before the reduction
        return torch.where(full(ctx.layout, grads.device)[ctx.layout.unit_slice(index)], grads, 0)

    return fzero.stateless(update, "grad_mask", unit)


def topk_reduce(k, inner=None):
    """A reduction that sends only each rank's `k` largest gradient elements (by magnitude; all of those tied at
    the cut) through `inner` (default `reduce_scatter()`; `all_reduce()` at stage 0) and keeps the rest, the
    residual, in its own state, adding it to the next step's gradient (error feedback). It has no `unit` form:
    stage 3 reduces each unit during the backward, where no state can be read or written, so `fzero.init` refuses
    it at stage 3."""
    inner = fzero.reduce_scatter() if inner is None else inner
    if not inner.reduces:
        raise ValueError(f"topk_reduce: inner must be a reduction (reduce_scatter(), all_reduce()), got {inner.name}")

    def init(flow, ctx):
        residual = flow.params.new_zeros(*flow.params.shape[:-1], ctx.layout.numel)  # a full gradient per rank
        flow, inner_state = inner.init(flow, ctx)
        return flow, (inner_state, residual)

    def update(flow, state, ctx):
        inner_state, residual = state
        acc = flow.gradients("topk_reduce") + residual
        cut = acc.abs().topk(min(k, acc.shape[-1]), dim=-1).values[..., -1:]  # each rank's k-th largest |element|
        sent = torch.where(acc.abs() >= cut, acc, 0)
        flow, inner_state = inner.update(flow._replace(grads=sent), inner_state, ctx)
        return flow, (inner_state, acc - sent)  # acc - sent: exactly the elements not sent, the others exactly 0

    return fzero.Transform(init, update, "topk_reduce", reduces=True, axis=inner.axis)


def unit_norms(prefix="unit_grad_norm/"):
    """Report each unit's gradient norm (at the gradients' true scale: times `StepInfo.grad_factor`) in the step's
    metrics, as `prefix + unit name`. It reads the averaged gradient, full (after `all_reduce()`) or this rank's
    shard (after `reduce_scatter()`: the ranks' parts are added with a one-element-per-unit all-reduce), so it goes
    after the reduction, where stage 3 runs it too: it needs no `unit` form."""

    def update(flow, ctx):
        if not flow.info.reduced:
            raise ValueError("unit_norms() needs averaged gradients: put it after reduce_scatter() or all_reduce()")
        grads, layout = flow.gradients("unit_norms"), ctx.layout
        part = layout.unit_shard_slice if flow.sharded else layout.unit_slice  # where unit i is in `grads`
        sumsq = torch.stack([grads[..., part(i)].double().square().sum(-1) for i in range(len(layout.units))], -1)
        if flow.sharded:
            sumsq = ctx.mesh.all_reduce(sumsq, "sum", axis=layout.axis)
        norms = ctx.mesh.unreplicate(sumsq).sqrt() * abs(flow.info.grad_factor)
        return flow.with_metrics(**{prefix + u.name: float(n) for u, n in zip(layout.units, norms, strict=True)})

    return fzero.stateless(update, "unit_norms")

"""Chains built from the public pieces and user-written reduce wrappers (tests/test_transforms.py and its
2-process worker)."""

from __future__ import annotations

import torch

import fzero
from tests.support import lm_loss, tiny_gpt


def bf16_reduce() -> fzero.Transform:
    """A user's wrapper of reduce_scatter: gradients rounded to bfloat16 before the reduction."""
    inner = fzero.reduce_scatter()
    rounded = lambda g: g.bfloat16().to(g.dtype)  # noqa: E731
    return fzero.Transform(
        inner.init,
        lambda flow, state, ctx: inner.update(flow._replace(grads=rounded(flow.grads)), state, ctx),
        "bf16_reduce",
        lambda g, i, ctx: inner.unit(rounded(g), i, ctx),
        reduces=True,
    )


def topk_reduce(fraction: float) -> fzero.Transform:
    """A user's sparsifying reduction: each rank keeps the largest `fraction` of each unit's gradient."""
    inner = fzero.reduce_scatter()

    def sparse(g: torch.Tensor) -> torch.Tensor:
        k = max(1, int(g.shape[-1] * fraction))
        idx = g.abs().topk(k, dim=-1).indices
        return torch.zeros_like(g).scatter(-1, idx, g.gather(-1, idx))

    def update(flow, state, ctx):
        parts = [sparse(flow.grads[..., ctx.layout.unit_slice(i)]) for i in range(len(ctx.layout.units))]
        return inner.update(flow._replace(grads=torch.cat(parts, -1)), state, ctx)

    return fzero.Transform(inner.init, update, "topk_reduce", lambda g, i, ctx: inner.unit(sparse(g), i, ctx), True)


REDUCES = {
    "reduce_scatter": fzero.reduce_scatter,
    "bf16": bf16_reduce,
    "topk": lambda: topk_reduce(0.3),
    "nested": lambda: fzero.chain(fzero.identity(), fzero.reduce_scatter()),
}


def make_chain(spec: dict, stage: int) -> fzero.Transform:
    """A chain from `spec` (drawn by `chains()`), stage 2 (`gather()`) or 3 (`gather(lazy=True)`)."""
    parts = [REDUCES[spec["reduce"]](), fzero.accumulate(spec["micro"])]
    if spec["scale"]:
        parts.append(fzero.scale_loss(spec["scale"]))
    if spec["clip"]:
        parts.append(fzero.clip_by_global_norm(spec["clip"]))
    opt = {"adamw": fzero.adamw(1e-2), "sgd": fzero.sgd(5e-2, momentum=0.9), "cpu_adamw": fzero.cpu_adamw(1e-2)}
    parts.append(fzero.shard_update(opt[spec["opt"]]))
    parts.append(fzero.gather(lazy=stage == 3))
    return fzero.chain(*parts)


def train(spec: dict, stage: int, mesh, batches, model=None):
    model = model or tiny_gpt(1)
    tx = make_chain(spec, stage)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    return fzero.state_dict(state, mesh)

"""The transforms that communicate: `all_reduce`, `reduce_scatter` and `gather`.

- `all_reduce()`: full gradients -> their mean over ranks, on every rank (stage 0).
- `reduce_scatter()`: full gradients -> this rank's shard of their mean (stages 1-3); at init it turns the master
  parameters into this rank's shard, so what follows holds 1/world of the state.
- `gather()`: after the update, the new master shards -> full compute parameters on every rank (stages 0-2; stage 3
  leaves it out and gathers at the start of the next step instead).

Means are the rank-ordered sum divided by `world` (see `fzero.mesh`), so per element an all-reduce and a
reduce-scatter give the same value, bitwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import Layout, to_rank_major, to_unit_major
from ..mesh import Mesh
from .base import Context, Flow, Transform

__all__ = ["all_reduce", "gather", "gather_params", "reduce_scatter"]


def _require_full(flow: Flow, ctx: Context, what: str) -> None:
    if not flow.is_full(ctx.layout, flow.grads):
        raise ValueError(
            f"{what}() needs full gradients ({ctx.layout.numel} elements per rank) but got "
            f"{flow.grads.shape[-1]}: it must come before reduce_scatter() in the chain"
        )


def all_reduce() -> Transform:
    """Average full gradients over ranks (plain data parallelism)."""

    def update(flow: Flow, state: tuple, ctx: Context) -> tuple[Flow, tuple]:
        _require_full(flow, ctx, "all_reduce")
        return flow._replace(grads=ctx.mesh.all_reduce(flow.grads, "mean")), state

    return Transform(lambda flow, ctx: (flow, ()), update)


def reduce_scatter() -> Transform:
    """Average full gradients over ranks, keeping only this rank's shard; shards the parameters at init."""

    def init(flow: Flow, ctx: Context) -> tuple[Flow, tuple]:
        if not flow.is_full(ctx.layout) or ctx.layout.world == 1:
            if ctx.layout.world == 1:
                return flow, ()
            raise ValueError("reduce_scatter() appears twice in the chain: the parameters are already sharded")
        return flow._replace(params=ctx.mesh.local_shard(to_rank_major(ctx.layout, flow.params))), ()

    def update(flow: Flow, state: tuple, ctx: Context) -> tuple[Flow, tuple]:
        _require_full(flow, ctx, "reduce_scatter")
        return flow._replace(grads=ctx.mesh.reduce_scatter(to_rank_major(ctx.layout, flow.grads), "mean")), state

    return Transform(init, update)


def gather_params(mesh: Mesh, layout: Layout, params: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Full (unit-major) parameters from master params in either form, cast to `dtype`."""
    full = params if params.shape[-1] == layout.numel else to_unit_major(layout, mesh.all_gather(params))
    return full.to(dtype) if dtype is not None else full


def gather(dtype: torch.dtype | None = None) -> Transform:
    """Gather updated master shards into full compute parameters (in `dtype`, default the master dtype)."""

    def apply(flow: Flow, ctx: Context) -> Flow:
        if flow.compute is not None:
            return flow
        return flow._replace(compute=gather_params(ctx.mesh, ctx.layout, flow.params, dtype))

    return Transform(lambda flow, ctx: (apply(flow, ctx), ()), lambda flow, state, ctx: (apply(flow, ctx), state))

"""The transforms that communicate: `all_reduce`, `reduce_scatter` and `gather`.

- `all_reduce()`: full gradients -> their mean over ranks, on every rank (stage 0).
- `reduce_scatter()`: full gradients -> this rank's shard of their mean (stages 1-3); at init it turns the master
  parameters into this rank's shard, so what follows holds 1/world of the state.
- `gather()`: after the update, the new master shards -> full compute parameters on every rank (stages 0-2);
  `gather(lazy=True)` keeps them as this rank's shard, and the step all-gathers them before the next forward
  (stage 3: parameters sharded at rest).

Means are the rank-ordered sum divided by `world` (see `fzero.mesh`), so per element an all-reduce and a
reduce-scatter give the same value, bitwise. Gradients travel in `dtype` (the policy's reduce dtype).
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


def _cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None else x.to(dtype)


def all_reduce(dtype: torch.dtype | None = None) -> Transform:
    """Average full gradients over ranks (plain data parallelism), communicating in `dtype`."""

    def update(flow: Flow, state: tuple, ctx: Context) -> tuple[Flow, tuple]:
        _require_full(flow, ctx, "all_reduce")
        grads = ctx.mesh.all_reduce(_cast(flow.grads, dtype), "mean")
        return flow._replace(grads=grads, reduced=True), state

    return Transform(lambda flow, ctx: (flow, ()), update, "all_reduce")


def reduce_scatter(dtype: torch.dtype | None = None) -> Transform:
    """Average full gradients over ranks, keeping this rank's shard (communicating in `dtype`); shards the
    parameters at init."""

    def init(flow: Flow, ctx: Context) -> tuple[Flow, tuple]:
        flow = flow._replace(reduce_dtype=dtype)
        if flow.presharded or ctx.layout.world == 1:
            return flow._replace(presharded=False), ()
        if not flow.is_full(ctx.layout):
            raise ValueError("reduce_scatter() appears twice in the chain: the parameters are already sharded")
        return flow._replace(params=ctx.mesh.local_shard(to_rank_major(ctx.layout, flow.params))), ()

    def update(flow: Flow, state: tuple, ctx: Context) -> tuple[Flow, tuple]:
        if flow.reduced:  # the step reduce-scattered unit by unit during the backward (stage 3)
            return flow, state
        _require_full(flow, ctx, "reduce_scatter")
        grads = ctx.mesh.reduce_scatter(to_rank_major(ctx.layout, _cast(flow.grads, dtype)), "mean")
        return flow._replace(grads=grads, reduced=True), state

    return Transform(init, update, "reduce_scatter")


def gather_params(mesh: Mesh, layout: Layout, params: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Full (unit-major) parameters from parameters in either form, cast to `dtype` before communicating."""
    params = _cast(params, dtype)
    return params if params.shape[-1] == layout.numel else to_unit_major(layout, mesh.all_gather(params))


def gather(dtype: torch.dtype | None = None, lazy: bool = False) -> Transform:
    """Compute parameters (in `dtype`, default the master dtype) from the updated master parameters: gathered now,
    or with `lazy=True` kept as this rank's shard until the next step's start."""

    def apply(flow: Flow, ctx: Context) -> Flow:
        if flow.compute is not None:
            if lazy or flow.is_full(ctx.layout, flow.compute):
                return flow
            # a shard shard_update already made (fused low-precision copy, or offload's copy on the device)
            return flow._replace(compute=gather_params(ctx.mesh, ctx.layout, flow.compute, dtype))
        compute = _cast(flow.params, dtype) if lazy else gather_params(ctx.mesh, ctx.layout, flow.params, dtype)
        return flow._replace(compute=compute)

    return Transform(
        lambda flow, ctx: (apply(flow, ctx), ()), lambda flow, state, ctx: (apply(flow, ctx), state), "gather"
    )

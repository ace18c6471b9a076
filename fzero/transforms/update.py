"""`shard_update(optimizer)`: apply a functional optimizer to this rank's master parameters.

The optimizer's state has the form of the parameters where `shard_update` sits: sharded after `reduce_scatter`
(ZeRO stages 1-3), full after `all_reduce` (stage 0). The gradients are cast to the master dtype and multiplied by
the factor they still owe (`Flow.grad_factor`: 1 / loss scale times the clipping coefficient) in one pass.
Padding elements have zero gradients and zero values, and every optimizer here maps (0, 0) to 0, so padding stays
zero.
"""

from __future__ import annotations

from typing import Any

import torch

from ..optim import Optimizer
from .base import Context, Flow, Transform

__all__ = ["shard_update"]


def shard_update(optimizer: Optimizer, dtype: torch.dtype | None = None) -> Transform:
    """Update the master parameters (kept in `dtype`, default the model's) with `optimizer`; the compute copy
    becomes stale (None) until gathered."""
    if not isinstance(optimizer, Optimizer):
        name = type(optimizer).__name__
        raise TypeError(f"shard_update needs an fzero Optimizer (e.g. fzero.adamw(...)), got {name}")

    def init(flow: Flow, ctx: Context) -> tuple[Flow, Any]:
        params = flow.params if dtype is None else flow.params.to(dtype)
        return flow._replace(params=params, compute=None), optimizer.init(params)

    def update(flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
        if flow.grads is None:
            raise ValueError("shard_update: no gradients left to apply (two shard_update()s in one chain?)")
        if flow.grads.shape != flow.params.shape:
            raise ValueError(
                f"shard_update: gradients of shape {tuple(flow.grads.shape)} do not match parameters of shape "
                f"{tuple(flow.params.shape)}: put reduce_scatter() (sharded state) or all_reduce() (replicated "
                "state) before shard_update() in the chain"
            )
        grads = flow.grads.to(flow.params.dtype)
        if flow.grad_factor != 1.0:
            grads = grads * flow.grad_factor
        params, state = optimizer.update(grads, state, flow.params, donate=ctx.donate)
        return flow._replace(grads=None, params=params, compute=None), state

    return Transform(init, update)

"""`accumulate(k)`: average the gradients of `k` micro-steps, deferring the rest of the chain until the k-th.

    g = (g_1 + g_2 + ... + g_k) / k      (summed in micro-step order, then divided)

Its place in the chain decides what is accumulated: before `reduce_scatter` the full local gradients (stage 1,
one reduction per step); after it the reduced shards (stage 2, a reduction per micro-step, 1/world the memory).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..state import count
from .base import Context, Does, Flow, Transform, identity

__all__ = ["AccumulateState", "accumulate", "window_mean"]


class AccumulateState(NamedTuple):
    """`count`: micro-steps held since the last boundary (0-d int64); `acc`: the sum of their gradients."""

    count: Tensor  # type: ignore[assignment]  # (the saved name; shadows tuple.count)
    acc: Tensor


def accumulate(k: int, dtype: torch.dtype | None = None) -> Transform:
    """Mean of `k` micro-step gradients; micro-steps before the k-th do no further work.

    Args:
      k: micro-steps per update (1: a no-op with no state).
      dtype: accumulator dtype; default the master parameters' dtype.

    Example:
      >>> import torch, fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.accumulate(2), fzero.shard_update(fzero.sgd(1.0)))
      >>> state = fzero.init(torch.nn.Linear(2, 1), tx, fzero.SimMesh(2))
      >>> state.tx_state["accumulate"].acc.shape     # sharded: stage 2
      torch.Size([2, 16])
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"accumulate(k): k must be an int >= 1, got {k!r}")
    if k == 1:
        return identity()

    def init(flow: Flow, ctx: Context) -> tuple[Flow, AccumulateState]:
        n = ctx.layout.shard_numel if flow.sharded else ctx.layout.numel  # the gradients' form here
        acc = flow.params.new_zeros(*flow.params.shape[:-1], n, dtype=dtype or flow.params.dtype)
        return flow, AccumulateState(count(0), acc)

    def update(flow: Flow, state: AccumulateState, ctx: Context) -> tuple[Flow, AccumulateState]:
        grads = flow.gradients("accumulate")
        if grads.shape != state.acc.shape:
            raise ValueError(
                f"accumulate: gradients of shape {tuple(grads.shape)} do not match the accumulator's "
                f"{tuple(state.acc.shape)}; was the chain changed after init?"
            )
        n = int(state.count) + 1
        if n == k:  # (k > 1: the window has a sum)
            mean = window_mean(state.acc, grads, k, into=state.acc if ctx.donate else None)
            fresh = state.acc.zero_() if ctx.donate else torch.zeros_like(state.acc)
            return flow._replace(grads=mean), AccumulateState(count(0), fresh)
        g = grads.to(state.acc.dtype)
        if n == 1:
            acc = state.acc.copy_(g) if ctx.donate else g
        else:
            acc = torch.add(state.acc, g, out=state.acc if ctx.donate else None)
        return flow.with_info(deferred=True), AccumulateState(count(n), acc)

    return Transform(init, update, "accumulate", does=Does(accumulates=k), per_rank=False)


def window_mean(acc: Tensor, grads: Tensor, k: int, *, into: Tensor | None = None,
                out: Tensor | None = None) -> Tensor:  # fmt: skip
    """The mean of a window of `k` micro-steps: the sum so far `acc` plus the last micro-step's `grads`, divided
    by `k` (elementwise: on a slice of the buffers, bitwise the slice of the whole; a speculative update computes it
    unit by unit).

    Args:
      into: where the sum goes (the accumulator itself, when donated); None: a new tensor.
      out: where the mean goes; None: a new tensor.
    """
    total = torch.add(acc, grads.to(acc.dtype), out=into)
    return torch.div(total, k, out=out)

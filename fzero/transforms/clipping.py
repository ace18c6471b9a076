"""`clip_by_global_norm(max_norm)`: torch's and DeepSpeed's global-norm clipping, on sharded gradients.

    norm = sqrt(sum over ranks of the local sums of squares) / S      (unscaled; padding is zero)
    coef = min(1, max_norm / (norm + 1e-6))

The coefficient is folded into `StepInfo.grad_factor` (no pass over the gradients); the step reports the norm as
`grad_norm`. The local sum of squares is shared with `scale_loss`'s non-finite check: one pass for both.
"""

from __future__ import annotations

import math

from .base import Context, EmptyState, Flow, Transform
from .stats import grad_stats

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> Transform:
    """Scale the gradients so that their global L2 norm is at most `max_norm`.

    Example:
      >>> import torch, fzero
      >>> tx = fzero.chain(fzero.all_reduce(), fzero.clip_by_global_norm(1.0))
      >>> ctx = fzero.Context(fzero.SimMesh(1), None)
      >>> flow = fzero.Flow(torch.full((1, 4), 2.0), torch.zeros(1, 4), None, info=fzero.StepInfo(reduced=True))
      >>> round(tx.children[1][1].update(flow, (), ctx)[0].info.grad_factor, 6)   # norm 4: factor 1/4
      0.25
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}")

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        flow, stats = grad_stats(flow, ctx, "clip_by_global_norm")
        norm = math.sqrt(stats.sumsq) * abs(flow.info.grad_factor)
        coef = min(1.0, max_norm / (norm + 1e-6)) if stats.finite else 1.0
        return flow.with_info(grad_factor=flow.info.grad_factor * coef), state

    return Transform(lambda flow, ctx: (flow, EmptyState()), update, "clip_by_global_norm", per_rank=False)

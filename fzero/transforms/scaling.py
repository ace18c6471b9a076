"""`scale_loss`: loss scaling and the all-ranks skip of non-finite steps.

The step multiplies the loss by the current scale `S` before the backward and records `1/S` as a factor the
gradients owe (`Flow.grad_factor`), paid in the optimizer's single read of them. At the accumulation boundary this
transform looks at the step's global gradient statistics: an inf or nan on any rank makes every rank skip the
update (the flag is the all-reduced sum of squares), the parameters, the optimizer state and its step count stay
as they were, and the loss scale adjusts by DeepSpeed's rule (`fzero.loss_scale`).
"""

from __future__ import annotations

from typing import Any

from ..loss_scale import make_loss_scale
from .base import Context, Flow, Transform, grad_stats

__all__ = ["scale_loss"]


def scale_loss(loss_scale: Any = "dynamic", *, skip_nonfinite: bool = True, **dynamic: Any) -> Transform:
    """Scale the loss, and skip non-finite steps on every rank.

    Args:
      loss_scale: `"dynamic"` (DeepSpeed's rule; keywords as `DynamicLossScale.create`), a positive number
        (static), `"none"`, or a loss scale value.
      skip_nonfinite: skip the update when any gradient is inf or nan (on by default, as DeepSpeed 0.19 does for
        bf16 too). Without it, and without a scale, the transform costs nothing.

    Reports `loss_scale` (the scale this step used) and `skipped` in the metrics.
    """
    initial = make_loss_scale(loss_scale, **dynamic)
    dynamic_scale = hasattr(initial, "cur_iter")

    def init(flow: Flow, ctx: Context) -> tuple[Flow, tuple]:
        return flow._replace(loss_scale=initial), ()

    def update(flow: Flow, state: tuple, ctx: Context) -> tuple[Flow, tuple]:
        if not (skip_nonfinite or dynamic_scale):
            return flow.with_metrics(loss_scale=flow.loss_scale.loss_scale, skipped=False), state
        flow, stats = grad_stats(flow, ctx, "scale_loss")
        flow = flow.with_metrics(loss_scale=flow.loss_scale.loss_scale, skipped=not stats.finite and skip_nonfinite)
        flow = flow._replace(loss_scale=flow.loss_scale.adjust(stats.finite))
        if not stats.finite and skip_nonfinite:
            return flow._replace(deferred=True), state
        return flow, state

    return Transform(init, update, "scale_loss")

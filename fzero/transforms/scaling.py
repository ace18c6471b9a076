"""`scale_loss`: loss scaling and the all-ranks skip of non-finite steps.

The step multiplies the loss by the current scale `S` (this transform's state) before the backward and records
`1/S` as a factor the gradients owe (`StepInfo.grad_factor`), paid in the optimizer's single read of them. At the
accumulation boundary this transform looks at the step's global gradient statistics: an inf or nan on any rank
makes every rank skip the update (the flag is the all-reduced sum of squares), the parameters, the optimizer state
and its step count stay as they were, and the loss scale adjusts by DeepSpeed's rule (`fzero.loss_scale`).
"""

from __future__ import annotations

from typing import Any

from ..state.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, make_loss_scale
from .base import Context, Does, Flow, Transform
from .chain import find
from .stats import grad_stats

__all__ = ["current_loss_scale", "scale_loss"]


def scale_loss(loss_scale: Any = "dynamic", *, skip_nonfinite: bool = True, **dynamic: Any) -> Transform:
    """Scale the loss, and skip non-finite steps on every rank. The transform's state is the loss scale.

    Args:
      loss_scale: `"dynamic"` (DeepSpeed's rule; keywords as `DynamicLossScale.create`), a positive number
        (static), `"none"`, or a loss scale value.
      skip_nonfinite: skip the update when any gradient is inf or nan (on by default, as DeepSpeed 0.19 does for
        bf16 too). Without it, and without a scale, the transform costs nothing.

    Reports `loss_scale` (the scale this step used) and `skipped` in the metrics.

    Example:
      >>> import torch, fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.scale_loss("dynamic", initial_scale_power=8))
      >>> state = fzero.init(torch.nn.Linear(2, 1), tx, fzero.SimMesh(1))
      >>> current_loss_scale(state.tx_state).loss_scale
      256.0
    """
    initial = make_loss_scale(loss_scale, **dynamic)
    dynamic_scale = hasattr(initial, "cur_iter")

    def update(flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
        if not (skip_nonfinite or dynamic_scale):
            return flow.with_metrics(loss_scale=state.loss_scale, skipped=False), state
        flow, stats = grad_stats(flow, ctx, "scale_loss")
        skipped = not stats.finite and skip_nonfinite
        flow = flow.with_metrics(loss_scale=state.loss_scale, skipped=skipped)
        return (flow.with_info(deferred=True) if skipped else flow), state.adjust(stats.finite)

    return Transform(
        lambda flow, ctx: (flow, initial), update, "scale_loss", does=Does(scales_loss=True), per_rank=False
    )


def current_loss_scale(state: Any) -> Any:
    """The loss scale a chain's `scale_loss` holds (None without one): the step multiplies the loss by it before
    the backward, and the gradients owe its inverse (`StepInfo.grad_factor`).

    Args:
      state: a `TrainState` (its plan says where the scale is), or a chain's state (found by type).
    """
    plan = getattr(state, "plan", None)
    if plan is not None:
        return plan.state_of(state.tx_state, "scale_loss")
    return find(state, (NoOpLossScale, StaticLossScale, DynamicLossScale))

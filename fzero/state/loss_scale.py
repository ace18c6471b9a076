"""Loss scales as immutable values with `scale`, `unscale` and `adjust` (jmp's shape), DeepSpeed's rules.

`DynamicLossScale.adjust(finite)` is DeepSpeed 0.19's `DynamicLossScaler.update_scale(overflow)`, exactly:

    on overflow:   if hysteresis is used up (hysteresis == 1 or cur_hysteresis == 1):
                       raise at the minimum scale, else scale <- max(scale / 2, min_loss_scale)
                   else cur_hysteresis -= 1
                   last_overflow_iter <- cur_iter
    otherwise:     if consecutive_hysteresis: cur_hysteresis <- hysteresis
                   if (cur_iter - last_overflow_iter - 1) is a positive multiple of scale_window:
                       scale <- 2 * scale; cur_hysteresis <- hysteresis (if not consecutive)
    always:        cur_iter += 1

Every value is a pytree: the evolving values are 0-d tensor leaves, the configuration is static metadata, so no field
is lost through `tree_map` or a checkpoint (jmp drops `min_loss_scale` there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch
from torch import Tensor

from .train_state import pytree_dataclass, register_torch_pytree, static_field

__all__ = ["DynamicLossScale", "LossScale", "LossScaleError", "NoOpLossScale", "StaticLossScale", "make_loss_scale"]


class LossScaleError(FloatingPointError):
    """Gradients overflow at the minimum loss scale: training cannot continue in this state."""


def _f32(x: float) -> Tensor:
    return torch.tensor(float(x), dtype=torch.float32)


def _i64(x: int) -> Tensor:
    return torch.tensor(int(x), dtype=torch.int64)


@pytree_dataclass(frozen=True)
class NoOpLossScale:
    """No scaling (bf16, fp32)."""

    @property
    def loss_scale(self) -> float:
        return 1.0

    def scale(self, loss: Tensor) -> Tensor:
        return loss

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, finite: bool) -> NoOpLossScale:
        return self


class _Scaling:
    """`scale` and `unscale` by the 0-d tensor field `value`."""

    value: Tensor

    @property
    def loss_scale(self) -> float:
        return float(self.value)

    def scale(self, loss: Tensor) -> Tensor:
        """`loss * S`, in float32 (so a low-precision loss does not overflow before the backward)."""
        s = self.loss_scale
        return loss.float() * s if s != 1.0 else loss

    def unscale(self, tree: Any) -> Any:
        inv = 1.0 / self.loss_scale
        return optree.tree_map(lambda g: g * inv, tree)


@pytree_dataclass(frozen=True)
class StaticLossScale(_Scaling):
    """A fixed scale `S`: the loss is multiplied by `S`, gradients by `1/S`."""

    value: Tensor

    def adjust(self, finite: bool) -> StaticLossScale:
        return self


@pytree_dataclass(frozen=True)
class DynamicLossScale(_Scaling):
    """DeepSpeed's dynamic loss scaler as an immutable value (see the module docstring for the rule).

    Build it with `DynamicLossScale.create(...)`; the DeepSpeed config key of each argument is in brackets.

    Example:
      >>> ls = DynamicLossScale.create(initial_scale_power=4, loss_scale_window=2, hysteresis=1)
      >>> [ls := ls.adjust(f) for f in (False, True, True, True)][-1].loss_scale
      16.0
    """

    value: Tensor
    cur_iter: Tensor
    last_overflow_iter: Tensor
    cur_hysteresis: Tensor
    scale_window: int = static_field(default=1000)
    hysteresis: int = static_field(default=2)
    consecutive_hysteresis: bool = static_field(default=False)
    min_loss_scale: float = static_field(default=1.0)
    scale_factor: float = static_field(default=2.0)
    raise_error_at_min_scale: bool = static_field(default=True)

    @staticmethod
    def create(
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        raise_error_at_min_scale: bool = True,
    ) -> DynamicLossScale:
        """Args: `initial_scale_power` [fp16.initial_scale_power]: the scale starts at 2**power;
        `loss_scale_window` [loss_scale_window]: finite steps between doublings; `hysteresis` [hysteresis]:
        overflows tolerated before halving; `consecutive_hysteresis` [consecutive_hysteresis]: refill the hysteresis
        after every finite step; `min_loss_scale` [min_loss_scale]: the floor."""
        checks = {
            "loss_scale_window": (loss_scale_window, 1),
            "hysteresis": (hysteresis, 1),
        }
        for name, (value, low) in checks.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, int):
            raise ValueError(f"initial_scale_power must be an int, got {initial_scale_power!r}")
        if not min_loss_scale > 0:
            raise ValueError(f"min_loss_scale must be > 0, got {min_loss_scale!r}")
        return DynamicLossScale(
            _f32(2.0**initial_scale_power), _i64(0), _i64(-1), _i64(hysteresis), loss_scale_window,
            hysteresis, bool(consecutive_hysteresis), float(min_loss_scale), 2.0, bool(raise_error_at_min_scale),
        )  # fmt: skip

    def adjust(self, finite: bool) -> DynamicLossScale:
        """The scale after a step whose gradients were `finite` (all ranks) or not."""
        scale, it = self.loss_scale, int(self.cur_iter)
        last, hyst = int(self.last_overflow_iter), int(self.cur_hysteresis)
        if not finite:
            if self.hysteresis == 1 or hyst == 1:
                if scale == self.min_loss_scale and self.raise_error_at_min_scale:
                    raise LossScaleError(
                        f"Current loss scale already at minimum ({self.min_loss_scale:g}) and the gradients still "
                        "overflow: the model has diverged or its values do not fit in fp16. Lower the learning rate, "
                        "check the data for inf/nan, enable gradient clipping, lower min_loss_scale, or train in bf16."
                    )
                scale = max(scale / self.scale_factor, self.min_loss_scale)
            else:
                hyst -= 1
            last = it
        else:
            if self.consecutive_hysteresis:
                hyst = self.hysteresis
            stable = it - last - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    hyst = self.hysteresis
                scale *= self.scale_factor
        return dataclasses.replace(self, value=_f32(scale), cur_iter=_i64(it + 1), last_overflow_iter=_i64(last),
                                   cur_hysteresis=_i64(hyst))  # fmt: skip


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
    register_torch_pytree(_cls)


def make_loss_scale(spec: Any = None, **dynamic: Any) -> LossScale:
    """A loss scale from `None`/`"none"` (no scaling), `"dynamic"` (with `DynamicLossScale.create` keywords), a
    positive number (static), or a loss scale value itself."""
    if isinstance(spec, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        return spec
    if spec is None or spec == "none":
        return NoOpLossScale()
    if spec == "dynamic":
        return DynamicLossScale.create(**dynamic)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool) and spec > 0:
        return StaticLossScale(_f32(spec))
    raise ValueError(f"loss_scale must be 'none', 'dynamic', a positive number or a loss scale value, got {spec!r}")

"""`TorchGradScale`: `torch.amp.GradScaler`'s dynamic loss scale as an immutable value (DeepSpeed's
`torch_autocast` fp16 mode scales the loss with a GradScaler of default arguments).

`torch._amp_update_scale_` (what `GradScaler.update()` runs), with `init_scale = 2**16`, `growth_factor = 2`,
`backoff_factor = 0.5`, `growth_interval = 2000`:

    on overflow:   scale <- scale * backoff_factor; growth_tracker <- 0
    otherwise:     growth_tracker += 1
                   if growth_tracker == growth_interval: scale <- scale * growth_factor (if finite); growth_tracker <- 0

`update_on_overflow=False` is DeepSpeed 0.19.8's ZeRO optimizers' use of it: they find an overflow in their own
gradient norm first and return before `GradScaler.step()` / `update()`, so an overflowing step changes neither the
scale nor the tracker (the scale never backs off; `zero/stage_1_and_2.py` `step`, `zero/stage3.py` `step`).

The tracker is kept in `DynamicLossScale`'s fields (`cur_iter - last_overflow_iter - 1` is the tracker), so a
checkpoint holds the same leaves as one of DeepSpeed's fp16 scale.

Example:
    >>> ls = TorchGradScale.create(growth_interval=2)
    >>> [(ls := ls.adjust(f)).loss_scale for f in (True, True, False, True)]
    [65536.0, 131072.0, 65536.0, 65536.0]
"""

from __future__ import annotations

import dataclasses
import math

from .loss_scale import DynamicLossScale, _f32, _i64
from .train_state import pytree_dataclass, register_torch_pytree, static_field

__all__ = ["TorchGradScale"]


@pytree_dataclass(frozen=True)
class TorchGradScale(DynamicLossScale):
    """`torch.amp.GradScaler`'s scale and growth tracker (see the module docstring)."""

    growth_interval: int = static_field(default=2000)
    backoff_factor: float = static_field(default=0.5)
    update_on_overflow: bool = static_field(default=True)

    @staticmethod
    def create(  # type: ignore[override]
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        update_on_overflow: bool = True,
    ) -> TorchGradScale:
        """GradScaler's arguments (its defaults); `update_on_overflow` as the module docstring says."""
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError("TorchGradScale needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{init_scale!r}, {growth_factor!r}, {backoff_factor!r}")  # fmt: skip
        # (hysteresis 1, no floor: GradScaler has neither)
        return TorchGradScale(
            _f32(init_scale), _i64(0), _i64(-1), _i64(1), growth_interval, 1, False, 0.0, float(growth_factor), False,
            growth_interval, float(backoff_factor), bool(update_on_overflow),
        )  # fmt: skip

    def adjust(self, finite: bool) -> TorchGradScale:
        """The scale after a step whose gradients were `finite` (all ranks) or not."""
        scale, it, last = self.loss_scale, int(self.cur_iter), int(self.last_overflow_iter)
        if not finite:
            if not self.update_on_overflow:
                return self
            scale, last = scale * self.backoff_factor, it  # (float32 scale times 0.5: exact, as torch's)
        elif it - last == self.growth_interval:  # (it - last - 1 finite steps before this one)
            grown = scale * self.scale_factor
            if math.isfinite(float(_f32(grown))):
                scale = grown
            last = it
        return dataclasses.replace(self, value=_f32(scale), cur_iter=_i64(it + 1), last_overflow_iter=_i64(last))


register_torch_pytree(TorchGradScale)

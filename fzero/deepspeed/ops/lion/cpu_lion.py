"""`DeepSpeedCPULion`: DeepSpeed's CPU Lion, over fzero's native kernel (`fzero.cpu_lion`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ....optim import LionState
from ..optimizer import FunctionalOptimizer
from .fused_lion import lion_params

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(FunctionalOptimizer):
    """DeepSpeed's `deepspeed.ops.lion.DeepSpeedCPULion`, with DeepSpeed's signature and defaults.

    Its update is `fzero.cpu_lion`, the kernel the config's `{"type": "Lion"}` block runs where the master weights
    are in CPU memory (`fzero.lion`'s notes say where it departs from DeepSpeed's kernels: `sign(0) = 0`, and its
    scalars computed in double); `fzero.initialize(optimizer=...)` runs that block's optimizer with each group's
    values. The state of a parameter is DeepSpeed's: `step`, `exp_avg`, and `exp_avg_sq`, which
    DeepSpeed allocates and never uses (zeros).

    Args:
      model_params: the parameters, or param-group dicts (each may set `lr`, `betas`, `weight_decay`).
      lr, betas, weight_decay: Lion's (decoupled weight decay).
      fp32_optimizer_states: DeepSpeed keeps the momentum in the parameters' dtype when False; fzero updates float32
        parameters only, whose momentum is float32 either way.
    """

    optimizer_type = "Lion"
    state_keys = ("exp_avg",)
    unused_keys = ("exp_avg_sq",)
    state_type = LionState
    cpu_only = True

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return lion_params(group)

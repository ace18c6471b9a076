"""`FusedLion`: DeepSpeed's fused Lion, over `fzero.lion` (`fzero.cpu_lion` for parameters in CPU memory)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ....optim import LionState
from ..optimizer import FusedOptimizer, number

__all__ = ["FusedLion", "lion_params"]


class FusedLion(FusedOptimizer):
    """DeepSpeed's `deepspeed.ops.lion.FusedLion`, with DeepSpeed's signature and defaults.

    Its update is what the config's `{"type": "Lion"}` block runs: `fzero.lion` (DeepSpeed's FusedLion arithmetic,
    each operation rounded on its own; see its notes) on a GPU, and in CPU memory the native kernel
    `fzero.cpu_lion`, as fzero's engine runs the block on a CPU (DeepSpeed's FusedLion is CUDA only).
    `fzero.initialize(optimizer=...)` runs that block's optimizer with each group's values. The state of a parameter
    is DeepSpeed's: `step`, `exp_avg`.

    Args:
      params: the parameters, or param-group dicts (each may set `lr`, `betas`, `weight_decay`).
      lr, betas, weight_decay: Lion's (decoupled weight decay).
      set_grad_none: DeepSpeed's `zero_grad()` sets the gradients to None, or with False calls torch's, which (since
        torch 2.0) does too; so does this class's either way.
    """

    optimizer_type = "Lion"
    state_keys = ("exp_avg",)
    state_type = LionState
    dropped_step_arguments = "FusedLion has been updated."

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        self.set_grad_none = set_grad_none
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return lion_params(group)


def lion_params(group: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed Lion class's param group as the config's `{"type": "Lion"}` params."""
    return {
        "lr": number(group["lr"]),
        "betas": [number(b) for b in group["betas"]],
        "weight_decay": number(group["weight_decay"]),
    }

"""`DeepSpeedCPUAdagrad`: DeepSpeed's CPU Adagrad, over fzero's native kernel (`fzero.cpu_adagrad`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ....optim import AdagradState
from ..optimizer import FunctionalOptimizer, number

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(FunctionalOptimizer):
    """DeepSpeed's `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, with DeepSpeed's signature and defaults.

    Its update is `fzero.cpu_adagrad` (without `lr_decay`, the running sum starting at 0, as DeepSpeed's), the kernel
    the config's `{"type": "Adagrad"}` block runs where the master weights are in CPU memory;
    `fzero.initialize(optimizer=...)` runs that block's optimizer with each group's values. The state of a parameter
    is DeepSpeed's: `step`, `exp_avg_sq` (the running sum of squared gradients). Unlike DeepSpeed's kernel, which
    overwrites the tail of a parameter's gradient (its last `numel % 8` elements or so) with the update, this class
    leaves the gradients as they are.

    Args:
      model_params: the parameters, or param-group dicts (each may set `lr`, `eps`, `weight_decay`).
      lr, eps: Adagrad's.
      weight_decay: an L2 penalty added to the gradient.
      amsgrad: no effect (DeepSpeed's takes it and ignores it).
      fp32_optimizer_states: DeepSpeed keeps the running sum in the parameters' dtype when False; fzero updates
        float32 parameters only, whose sum is float32 either way.
    """

    optimizer_type = "Adagrad"
    state_keys = ("exp_avg_sq",)
    state_type = AdagradState
    cpu_only = True

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return {"lr": number(group["lr"]), "eps": number(group["eps"]), "weight_decay": number(group["weight_decay"])}

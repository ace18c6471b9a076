"""`DeepSpeedCPUAdam`: DeepSpeed's CPU Adam(W), over fzero's native kernel (`fzero.cpu_adamw` / `fzero.cpu_adam`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from ....optim import AdamState
from ..optimizer import FunctionalOptimizer, number

__all__ = ["DeepSpeedCPUAdam"]

_NO_AMSGRAD = ("DeepSpeedCPUAdam does not support the AMSGrad variant (neither does DeepSpeed's): use "
               "torch.optim.AdamW(amsgrad=True), which fzero.initialize runs with torch's arithmetic")  # fmt: skip


class DeepSpeedCPUAdam(FunctionalOptimizer):
    """DeepSpeed's `deepspeed.ops.adam.DeepSpeedCPUAdam`: Adam, or with `adamw_mode` (the default) AdamW, on the
    CPU, with DeepSpeed's signature and defaults.

    Its update is `fzero.cpu_adamw` (`adamw_mode=False`: `fzero.cpu_adam`, an L2 penalty), the kernel the config's
    `{"type": "Adam"}` block runs where the master weights are in CPU memory; `fzero.initialize(optimizer=...)` runs
    that block's optimizer with each group's values. The state of a parameter is DeepSpeed's: `step`, `exp_avg`,
    `exp_avg_sq`.

    Args:
      model_params: the parameters, or param-group dicts (each may set `lr`, `betas`, `eps`, `weight_decay`,
        `bias_correction`; fzero's engine takes one `bias_correction` for all groups).
      lr, betas, eps, weight_decay: Adam's.
      bias_correction: divide the moments by `1 - beta^t`.
      amsgrad: refused (DeepSpeed refuses it too).
      adamw_mode: decoupled weight decay (AdamW); False: an L2 penalty added to the gradient.
      fp32_optimizer_states: DeepSpeed keeps the moments in the parameters' dtype when False; fzero updates float32
        parameters only, whose moments are float32 either way (in the engine the config decides:
        `bf16.bf16_optimizer_states`).

    Raises:
      NotImplementedError: `amsgrad=True` (a `RuntimeError`, as DeepSpeed's).

    Example:
      >>> import torch
      >>> p = torch.nn.Parameter(torch.ones(3))
      >>> opt = DeepSpeedCPUAdam([p], lr=0.1)
      >>> p.grad = torch.ones(3)
      >>> opt.step()
      >>> p.data, sorted(opt.state[p])
      (tensor([0.9000, 0.9000, 0.9000]), ['exp_avg', 'exp_avg_sq', 'step'])
    """

    optimizer_type = "Adam"
    state_keys = ("exp_avg", "exp_avg_sq")
    state_type = AdamState
    cpu_only = True

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad)  # fmt: skip
        super().__init__(model_params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise NotImplementedError(_NO_AMSGRAD)
        super().add_param_group(param_group)

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return adam_params(group, self.adam_w_mode)

    def step_subgroup(self, subgroup_id: int, closure: Any = None) -> NoReturn:
        """DeepSpeed's ZeRO-3 offload updates one sub-group at a time through this; refused."""
        raise NotImplementedError(_SUBGROUPS.format("step_subgroup"))

    def rollback_subgroup(self, sub_group_id: int, closure: Any = None) -> NoReturn:
        """DeepSpeed's ZenFlow undoes one sub-group's update through this; refused."""
        raise NotImplementedError(_SUBGROUPS.format("rollback_subgroup"))


_SUBGROUPS = ("DeepSpeedCPUAdam.{} (DeepSpeed's ZeRO-3 offload and ZenFlow internals) is not supported by fzero: "
              "call step(), or let fzero.initialize's engine update the shards")  # fmt: skip


def adam_params(group: Mapping[str, Any], adam_w_mode: Any) -> dict[str, Any]:
    """A DeepSpeed Adam class's param group as the config's `{"type": "Adam"}` params (shared with `FusedAdam`)."""
    return {
        "lr": number(group["lr"]),
        "betas": [number(b) for b in group["betas"]],
        "eps": number(group["eps"]),
        "weight_decay": number(group["weight_decay"]),
        "bias_correction": bool(group["bias_correction"]),
        "adam_w_mode": bool(adam_w_mode),
    }

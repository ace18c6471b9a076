"""`FusedAdam`: DeepSpeed's fused Adam(W), over `fzero.adamw(fused=True)` / `fzero.adam(fused=True)`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ....optim import AdamState
from ..optimizer import FusedOptimizer
from .cpu_adam import adam_params

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizer):
    """DeepSpeed's `deepspeed.ops.adam.FusedAdam`: Adam, or with `adam_w_mode` (the default) AdamW, in one pass over
    memory, with DeepSpeed's signature and defaults.

    Its update is `fzero.adamw(fused=True)` (`adam_w_mode=False`: `fzero.adam(fused=True)`, an L2 penalty), what
    the config's `{"type": "Adam"}` block runs: on a GPU torch's fused kernel (bitwise
    `torch.optim.AdamW(fused=True)`), in CPU memory fzero's native kernel (DeepSpeed's FusedAdam is CUDA only);
    without bias correction on a GPU, torch's operations. `fzero.initialize(optimizer=...)` runs that block's
    optimizer with each group's values. The state of a parameter is DeepSpeed's: `step`, `exp_avg`, `exp_avg_sq`.

    Args:
      params: the parameters, or param-group dicts (each may set `lr`, `betas`, `eps`, `weight_decay`,
        `bias_correction`; fzero's engine takes one `bias_correction` for all groups).
      lr, betas, eps, weight_decay: Adam's.
      bias_correction: divide the moments by `1 - beta^t`.
      adam_w_mode: decoupled weight decay (AdamW); False: an L2 penalty added to the gradient.
      amsgrad: refused (DeepSpeed refuses it too).
      set_grad_none: DeepSpeed's `zero_grad()` sets the gradients to None, or with False calls torch's, which (since
        torch 2.0) does too; so does this class's either way.

    Raises:
      NotImplementedError: `amsgrad=True` (a `RuntimeError`, as DeepSpeed's).
    """

    optimizer_type = "Adam"
    state_keys = ("exp_avg", "exp_avg_sq")
    state_type = AdamState
    dropped_step_arguments = (
        "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and "
        "call step() with no arguments."
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise NotImplementedError(
                "FusedAdam does not support the AMSGrad variant (neither does DeepSpeed's): use "
                "torch.optim.AdamW(amsgrad=True), which fzero.initialize runs with torch's arithmetic"
            )
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return adam_params(group, self.adam_w_mode)

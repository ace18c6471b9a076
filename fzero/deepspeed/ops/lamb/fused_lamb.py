"""`FusedLamb`: DeepSpeed's fused Lamb, over `fzero.lamb` (FusedLamb's arithmetic, the trust ratio per tensor)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch

from ....optim import AdamState
from ..optimizer import FunctionalOptimizer, number

__all__ = ["FusedLamb"]

_CLIP = ("clips with the gradient norms passed to step(grad_norms=...), which fzero does not take: clip with the "
         "config's gradient_clipping, or torch.nn.utils.clip_grad_norm_ before step()")  # fmt: skip


class FusedLamb(FunctionalOptimizer):
    """DeepSpeed's `deepspeed.ops.lamb.FusedLamb`, with DeepSpeed's signature and defaults.

    Its update is `fzero.lamb` on each parameter (the trust ratio `||w|| / ||u||` of each parameter tensor, as
    DeepSpeed's kernel computes it per parameter), what the config's `{"type": "Lamb"}` block runs;
    `fzero.initialize(optimizer=...)` runs that block's optimizer with each group's values. The state of a parameter
    is DeepSpeed's: `step`, `exp_avg`, `exp_avg_sq`.

    Args:
      params: the parameters, or param-group dicts (each may set `lr`, `betas`, `eps`, `weight_decay`,
        `max_coeff`, `min_coeff`, `bias_correction`; fzero's engine takes one `bias_correction` for all groups).
      lr, betas, eps, weight_decay: as Adam's; the weight decay is added to the update before the trust ratio.
      bias_correction: scale the step by `sqrt(1 - b2^t) / (1 - b1^t)`.
      eps_inside_sqrt: `sqrt(v + eps)` instead of `sqrt(v) + eps`.
      max_grad_norm: 0 (DeepSpeed's default, no clipping) only: DeepSpeed's clips with norms given to `step`.
      max_coeff, min_coeff: the trust ratio's clamp.
      amsgrad: refused (DeepSpeed refuses it too).

    Raises:
      NotImplementedError: `amsgrad=True` (a `RuntimeError`, as DeepSpeed's), `max_grad_norm` > 0.
    """

    optimizer_type = "Lamb"
    state_keys = ("exp_avg", "exp_avg_sq")
    state_type = AdamState

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise NotImplementedError("FusedLamb does not support the AMSGrad variant (neither does DeepSpeed's)")
        self.eps_mode = 0 if eps_inside_sqrt else 1
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)  # fmt: skip
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("max_grad_norm", self.defaults["max_grad_norm"]) > 0:
            raise NotImplementedError(f"FusedLamb(max_grad_norm > 0) is not supported by fzero: DeepSpeed's {_CLIP}")
        super().add_param_group(param_group)

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "lr": number(group["lr"]),
            "bias_correction": bool(group["bias_correction"]),
            "betas": [number(b) for b in group["betas"]],
            "eps": number(group["eps"]),
            "eps_inside_sqrt": self.eps_mode == 0,
            "weight_decay": number(group["weight_decay"]),
            "max_coeff": number(group["max_coeff"]),
            "min_coeff": number(group["min_coeff"]),
        }

    @torch.no_grad()
    def step(self, closure: Any = None, grads: Any = None, output_params: Any = None, scale: float = 1.0,
             grad_norms: Any = None) -> Any:  # fmt: skip
        """torch's `step(closure)`, reading each parameter's `.grad`.

        Raises:
          NotImplementedError: DeepSpeed's older arguments (`grads`, `output_params`, `scale`, `grad_norms`), which
            pass gradients, a low-precision copy and an unscaling factor beside the parameters.
        """
        given = [k for k, v in (("grads", grads), ("output_params", output_params), ("grad_norms", grad_norms)) if
                 v is not None] + (["scale"] if scale != 1.0 else [])  # fmt: skip
        if given:
            raise NotImplementedError(
                f"FusedLamb.step({', '.join(given)}=...) is not supported by fzero: set each parameter's .grad (and "
                "unscale it) and call step(); fzero.initialize's engine does this for a DeepSpeed config"
            )
        return super().step(closure)

    def get_lamb_coeffs(self) -> NoReturn:
        """DeepSpeed returns the last step's trust ratios; refused."""
        raise NotImplementedError(
            "FusedLamb.get_lamb_coeffs is not supported by fzero: fzero.lamb applies each tensor's trust ratio "
            "without keeping it"
        )

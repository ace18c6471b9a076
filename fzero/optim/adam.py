"""Adam and AdamW on flat tensors, in `torch.optim.Adam` / `AdamW`'s exact operation order (`adam_core.update`).

With `bias_correction=False` (DeepSpeed's FusedAdam / CPU Adam option) both corrections are 1:
`p <- p - lr * m / (sqrt(v) + eps)`. With `amsgrad=True` (torch's), `v_max <- max(v_max, v)` takes `v`'s place in
the denominator (the state is then an `AMSGradState`).

The scalar factors are computed in Python floats (doubles) exactly as torch's single-tensor implementation does,
so on the same gradients the result equals `torch.optim.AdamW(foreach=False)` bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import adam_core
from .base import AdamState, AMSGradState, Hyper, Optimizer
from .cpu_adam import cpu_adam, cpu_adamw
from .fused_adam import on_device, torch_fused_adam
from .grouped import Ops, elementwise
from .groups import ParamGroups

__all__ = ["AdamState", "adam", "adamw"]


def _adam(
    defaults: Mapping[str, Any], decoupled: bool, bias_correction: bool, amsgrad: bool, groups: ParamGroups | None
) -> Optimizer:
    """Adam in torch's operations (`adam_core.update`), on the whole buffer or group by group."""

    def init(params: Tensor) -> AdamState | AMSGradState:
        state = adam_core.init_state(params)
        return AMSGradState(*state, torch.zeros_like(params)) if amsgrad else state

    def step(h: Mapping[str, Any], applied: int, ops: Ops, *pieces: list[Tensor]) -> None:
        adam_core.update(ops, adam_core.step_values(h, applied), applied + 1, decoupled, bias_correction, *pieces)

    return elementwise("adamw" if decoupled else "adam", init, step, defaults, adam_core.check, groups)


def _choose(
    decoupled: bool,
    lr: Hyper,
    betas: tuple[Hyper, Hyper],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    amsgrad: bool,
    groups: ParamGroups | None,
    fused: bool,
) -> Optimizer:
    """`adam` / `adamw`: torch's operations, or with `fused` the native kernel for master weights on the CPU and
    torch's fused kernel elsewhere (which always corrects the bias: without the correction, torch's operations)."""
    if fused and amsgrad:  # DeepSpeed's CPU Adam accepts the flag and ignores it; refused here rather than ignored
        raise ValueError("amsgrad=True has no native kernel: use fused=False (torch's operations)")
    defaults = adam_core.make_defaults(lr, betas, eps, weight_decay)
    if not fused:
        return _adam(defaults, decoupled, bias_correction, amsgrad, groups)
    host = (cpu_adamw if decoupled else cpu_adam)(lr, betas, eps, weight_decay, bias_correction=bias_correction,
                                                  groups=groups)  # fmt: skip
    if bias_correction:
        return on_device(host, torch_fused_adam(lr, betas, eps, weight_decay, decoupled, groups))
    return on_device(host, _adam(defaults, decoupled, bias_correction, False, groups))


def adamw(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    bias_correction: bool = True,
    amsgrad: bool = False,
    groups: ParamGroups | None = None,
    fused: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay), matching `torch.optim.AdamW` and its defaults.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied (`fzero.optim.schedules`).
      betas: coefficients of the running averages of the gradient and its square (each may be a schedule too).
      eps: added to the bias-corrected square root, for stability.
      weight_decay: decoupled decay: `p <- p * (1 - lr * weight_decay)` before the Adam step.
      bias_correction: divide the moments by `1 - beta^t` (torch always does; DeepSpeed's FusedAdam and CPU Adam
        can turn it off: `p <- p - lr * m / (sqrt(v) + eps)`).
      amsgrad: torch's AMSGrad: the running maximum of `v` in the denominator (not with `fused`).
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `betas`, `eps`, `weight_decay` for
        the parameters they name.
      fused: one pass over memory instead of torch's operations (bitwise `torch.optim.AdamW(foreach=False)`,
        about 8 passes): for master weights on the CPU the native kernel (`fzero.cpu_adamw`: float32, unscaling,
        clipping and the low-precision compute copy folded in; within a few float32 ulp of torch per step,
        `tests/test_native.py`), for master weights on a GPU torch's fused kernel (bitwise
        `torch.optim.AdamW(fused=True)`; `fzero.optim.fused_adam`).

    Example:
      >>> import torch
      >>> opt = adamw(lr=0.1, weight_decay=0.0)
      >>> p = torch.ones(3)
      >>> p, s = opt.update(torch.ones(3), opt.init(p), p)
      >>> p
      tensor([0.9000, 0.9000, 0.9000])
    """
    return _choose(True, lr, betas, eps, weight_decay, bias_correction, amsgrad, groups, fused)


def adam(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    amsgrad: bool = False,
    groups: ParamGroups | None = None,
    fused: bool = False,
) -> Optimizer:
    """Adam with L2 weight decay (`g <- g + weight_decay * p`), matching `torch.optim.Adam`; see `adamw`."""
    return _choose(False, lr, betas, eps, weight_decay, bias_correction, amsgrad, groups, fused)

"""`cpu_adamw`, `cpu_adam`: Adam and AdamW on the native CPU kernel (`fzero.native`), for optimizer offload.

They keep `fzero.adamw`'s state layout (`AdamState(count, exp_avg, exp_avg_sq)`, so checkpoints and tests treat
both alike) and its hyper-parameters (constants or schedules of the applied-update count), and add what a fused
kernel can do in the same pass over memory:

- `grad_scale=`: a factor multiplied into every gradient as it is loaded (1 / loss scale times the clipping
  coefficient), so unscaling and clipping cost no pass of their own;
- bfloat16 / float16 gradients, upcast on load;
- `out=`: a bfloat16 / float16 tensor that receives the updated parameters, bitwise `params.to(out.dtype)`.

`shard_update` uses all three (see `Optimizer.features`). The master parameters and the moments must be float32
CPU tensors. The arithmetic is the kernel's (fused multiply-adds; see `native/adam.c`), so results agree with
`fzero.adamw` / `torch.optim.AdamW` within a few float32 rounding units per step, not bitwise; the bound is stated
and tested in `tests/test_native.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import native
from . import adam_core
from .base import Hyper, Optimizer
from .groups import ParamGroups
from .native_common import PerGroup, native_optimizer

__all__ = ["cpu_adam", "cpu_adamw"]


def _cpu_adam(
    defaults: Mapping[str, Any], decoupled: bool, bias_correction: bool, groups: ParamGroups | None
) -> Optimizer:
    def kernel(step: int, scalars: tuple[PerGroup, ...], *tensors: Any, **fused: Any) -> None:
        lr_t, b1_t, b2_t, eps_t, wd_t = scalars
        p, g, m, v, p_out, m_out, v_out = tensors
        native.adam_step(p, g, m, v, step=step, lr=lr_t, betas=(b1_t, b2_t), eps=eps_t, weight_decay=wd_t,
                         decoupled=decoupled, bias_correction=bias_correction, params_out=p_out, exp_avg_out=m_out,
                         exp_avg_sq_out=v_out, **fused)  # fmt: skip

    name = "cpu_adamw" if decoupled else "cpu_adam"
    return native_optimizer(name, adam_core.init_state, kernel, adam_core.step_values, defaults, adam_core.check,
                            groups)  # fmt: skip


def cpu_adamw(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    bias_correction: bool = True,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """AdamW (decoupled weight decay) on the native CPU kernel; the hyper-parameters of `fzero.adamw` and
    `torch.optim.AdamW` (parameter groups included), plus DeepSpeed's `bias_correction`.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied.
      betas: coefficients of the running averages of the gradient and its square (each may be a schedule).
      eps: added to the bias-corrected square root.
      weight_decay: decoupled decay, `p <- p (1 - lr weight_decay)` before the Adam step.
      bias_correction: divide the moments by `1 - beta^t` (DeepSpeed's `DeepSpeedCPUAdam` can turn it off).

    Example:
      >>> import torch, fzero
      >>> opt = fzero.cpu_adamw(lr=0.1, weight_decay=0.0)
      >>> p = torch.ones(3)
      >>> p, s = opt.update(torch.ones(3), opt.init(p), p)
      >>> p
      tensor([0.9000, 0.9000, 0.9000])
    """
    return _cpu_adam(adam_core.make_defaults(lr, betas, eps, weight_decay), True, bias_correction, groups)


def cpu_adam(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Adam with an L2 penalty (`g <- g + weight_decay p`, as `torch.optim.Adam`) on the native CPU kernel; see
    `cpu_adamw`. Unlike DeepSpeed's `"type": "Adam"`, this is never silently AdamW."""
    return _cpu_adam(adam_core.make_defaults(lr, betas, eps, weight_decay), False, bias_correction, groups)

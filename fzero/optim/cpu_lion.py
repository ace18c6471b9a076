"""`cpu_lion`: Lion on the native CPU kernel (`fzero.native.lion_step`), for optimizer offload.

It keeps `fzero.lion`'s state layout (`LionState(count, exp_avg)`, so checkpoints and tests treat both alike) and
its hyper-parameters (constants or schedules of the applied-update count, parameter groups), and adds what a fused
kernel can do in the same pass over memory, as `cpu_adamw` does:

- `grad_scale=`: a factor multiplied into every gradient as it is loaded (1 / loss scale times the clipping
  coefficient);
- bfloat16 / float16 gradients, upcast on load;
- `out=`: a bfloat16 / float16 tensor that receives the updated parameters, bitwise `params.to(out.dtype)`.

The master parameters and the momentum must be float32 CPU tensors. The arithmetic is the kernel's
(`native/lion.c`: DeepSpeed's CPU Lion with fused multiply-adds, and sign(0) = 0), the same on every instruction
set and thread count; it agrees with `fzero.lion` (each operation rounded on its own) to about an ulp of the
momentum and the parameters per step, and takes the same sign unless the interpolation `c` is within an ulp of 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .. import native
from .base import Hyper, LionState, Optimizer, hyper_value
from .groups import ParamGroups, Segments
from .lion import check
from .native_common import FEATURES, scalars
from .native_common import check_params as _check_params

__all__ = ["cpu_lion"]


def _values(h: Mapping[str, Any], applied: int) -> tuple[float, float, float, float]:
    """`(lr, beta1, beta2, weight_decay)` of the update after `applied` applied updates (schedules evaluated)."""
    return (hyper_value(h["lr"], applied), hyper_value(h["betas"][0], applied), hyper_value(h["betas"][1], applied),
            hyper_value(h["weight_decay"], applied))  # fmt: skip


def cpu_lion(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    weight_decay: Hyper = 0.0,
    *,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Lion (Chen et al. 2023) on the native CPU kernel: with `c = beta1 m + (1 - beta1) g`,
    `p <- p (1 - lr weight_decay) - lr sign(c)` and `m <- beta2 m + (1 - beta2) g`.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied. Every element moves by
        `lr`: Lion's learning rate is typically 3-10x smaller than AdamW's.
      betas: `beta1` interpolates the momentum and the gradient for the update's sign, `beta2` is the momentum's
        decay (each may be a schedule).
      weight_decay: decoupled decay, `p <- p (1 - lr weight_decay)` before the signed step (a schedule too).
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `betas`, `weight_decay` for the
        parameters they name.

    Returns:
      The `Optimizer`; its state is `LionState(count, exp_avg)`.

    Example:
      >>> import torch
      >>> from fzero.optim.cpu_lion import cpu_lion
      >>> opt = cpu_lion(lr=0.1)
      >>> p = torch.zeros(3)
      >>> p, s = opt.update(torch.tensor([2.0, -1.0, 0.0]), opt.init(p), p)
      >>> p
      tensor([-0.1000,  0.1000,  0.0000])
    """
    defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
    check(defaults)
    native.isa()  # choose the path now: a missing extension warns at construction, not mid-training

    def check_params(params: Tensor) -> None:
        _check_params("cpu_lion", params)

    def init(params: Tensor) -> LionState:
        check_params(params)
        return LionState(torch.tensor(0, dtype=torch.int64), torch.zeros_like(params))

    def update(
        grads: Tensor,
        state: LionState,
        params: Tensor,
        *,
        donate: bool = False,
        grad_scale: float = 1.0,
        out: Tensor | None = None,
        segments: Segments | None = None,
    ) -> tuple[Tensor, LionState]:
        check_params(params)
        applied = int(state.count)
        (lr_t, b1_t, b2_t, wd_t), table = scalars(_values, defaults, applied, segments)
        if donate:
            p, m = params, state.exp_avg
            p_out = m_out = None
        else:  # pure: the kernel reads the inputs and writes fresh buffers, in the same single pass
            p, m = torch.empty_like(params), torch.empty_like(state.exp_avg)
            p_out, m_out = p, m
        native.lion_step(params, grads.contiguous(), state.exp_avg, lr=lr_t, betas=(b1_t, b2_t), weight_decay=wd_t,
                         grad_scale=grad_scale, out=out, segments=table, params_out=p_out,
                         exp_avg_out=m_out)  # fmt: skip
        return p, LionState(torch.tensor(applied + 1, dtype=torch.int64), m)

    return Optimizer(init, update, FEATURES, defaults=defaults, groups=groups, check=check)

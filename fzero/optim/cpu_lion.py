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

from typing import Any

from .. import native
from .base import Hyper, Optimizer
from .groups import ParamGroups
from .lion import lion, step_values
from .native_common import PerGroup, native_optimizer

__all__ = ["cpu_lion"]


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
      lr, betas, weight_decay, groups: as `fzero.lion` (each hyper-parameter a constant or a schedule; Lion's
        learning rate is typically 3-10x smaller than AdamW's).

    Returns:
      The `Optimizer`; its state is `fzero.lion`'s, `LionState(count, exp_avg)`.

    Example:
      >>> import torch
      >>> from fzero.optim.cpu_lion import cpu_lion
      >>> opt = cpu_lion(lr=0.1)
      >>> p = torch.zeros(3)
      >>> p, s = opt.update(torch.tensor([2.0, -1.0, 0.0]), opt.init(p), p)
      >>> p
      tensor([-0.1000,  0.1000,  0.0000])
    """
    like = lion(lr, betas, weight_decay, groups=groups)  # its state and checks

    def kernel(step: int, scalars: tuple[PerGroup, ...], *tensors: Any, **fused: Any) -> None:
        lr_t, b1_t, b2_t, wd_t = scalars
        p, g, m, p_out, m_out = tensors
        native.lion_step(p, g, m, lr=lr_t, betas=(b1_t, b2_t), weight_decay=wd_t, params_out=p_out,
                         exp_avg_out=m_out, **fused)  # fmt: skip

    return native_optimizer("cpu_lion", like.init, kernel, step_values, like.defaults, like.check, groups)

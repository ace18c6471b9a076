"""`cpu_adagrad`: Adagrad on the native CPU kernel (`fzero.native.adagrad_step`), for optimizer offload.

It keeps `fzero.adagrad`'s state layout (`AdagradState(count, sum)`, so checkpoints and tests treat both alike)
and `torch.optim.Adagrad`'s hyper-parameters and defaults (`lr` a constant or a schedule of the applied-update
count, parameter groups), and adds what a fused kernel can do in the same pass over memory, as `cpu_adamw` does:

- `grad_scale=`: a factor multiplied into every gradient as it is loaded (1 / loss scale times the clipping
  coefficient);
- bfloat16 / float16 gradients, upcast on load;
- `out=`: a bfloat16 / float16 tensor that receives the updated parameters, bitwise `params.to(out.dtype)`.

The master parameters and the running sum must be float32 CPU tensors. The arithmetic is the kernel's
(`native/adagrad.c`: DeepSpeed's CPU Adagrad with fused multiply-adds, with torch's weight-decayed numerator and
`lr_decay`), the same on every instruction set and thread count; it agrees with `fzero.adagrad` /
`torch.optim.Adagrad` within a few float32 rounding units per step (bound in `tests/test_native_lion_adagrad.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import native
from .adagrad import adagrad
from .base import Hyper, Optimizer, hyper_value
from .groups import ParamGroups
from .native_common import PerGroup, native_optimizer

__all__ = ["cpu_adagrad"]


def cpu_adagrad(
    lr: Hyper = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Adagrad on the native CPU kernel, with `torch.optim.Adagrad`'s hyper-parameters: for update `t`, with
    `g <- g + weight_decay p`, `sum <- sum + g^2` and `p <- p - lr / (1 + (t - 1) lr_decay) g / (sqrt(sum) + eps)`.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied.
      lr_decay: the learning rate of update `t` is `lr / (1 + (t - 1) lr_decay)` (computed in double, as torch).
      weight_decay: L2 penalty added to the gradient.
      initial_accumulator_value: the running sum starts here (one value for the whole optimizer: torch fills every
        parameter's sum with the constructor's value, whatever its group).
      eps: added to the square root of the running sum.
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `lr_decay`, `weight_decay`, `eps` for
        the parameters they name.

    Returns:
      The `Optimizer`; its state is `AdagradState(count, sum)`.

    Raises:
      ValueError: as `fzero.adagrad` (a negative hyper-parameter, `eps` 0, a group's own
        `initial_accumulator_value`).
      TypeError: a hyper-parameter is not a number (only `lr` may be a schedule).

    Example:
      >>> import torch
      >>> from fzero.optim.cpu_adagrad import cpu_adagrad
      >>> opt = cpu_adagrad(lr=0.1)
      >>> p = torch.zeros(2)
      >>> p, s = opt.update(torch.tensor([2.0, 0.0]), opt.init(p), p)
      >>> p, s.sum
      (tensor([-0.1000,  0.0000]), tensor([4., 0.]))
    """

    like = adagrad(lr, lr_decay, weight_decay, initial_accumulator_value, eps, groups=groups)  # state and checks

    def values(h: Mapping[str, Any], applied: int) -> tuple[float, float, float, float]:
        return hyper_value(h["lr"], applied), h["lr_decay"], h["eps"], h["weight_decay"]

    def kernel(step: int, scalars: tuple[PerGroup, ...], *tensors: Any, **fused: Any) -> None:
        lr_t, decay_t, eps_t, wd_t = scalars
        p, g, s, p_out, s_out = tensors
        native.adagrad_step(p, g, s, step=step, lr=lr_t, lr_decay=decay_t, eps=eps_t, weight_decay=wd_t,
                            params_out=p_out, state_sum_out=s_out, **fused)  # fmt: skip

    return native_optimizer("cpu_adagrad", like.init, kernel, values, like.defaults, like.check, groups)

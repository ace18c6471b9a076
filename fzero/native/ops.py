"""`torch.ops.fzero.adam_step_` and `torch.ops.fzero.adam_step_segments_`: the Adam kernel as `torch.library`
custom ops, so that code compiled with `torch.compile(..., fullgraph=True)` that calls it stays in one graph
instead of breaking at an opaque C call. (`fzero.cpu_adamw` calls the kernel directly: the eager step gains
nothing from the dispatcher.)

Each mutates `params`, `exp_avg`, `exp_avg_sq` and (when given) `out` in place and returns nothing; its fake
(meta) implementation does nothing, since no output has to be described.

The grouped step is a second op rather than optional arguments of the first: an op schema has one type per
argument, and a hyper-parameter that is a float in one call and a list in the next has none. So
`adam_step_segments_` takes the segment table as two int64 tensors and every hyper-parameter as a list with one
float per group (`float[]`), and `adam_step_` stays as it was.

    >>> import torch
    >>> p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    >>> torch.ops.fzero.adam_step_(p, g, m, v, None, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    >>> p
    tensor([0.9000, 0.9000, 0.9000])
    >>> ends, group = torch.tensor([1, 3]), torch.tensor([1, 0])
    >>> torch.ops.fzero.adam_step_segments_(p, g, m, v, None, ends, group, 2, [0.1, 0.2], [0.9, 0.9],
    ...                                     [0.999, 0.999], [1e-8, 1e-8], [0.0, 0.0], True, True, 1.0)
    >>> p
    tensor([0.7000, 0.8000, 0.8000])
"""

from typing import Optional

import torch
from torch import Tensor

from .kernels import adam_step

__all__ = ["adam_step_", "adam_step_segments_"]


@torch.library.custom_op("fzero::adam_step_", mutates_args=("params", "exp_avg", "exp_avg_sq", "out"))
def adam_step_(
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Optional[Tensor],  # noqa: UP045 (torch.library parses the annotation: keep the typing form)
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction: bool,
    grad_scale: float,
) -> None:
    """In-place `fzero.native.adam_step` (see there), with every hyper-parameter positional."""
    adam_step(params, grads, exp_avg, exp_avg_sq, step=step, lr=lr, betas=(beta1, beta2), eps=eps,
              weight_decay=weight_decay, decoupled=decoupled, bias_correction=bias_correction,
              grad_scale=grad_scale, out=out)  # fmt: skip


@adam_step_.register_fake
def _(params, grads, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps, weight_decay, decoupled,
      bias_correction, grad_scale) -> None:  # fmt: skip
    return None


@torch.library.custom_op("fzero::adam_step_segments_", mutates_args=("params", "exp_avg", "exp_avg_sq", "out"))
def adam_step_segments_(
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Optional[Tensor],  # noqa: UP045 (torch.library parses the annotation: keep the typing form)
    ends: Tensor,
    group: Tensor,
    step: int,
    lr: list[float],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
    decoupled: bool,
    bias_correction: bool,
    grad_scale: float,
) -> None:
    """In-place `fzero.native.adam_step(..., segments=(ends, group))`, every hyper-parameter a list with one float
    per group."""
    adam_step(params, grads, exp_avg, exp_avg_sq, step=step, lr=lr, betas=(beta1, beta2), eps=eps,
              weight_decay=weight_decay, decoupled=decoupled, bias_correction=bias_correction,
              grad_scale=grad_scale, out=out, segments=(ends, group))  # fmt: skip


@adam_step_segments_.register_fake
def _(params, grads, exp_avg, exp_avg_sq, out, ends, group, step, lr, beta1, beta2, eps, weight_decay, decoupled,
      bias_correction, grad_scale) -> None:  # fmt: skip
    return None

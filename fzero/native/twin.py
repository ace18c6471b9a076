"""The pure-torch twin of the C kernels: the same signatures and the same float32 scalars, in torch operations.

It runs wherever the compiled extension is missing (no compiler at install time) or when asked for with
`FZERO_ISA=torch`. Its operation order is torch's (`mul`, `add`, `addcmul`, `addcdiv`), not the kernel's fused
multiply-adds, so it agrees with the kernel within the bound `tests/test_native.py` states, not bitwise; its
low-precision copy-out is `params.to(dtype)` itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .hyper import AdamHyper

__all__ = ["adam_step", "ceiling", "grad_stats"]


def adam_step(
    h: AdamHyper,
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Tensor | None,
    params_out: Tensor,
    exp_avg_out: Tensor,
    exp_avg_sq_out: Tensor,
) -> None:
    """One Adam step in torch operations; arguments as `fzero.native.adam_step` after validation (outputs may be
    the inputs themselves)."""
    g = grads.to(torch.float32)
    if h.grad_scale != 1.0:
        g = g * h.grad_scale
    if h.l2 != 0.0:
        g = g.add(params, alpha=h.l2)
    m = torch.mul(exp_avg, h.beta1, out=exp_avg_out).add_(g, alpha=h.one_minus_beta1)
    v = torch.mul(exp_avg_sq, h.beta2, out=exp_avg_sq_out).addcmul_(g, g, value=h.one_minus_beta2)
    denom = v.sqrt().mul_(h.inv_sqrt_bc2).add_(h.eps)
    p = torch.mul(params, h.decay, out=params_out) if h.decay != 1.0 else _same(params, params_out)
    p.addcdiv_(m, denom, value=-h.step_size)
    if out is not None:
        out.copy_(p)


def _same(src: Tensor, dst: Tensor) -> Tensor:
    return dst if dst is src else dst.copy_(src)


def grad_stats(grads: Tensor) -> tuple[float, bool]:
    """`(sum of squares in float64, whether any element is inf or nan)`."""
    sumsq = float(torch.linalg.vector_norm(grads.reshape(-1), dtype=torch.float64) ** 2)
    return sumsq, not math.isfinite(sumsq)


def ceiling(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, a: float) -> None:
    """The bandwidth-ceiling kernel's arithmetic in torch: `x <- x + a g` for x in (params, exp_avg, exp_avg_sq)."""
    for x in (params, exp_avg, exp_avg_sq):
        x.add_(grads, alpha=a)

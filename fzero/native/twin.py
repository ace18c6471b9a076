"""The pure-torch twin of the C kernels: the same signatures and the same float32 scalars, in torch operations.

It runs wherever the compiled extension is missing (no compiler at install time) or when asked for with
`FZERO_ISA=torch`. Its operation order is torch's (`mul`, `add`, `addcmul`, `addcdiv`), not the kernel's fused
multiply-adds, so it agrees with the kernel within the bound `tests/test_native.py` states, not bitwise; its
low-precision copy-out is `params.to(dtype)` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from .hyper import AdamHyper

__all__ = ["adam_step", "ceiling", "grad_stats"]


def adam_step(
    h: AdamHyper | Sequence[AdamHyper],
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Tensor | None,
    params_out: Tensor,
    exp_avg_out: Tensor,
    exp_avg_sq_out: Tensor,
    segments: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """One Adam step in torch operations; arguments as `fzero.native.adam_step` after validation (outputs may be
    the inputs themselves).

    Without `segments`, `h` is the step's one `AdamHyper`. With `segments = (ends, group)` (a validated table, as
    lists of ints), `h` holds one `AdamHyper` per group, and each non-empty segment runs the ungrouped step on its
    slice of the flat buffers with `h[group[s]]`: bitwise what an ungrouped call on that slice gives, by
    construction (the same torch operations on the same views).
    """
    if segments is None:
        _step(cast(AdamHyper, h), params, grads, exp_avg, exp_avg_sq, out, params_out, exp_avg_out, exp_avg_sq_out)
        return
    per_group = cast(Sequence[AdamHyper], h)  # (an AdamHyper is a sequence too: the segments say which h is)
    flat = [t.view(-1) for t in (params, grads, exp_avg, exp_avg_sq)]
    flat_outs = [t.view(-1) for t in (params_out, exp_avg_out, exp_avg_sq_out)]
    flat16 = out.view(-1) if out is not None else None
    # an in-place output is its input's very slice object, as in an ungrouped in-place call on that slice
    in_place = [o is i for o, i in zip((params_out, exp_avg_out, exp_avg_sq_out), (params, exp_avg, exp_avg_sq),
                                       strict=True)]  # fmt: skip
    begin = 0
    for end, g in zip(*segments, strict=True):
        if end > begin:
            p, gr, m, v = (t[begin:end] for t in flat)
            p_out, m_out, v_out = (x if same else o[begin:end] for x, o, same in zip((p, m, v), flat_outs, in_place,
                                                                                      strict=True))  # fmt: skip
            _step(per_group[g], p, gr, m, v, flat16[begin:end] if flat16 is not None else None, p_out, m_out, v_out)
        begin = end


def _step(
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

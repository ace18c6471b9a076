"""Adam and AdamW on flat tensors, in `torch.optim.Adam` / `AdamW`'s exact operation order.

For step `t` (1-based), learning rate `lr`, gradient `g` and weight decay `wd`:

    AdamW:  p <- p * (1 - lr * wd)                  Adam (L2):  g <- g + wd * p
    m <- lerp(m, g, 1 - b1)                         # m + (1 - b1) (g - m)
    v <- v * b2 + (1 - b2) g^2
    p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

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

from ..native.hyper import corrections
from . import adam_core
from .base import AdamState, AMSGradState, Hyper, Optimizer
from .cpu_adam import cpu_adam, cpu_adamw
from .fused_adam import on_device, torch_fused_adam
from .groups import ParamGroups, Segments

__all__ = ["AdamState", "adam", "adamw"]


def _adam(
    lr: Hyper,
    betas: tuple[Hyper, Hyper],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    groups: Any = None,
    bias_correction: bool = True,
    amsgrad: bool = False,
) -> Optimizer:
    defaults = adam_core.make_defaults(lr, betas, eps, weight_decay)

    def init(params: Tensor) -> AdamState | AMSGradState:
        state = adam_core.init_state(params)
        return AMSGradState(*state, torch.zeros_like(params)) if amsgrad else state

    def update(
        grads: Tensor,
        state: AdamState | AMSGradState,
        params: Tensor,
        *,
        donate: bool = False,
        segments: Segments | None = None,
    ) -> tuple[Tensor, AdamState | AMSGradState]:
        applied = int(state.count)
        t = applied + 1
        if segments is not None:
            return _grouped(grads, state, params, donate, segments, defaults, decoupled, bias_correction)
        h = adam_core.step_values(defaults, applied)
        p = params
        if h.weight_decay != 0:
            if decoupled:
                p = torch.mul(p, 1 - h.lr * h.weight_decay, out=p if donate else None)
            else:
                grads = grads.add(p, alpha=h.weight_decay)
        m = torch.lerp(state.exp_avg, grads, 1 - h.beta1, out=state.exp_avg if donate else None)
        v = torch.mul(state.exp_avg_sq, h.beta2, out=state.exp_avg_sq if donate else None)
        v.addcmul_(grads, grads, value=1 - h.beta2)  # v is ours here: donated, or fresh from the mul
        vmax = None
        if isinstance(state, AMSGradState):
            vmax = torch.maximum(state.max_exp_avg_sq, v, out=state.max_exp_avg_sq if donate else None)
        step_size, bc2 = corrections(t, h.lr, h.beta1, h.beta2, bias_correction)
        # torch divides by bc2 ** 0.5 (pow, not math.sqrt): kept for bitwise equality with torch.optim.AdamW
        denom = (v if vmax is None else vmax).sqrt()
        if bias_correction:  # (x / 1.0 == x: skipped without correction)
            denom.div_(bc2**0.5)
        denom.add_(h.eps)  # in place on the fresh sqrt: one allocation
        own = donate or p is not params
        p = torch.addcdiv(p, m, denom, value=-step_size, out=p if own else None)
        return p, _next(t, m, v, vmax)

    return Optimizer(init, update, defaults=defaults, groups=groups, check=adam_core.check)


def _next(t: int, m: Tensor, v: Tensor, vmax: Tensor | None) -> AdamState | AMSGradState:
    state = adam_core.next_state(t, m, v)
    return state if vmax is None else AMSGradState(*state, vmax)


def _grouped(
    grads: Tensor,
    state: AdamState | AMSGradState,
    params: Tensor,
    donate: bool,
    segments: Segments,
    defaults: Mapping[str, Any],
    decoupled: bool,
    bias_correction: bool,
) -> tuple[Tensor, AdamState | AMSGradState]:
    """The update group by group: per group, the same torch ops on the views of its segments (`_foreach_` ops:
    one call per op for all of a group's segments), with the group's scalars computed as above."""
    applied = int(state.count)
    t = applied + 1
    vmax = state.max_exp_avg_sq if isinstance(state, AMSGradState) else None
    if donate:
        p, m, v = params, state.exp_avg, state.exp_avg_sq
    else:
        p, m, v = params.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone()
        vmax = None if vmax is None else vmax.clone()
    flat_p, flat_g, flat_m, flat_v = (x.reshape(-1) for x in (p, grads, m, v))
    for group, ranges in segments.pieces().items():
        h = adam_core.step_values({**defaults, **segments.overrides[group]}, applied)
        ps, ms, vs = ([x[a:b] for a, b in ranges] for x in (flat_p, flat_m, flat_v))
        gs: list[Tensor] | tuple[Tensor, ...] = [flat_g[a:b] for a, b in ranges]
        if h.weight_decay != 0:
            if decoupled:
                torch._foreach_mul_(ps, 1 - h.lr * h.weight_decay)
            else:
                gs = torch._foreach_add(gs, ps, alpha=h.weight_decay)
        torch._foreach_lerp_(ms, gs, 1 - h.beta1)
        torch._foreach_mul_(vs, h.beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - h.beta2)
        if vmax is not None:
            vs = [vmax.reshape(-1)[a:b] for a, b in ranges]
            torch._foreach_maximum_(vs, [flat_v[a:b] for a, b in ranges])
        step_size, bc2 = corrections(t, h.lr, h.beta1, h.beta2, bias_correction)
        denom = torch._foreach_sqrt(vs)
        if bias_correction:
            torch._foreach_div_(denom, bc2**0.5)
        torch._foreach_add_(denom, h.eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-step_size)
    return p, _next(t, m, v, vmax)


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
    if fused:
        _no_fused_amsgrad(amsgrad)
        host = cpu_adamw(lr, betas, eps, weight_decay, bias_correction=bias_correction, groups=groups)
        return on_device(host, _on_gpu(lr, betas, eps, weight_decay, True, groups, bias_correction))
    return _adam(lr, betas, eps, weight_decay, True, groups, bias_correction, amsgrad)


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
    if fused:
        _no_fused_amsgrad(amsgrad)
        host = cpu_adam(lr, betas, eps, weight_decay, bias_correction=bias_correction, groups=groups)
        return on_device(host, _on_gpu(lr, betas, eps, weight_decay, False, groups, bias_correction))
    return _adam(lr, betas, eps, weight_decay, False, groups, bias_correction, amsgrad)


def _on_gpu(
    lr: Hyper,
    betas: tuple[Hyper, Hyper],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    groups: ParamGroups | None,
    bias_correction: bool,
) -> Optimizer:
    """`fused=True`'s update for master weights off the CPU: torch's fused kernel, which always corrects the bias;
    without the correction, torch's operations."""
    if bias_correction:
        return torch_fused_adam(lr, betas, eps, weight_decay, decoupled, groups)
    return _adam(lr, betas, eps, weight_decay, decoupled, groups, bias_correction)


def _no_fused_amsgrad(amsgrad: bool) -> None:
    if amsgrad:  # DeepSpeed's CPU Adam accepts the flag and ignores it; refused here rather than ignored
        raise ValueError("amsgrad=True has no native kernel: use fused=False (torch's operations)")

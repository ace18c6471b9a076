"""Adam and AdamW on flat tensors, in `torch.optim.Adam` / `AdamW`'s exact operation order.

For step `t` (1-based), learning rate `lr`, gradient `g` and weight decay `wd`:

    AdamW:  p <- p * (1 - lr * wd)                  Adam (L2):  g <- g + wd * p
    m <- lerp(m, g, 1 - b1)                         # m + (1 - b1) (g - m)
    v <- v * b2 + (1 - b2) g^2
    p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The scalar factors are computed in Python floats (doubles) exactly as torch's single-tensor implementation does,
so on the same gradients the result equals `torch.optim.AdamW(foreach=False)` bitwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .base import AdamState, Hyper, Optimizer, check_hyper, hyper_value
from .cpu_adam import cpu_adam, cpu_adamw
from .groups import ParamGroups, Segments

__all__ = ["AdamState", "adam", "adamw"]


def _adam(
    lr: Hyper, betas: tuple[Hyper, Hyper], eps: float, weight_decay: float, decoupled: bool, groups: Any = None
) -> Optimizer:
    def check(h: Mapping[str, Any]) -> None:
        check_hyper("learning rate", h["lr"], 0.0)
        if not isinstance(h["betas"], (tuple, list)) or len(h["betas"]) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {h['betas']!r}")
        check_hyper("beta parameter at index 0", h["betas"][0], 0.0, 1.0)
        check_hyper("beta parameter at index 1", h["betas"][1], 0.0, 1.0)
        check_hyper("epsilon value", h["eps"], 0.0)
        check_hyper("weight_decay value", h["weight_decay"], 0.0)

    defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    check(defaults)

    def init(params: Tensor) -> AdamState:
        return AdamState(torch.tensor(0, dtype=torch.int64), torch.zeros_like(params), torch.zeros_like(params))

    def update(
        grads: Tensor, state: AdamState, params: Tensor, *, donate: bool = False, segments: Segments | None = None
    ) -> tuple[Tensor, AdamState]:
        applied = int(state.count)
        t = applied + 1
        if segments is not None:
            return _grouped(grads, state, params, donate, segments, defaults, decoupled)
        lr_t = hyper_value(lr, applied)
        b1, b2 = hyper_value(betas[0], applied), hyper_value(betas[1], applied)
        p = params
        if weight_decay != 0:
            if decoupled:
                p = torch.mul(p, 1 - lr_t * weight_decay, out=p if donate else None)
            else:
                grads = grads.add(p, alpha=weight_decay)
        m = torch.lerp(state.exp_avg, grads, 1 - b1, out=state.exp_avg if donate else None)
        v = torch.mul(state.exp_avg_sq, b2, out=state.exp_avg_sq if donate else None)
        v.addcmul_(grads, grads, value=1 - b2)  # v is ours here: donated, or fresh from the mul
        bias_correction1 = 1 - b1**t
        bias_correction2 = 1 - b2**t
        step_size = lr_t / bias_correction1
        denom = v.sqrt().div_(bias_correction2**0.5).add_(eps)  # in place on the fresh sqrt: one allocation
        own = donate or p is not params
        p = torch.addcdiv(p, m, denom, value=-step_size, out=p if own else None)
        return p, AdamState(torch.tensor(t, dtype=torch.int64), m, v)

    return Optimizer(init, update, defaults=defaults, groups=groups, check=check)


def _grouped(
    grads: Tensor,
    state: AdamState,
    params: Tensor,
    donate: bool,
    segments: Segments,
    defaults: Mapping[str, Any],
    decoupled: bool,
) -> tuple[Tensor, AdamState]:
    """The update group by group: per group, the same torch ops on the views of its segments (`_foreach_` ops:
    one call per op for all of a group's segments), with the group's scalars computed as above."""
    applied = int(state.count)
    t = applied + 1
    if donate:
        p, m, v = params, state.exp_avg, state.exp_avg_sq
    else:
        p, m, v = params.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone()
    flat_p, flat_g, flat_m, flat_v = (x.reshape(-1) for x in (p, grads, m, v))
    for group, ranges in segments.pieces().items():
        h = {**defaults, **segments.overrides[group]}
        lr_t, eps, wd = hyper_value(h["lr"], applied), h["eps"], h["weight_decay"]
        b1, b2 = hyper_value(h["betas"][0], applied), hyper_value(h["betas"][1], applied)
        ps, gs, ms, vs = ([x[a:b] for a, b in ranges] for x in (flat_p, flat_g, flat_m, flat_v))
        if wd != 0:
            if decoupled:
                torch._foreach_mul_(ps, 1 - lr_t * wd)
            else:
                gs = torch._foreach_add(gs, ps, alpha=wd)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        step_size = lr_t / (1 - b1**t)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, (1 - b2**t) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-step_size)
    return p, AdamState(torch.tensor(t, dtype=torch.int64), m, v)


def adamw(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    groups: ParamGroups | None = None,
    fused: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay), matching `torch.optim.AdamW` and its defaults.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied (`fzero.optim.schedules`).
      betas: coefficients of the running averages of the gradient and its square (each may be a schedule too).
      eps: added to the bias-corrected square root, for stability.
      weight_decay: decoupled decay: `p <- p * (1 - lr * weight_decay)` before the Adam step.
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `betas`, `eps`, `weight_decay` for
        the parameters they name.
      fused: one pass over memory on the native kernel (`fzero.cpu_adamw`: float32 master weights on the CPU,
        unscaling, clipping and the low-precision compute copy folded in; within a few float32 ulp of torch per
        step, `tests/test_native.py`) instead of torch's operations (bitwise `torch.optim.AdamW(foreach=False)`,
        about 8 passes).

    Example:
      >>> import torch
      >>> opt = adamw(lr=0.1, weight_decay=0.0)
      >>> p = torch.ones(3)
      >>> p, s = opt.update(torch.ones(3), opt.init(p), p)
      >>> p
      tensor([0.9000, 0.9000, 0.9000])
    """
    if fused:
        return cpu_adamw(lr, betas, eps, weight_decay, groups=groups)
    return _adam(lr, betas, eps, weight_decay, decoupled=True, groups=groups)


def adam(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    groups: ParamGroups | None = None,
    fused: bool = False,
) -> Optimizer:
    """Adam with L2 weight decay (`g <- g + weight_decay * p`), matching `torch.optim.Adam`; see `adamw`."""
    if fused:
        return cpu_adam(lr, betas, eps, weight_decay, groups=groups)
    return _adam(lr, betas, eps, weight_decay, decoupled=False, groups=groups)

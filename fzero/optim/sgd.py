"""SGD with momentum, dampening, Nesterov and L2 weight decay, in `torch.optim.SGD`'s exact operation order.

g <- g + wd * p
b <- g                              on the first update
b <- momentum * b + (1 - dampening) g   afterwards
g <- g + momentum * b  (Nesterov)   or   g <- b
p <- p - lr * g
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .base import Hyper, Optimizer, check_hyper, hyper_value
from .groups import ParamGroups, Segments

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """`count`: updates applied (0-d int64); `momentum_buffer`: empty when `momentum == 0`."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count: the name checkpoints and the engine use
    momentum_buffer: Tensor


def sgd(
    lr: Hyper = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """SGD matching `torch.optim.SGD(foreach=False)` bitwise.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied.
      momentum: momentum factor (0 disables the buffer).
      dampening: dampening of the momentum's gradient term (not applied on the first update, as in torch).
      weight_decay: L2 penalty added to the gradient.
      nesterov: Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
      groups: parameter groups (`fzero.param_groups`): other values of any of the above for the parameters they
        name.
    """

    def check(h: Mapping[str, Any]) -> None:
        check_hyper("learning rate", h["lr"], 0.0)
        check_hyper("momentum value", h["momentum"], 0.0)
        check_hyper("weight_decay value", h["weight_decay"], 0.0)
        check_hyper("dampening value", h["dampening"], 0.0)
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                "nesterov": nesterov}  # fmt: skip
    check(defaults)

    def init(params: Tensor) -> SGDState:
        # groups may give momentum to some parameters: a buffer then, zero where a group has none
        buf = torch.zeros_like(params) if momentum != 0 or groups is not None else params.new_empty(0)
        return SGDState(torch.tensor(0, dtype=torch.int64), buf)

    def update(
        grads: Tensor, state: SGDState, params: Tensor, *, donate: bool = False, segments: Segments | None = None
    ) -> tuple[Tensor, SGDState]:
        applied = int(state.count)
        if segments is not None:
            return _grouped(grads, state, params, donate, segments, defaults)
        lr_t = hyper_value(lr, applied)
        if weight_decay != 0:
            grads = grads.add(params, alpha=weight_decay)
        buf = state.momentum_buffer
        if momentum != 0:
            if applied == 0:
                buf = buf.copy_(grads) if donate else grads.clone()
            else:
                buf = torch.mul(buf, momentum, out=buf if donate else None).add_(grads, alpha=1 - dampening)
            grads = grads.add(buf, alpha=momentum) if nesterov else buf
        p = torch.add(params, grads, alpha=-lr_t, out=params if donate else None)
        return p, SGDState(torch.tensor(applied + 1, dtype=torch.int64), buf)

    return Optimizer(init, update, defaults=defaults, groups=groups, check=check)


def _grouped(
    grads: Tensor, state: SGDState, params: Tensor, donate: bool, segments: Segments, defaults: Mapping[str, Any]
) -> tuple[Tensor, SGDState]:
    """The update group by group, with `_foreach_` ops over each group's segments (the ops of the ungrouped path)."""
    applied = int(state.count)
    p = params if donate else params.clone()
    buf = state.momentum_buffer if donate else state.momentum_buffer.clone()
    flat_p, flat_g = p.reshape(-1), grads.reshape(-1)
    flat_b = buf.reshape(-1)
    for group, ranges in segments.pieces().items():
        h = {**defaults, **segments.overrides[group]}
        lr_t, momentum, dampening = hyper_value(h["lr"], applied), h["momentum"], h["dampening"]
        ps = [flat_p[a:b] for a, b in ranges]
        gs: list[Tensor] | tuple[Tensor, ...] = [flat_g[a:b] for a, b in ranges]
        if h["weight_decay"] != 0:
            gs = torch._foreach_add(gs, ps, alpha=h["weight_decay"])
        if momentum != 0:
            bs = [flat_b[a:b] for a, b in ranges]
            if applied == 0:
                torch._foreach_copy_(bs, gs)
            else:
                torch._foreach_mul_(bs, momentum)
                torch._foreach_add_(bs, gs, alpha=1 - dampening)
            gs = torch._foreach_add(gs, bs, alpha=momentum) if h["nesterov"] else bs
        torch._foreach_add_(ps, gs, alpha=-lr_t)
    return p, SGDState(torch.tensor(applied + 1, dtype=torch.int64), buf)

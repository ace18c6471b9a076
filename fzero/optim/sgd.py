"""SGD with momentum, dampening, Nesterov and L2 weight decay, in `torch.optim.SGD`'s exact operation order.

g <- g + wd * p
b <- g                              on the first update
b <- momentum * b + (1 - dampening) g   afterwards
g <- g + momentum * b  (Nesterov)   or   g <- b
p <- p - lr * g
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .base import Hyper, Optimizer, check_hyper, hyper_value

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """`count`: updates applied (0-d int64); `momentum_buffer`: empty when `momentum == 0`."""

    count: Tensor
    momentum_buffer: Tensor


def sgd(
    lr: Hyper = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
) -> Optimizer:
    """SGD matching `torch.optim.SGD(foreach=False)` bitwise.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied.
      momentum: momentum factor (0 disables the buffer).
      dampening: dampening of the momentum's gradient term (not applied on the first update, as in torch).
      weight_decay: L2 penalty added to the gradient.
      nesterov: Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    """
    check_hyper("learning rate", lr, 0.0)
    check_hyper("momentum value", momentum, 0.0)
    check_hyper("weight_decay value", weight_decay, 0.0)
    check_hyper("dampening value", dampening, 0.0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def init(params: Tensor) -> SGDState:
        buf = torch.zeros_like(params) if momentum != 0 else params.new_empty(0)
        return SGDState(torch.tensor(0, dtype=torch.int64), buf)

    def update(grads: Tensor, state: SGDState, params: Tensor, *, donate: bool = False) -> tuple[Tensor, SGDState]:
        applied = int(state.count)
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

    return Optimizer(init, update)

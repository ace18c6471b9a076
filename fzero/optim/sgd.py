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
from .grouped import Ops, elementwise
from .groups import ParamGroups

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

    return elementwise("sgd", init, _update, defaults, check, groups)


def _update(h: Mapping[str, Any], applied: int, ops: Ops, ps: list[Tensor], gs: list[Tensor], bs: list[Tensor]) -> None:
    """One update in place on the pieces `update_by_group` gives, in `torch.optim.SGD`'s operation order."""
    momentum = h["momentum"]
    if h["weight_decay"] != 0:
        gs = ops.add(gs, ps, alpha=h["weight_decay"])
    if momentum != 0:
        if applied == 0:
            ops.copy_(bs, gs)
        else:
            ops.mul_(bs, momentum)
            ops.add_(bs, gs, alpha=1 - h["dampening"])
        gs = ops.add(gs, bs, alpha=momentum) if h["nesterov"] else bs
    ops.add_(ps, gs, alpha=-hyper_value(h["lr"], applied))

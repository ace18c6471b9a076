"""Adagrad on flat tensors, in `torch.optim.Adagrad`'s exact operation order (`_single_tensor_adagrad`).

For update `t` (1-based), learning rate `lr`, gradient `g`, weight decay `wd` and the running sum `s` (starting at
`initial_accumulator_value`):

    g   <- g + wd * p                            (L2, when wd != 0)
    clr  = lr / (1 + (t - 1) * lr_decay)         (in double, as torch does)
    s   <- s + g * g
    p   <- p - clr * g / (sqrt(s) + eps)

With the same gradients the result equals `torch.optim.Adagrad(foreach=False)` bitwise. A zero gradient moves
nothing (`0 / (sqrt(s) + eps) = 0`, as `eps > 0`), so the zero padding of a flat buffer stays zero, whatever its
running sum: `initial_accumulator_value` from `init`, 0 where resharding a checkpoint made new padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .base import AdagradState, Hyper, Optimizer, check_hyper, hyper_value
from .grouped import Ops, elementwise
from .groups import ParamGroups

__all__ = ["AdagradState", "adagrad"]


def _clr(h: Mapping[str, Any], applied: int) -> float:
    """The decayed learning rate of the update after `applied` applied updates: torch's
    `lr / (1 + (step - 1) * lr_decay)` with `step = applied + 1`."""
    return hyper_value(h["lr"], applied) / (1 + applied * hyper_value(h["lr_decay"], applied))


def adagrad(
    lr: Hyper = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Adagrad matching `torch.optim.Adagrad(foreach=False)` bitwise, with its defaults.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied (`fzero.optim.schedules`).
      lr_decay: the learning rate of update `t` is `lr / (1 + (t - 1) * lr_decay)`.
      weight_decay: L2 penalty added to the gradient.
      initial_accumulator_value: the running sum of squared gradients starts here (one value for the whole
        optimizer: torch fills every parameter's sum with the constructor's value, whatever its group).
      eps: added to the square root of the running sum, for stability.
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `lr_decay`, `weight_decay`, `eps`
        for the parameters they name.

    Returns:
      The `Optimizer`; its state is `AdagradState(count, sum)`.

    Raises:
      ValueError: a hyper-parameter is negative (as in torch), `eps` is 0 (torch allows it; then an element whose
        running sum is 0 divides 0 by 0: NaN wherever the gradients have been 0 with `initial_accumulator_value`
        0, and in a flat buffer's padding after resharding, which refills the state's padding with 0), or a group
        sets another `initial_accumulator_value`.
      TypeError: a hyper-parameter is not a number (only `lr` may be a schedule).

    Example:
      >>> import torch
      >>> opt = adagrad(lr=0.1)
      >>> p = torch.zeros(2)
      >>> p, s = opt.update(torch.tensor([2.0, 0.0]), opt.init(p), p)
      >>> p, s.sum
      (tensor([-0.1000,  0.0000]), tensor([4., 0.]))
    """

    check = checker(initial_accumulator_value)
    defaults = {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay,
                "initial_accumulator_value": initial_accumulator_value, "eps": eps}  # fmt: skip
    check(defaults)

    def init(params: Tensor) -> AdagradState:
        return AdagradState(torch.tensor(0, dtype=torch.int64), torch.full_like(params, initial_accumulator_value))

    return elementwise("adagrad", init, _update, defaults, check, groups)


def _update(h: Mapping[str, Any], applied: int, ops: Ops, ps: list[Tensor], gs: list[Tensor], ss: list[Tensor]) -> None:
    """One update in place on the pieces `update_by_group` gives, in `torch.optim.Adagrad`'s operation order."""
    if h["weight_decay"] != 0:
        gs = ops.add(gs, ps, alpha=h["weight_decay"])
    ops.addcmul_(ss, gs, gs, value=1)
    std = ops.sqrt(ss)
    ops.add_(std, h["eps"])
    ops.addcdiv_(ps, gs, std, value=-_clr(h, applied))


def checker(initial_accumulator_value: float) -> Callable[[Mapping[str, Any]], None]:
    """The validation of Adagrad's hyper-parameters (the defaults, or a parameter group's) for an optimizer whose
    state starts at `initial_accumulator_value` (shared with `cpu_adagrad`); see `adagrad` for the rules."""

    def check(h: Mapping[str, Any]) -> None:
        check_hyper("learning rate", h["lr"], 0.0)
        for key in ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
            if callable(h[key]):
                raise TypeError(f"{key} must be a float, got a callable (only lr may be a schedule)")
        check_hyper("lr_decay value", h["lr_decay"], 0.0)
        check_hyper("weight_decay value", h["weight_decay"], 0.0)
        check_hyper("initial_accumulator_value value", h["initial_accumulator_value"], 0.0)
        check_hyper("epsilon value", h["eps"], 0.0)
        if h["eps"] == 0:
            raise ValueError(
                f"invalid epsilon value: {h['eps']} (expected > 0: with eps = 0 an element whose running sum is 0, "
                "a gradient 0 so far or a flat buffer's padding, divides 0 by 0)"
            )
        if h["initial_accumulator_value"] != initial_accumulator_value:
            raise ValueError(
                f"initial_accumulator_value {h['initial_accumulator_value']!r} differs from the optimizer's "
                f"{initial_accumulator_value!r}: it fills the whole state once (`init`), so a parameter group cannot "
                "change it (torch ignores a group's value)"
            )

    return check

"""What the two Adams share: `adam` / `adamw` (torch operations) and `cpu_adam` / `cpu_adamw` (the native kernel).

One definition of their hyper-parameters (defaults, validation, the values one update uses, schedules evaluated)
and of their state (`AdamState`, created and advanced alike, so checkpoints and tests treat both the same). The
step's bias corrections are `fzero.native.hyper.corrections`, which the kernel's float32 scalars come from too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .base import AdamState, Hyper, check_hyper, hyper_value

__all__ = ["StepValues", "check", "init_state", "make_defaults", "next_state", "step_values"]


def check(h: Mapping[str, Any]) -> None:
    """Validate Adam's hyper-parameters (the defaults, or a parameter group's), with `torch.optim.Adam`'s rules.

    Args:
      h: `lr`, `betas`, `eps` and `weight_decay`; schedules (callables) are not evaluated.

    Raises:
      TypeError, ValueError: naming the hyper-parameter at fault, as torch's messages do.
    """
    check_hyper("learning rate", h["lr"], 0.0)
    if not isinstance(h["betas"], (tuple, list)) or len(h["betas"]) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {h['betas']!r}")
    check_hyper("beta parameter at index 0", h["betas"][0], 0.0, 1.0)
    check_hyper("beta parameter at index 1", h["betas"][1], 0.0, 1.0)
    check_hyper("epsilon value", h["eps"], 0.0)
    check_hyper("weight_decay value", h["weight_decay"], 0.0)


def make_defaults(lr: Hyper, betas: tuple[Hyper, Hyper], eps: float, weight_decay: float) -> dict[str, Any]:
    """The optimizer's hyper-parameters by name (what a parameter group may override), validated.

    Returns:
      `{"lr", "betas", "eps", "weight_decay"}`, `betas` as a tuple.
    """
    defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    check(defaults)
    return defaults


class StepValues(NamedTuple):
    """The hyper-parameters of one update, schedules evaluated (`eps` and `weight_decay` as given)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def step_values(h: Mapping[str, Any], applied: int) -> StepValues:
    """The values the update after `applied` applied updates uses.

    Args:
      h: the hyper-parameters (the defaults, or the defaults with a group's overrides).
      applied: the number of updates already applied (the state's `count`).
    """
    return StepValues(
        hyper_value(h["lr"], applied),
        hyper_value(h["betas"][0], applied),
        hyper_value(h["betas"][1], applied),
        h["eps"],
        h["weight_decay"],
    )


def init_state(params: Tensor) -> AdamState:
    """No update applied, both moments zero, shaped like `params`."""
    return AdamState(torch.tensor(0, dtype=torch.int64), torch.zeros_like(params), torch.zeros_like(params))


def next_state(count: int, exp_avg: Tensor, exp_avg_sq: Tensor) -> AdamState:
    """The state after an update: `count` updates applied, the new moments."""
    return AdamState(torch.tensor(count, dtype=torch.int64), exp_avg, exp_avg_sq)

"""What the Adams share: `adam` / `adamw` (torch operations) and `cpu_adam` / `cpu_adamw` (the native kernel), and
the state and hyper-parameters of `lamb`, `muon` and torch's fused kernel.

One definition of their hyper-parameters (defaults, validation, the values one update uses, schedules evaluated),
of their state (`AdamState`, created and advanced alike, so checkpoints and tests treat all the same), and of Adam's
arithmetic in torch operations (`update`). The step's bias corrections are `fzero.native.hyper.corrections`, which
the kernel's float32 scalars come from too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..native.hyper import corrections
from .base import AdamState, Hyper, check_hyper, hyper_value
from .grouped import Ops

__all__ = ["StepValues", "check", "init_state", "make_defaults", "next_state", "step_values", "update"]


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


def update(
    ops: Ops,
    h: StepValues,
    step: int,
    decoupled: bool,
    bias_correction: bool,
    ps: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    vmaxs: list[Tensor] | None = None,
) -> None:
    """One Adam (`decoupled=False`: L2) or AdamW update in place, in `torch.optim.AdamW`'s exact operation order.

    For step `t`, learning rate `lr`, gradient `g` and weight decay `wd`:

        AdamW:  p <- p * (1 - lr * wd)                  Adam (L2):  g <- g + wd * p
        m <- lerp(m, g, 1 - b1)                         # m + (1 - b1) (g - m)
        v <- v * b2 + (1 - b2) g^2
        p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    The scalar factors are Python floats (doubles), computed as torch's single-tensor implementation does.

    Args:
      ops: `fzero.optim.grouped.PER_TENSOR` or `FOREACH`.
      h: the update's hyper-parameters (`step_values`).
      step: `t`, the 1-based number of the update.
      decoupled: AdamW's decoupled weight decay, else Adam's L2 penalty.
      bias_correction: divide by `1 - b^t` (without it both corrections are 1: `p <- p - lr * m / (sqrt(v) + eps)`).
      ps, gs, ms, vs: the parameters, gradients, first and second moments (lists of tensors, pairwise alike).
      vmaxs: AMSGrad's running maxima of `v` (which then take `v`'s place in the denominator), or None.
    """
    if h.weight_decay != 0:
        if decoupled:
            ops.mul_(ps, 1 - h.lr * h.weight_decay)
        else:
            gs = ops.add(gs, ps, alpha=h.weight_decay)
    ops.lerp_(ms, gs, 1 - h.beta1)
    ops.mul_(vs, h.beta2)
    ops.addcmul_(vs, gs, gs, value=1 - h.beta2)
    if vmaxs is not None:
        ops.maximum_(vmaxs, vs)
        vs = vmaxs
    step_size, bc2 = corrections(step, h.lr, h.beta1, h.beta2, bias_correction)
    denom = ops.sqrt(vs)
    # torch divides by bc2 ** 0.5 (pow, not math.sqrt): kept for bitwise equality with torch.optim.AdamW
    if bias_correction:  # (x / 1.0 == x: skipped without correction)
        ops.div_(denom, bc2**0.5)
    ops.add_(denom, h.eps)
    ops.addcdiv_(ps, ms, denom, value=-step_size)

"""The scalars of one optimizer step, computed once per step in double and rounded once to float32.

Adam, for step `t` (1-based), with bias correction:

    step_size    = lr / (1 - beta1^t)
    inv_sqrt_bc2 = 1 / sqrt(1 - beta2^t)
    decay        = 1 - lr * weight_decay      (AdamW: decoupled; Adam's L2 mode adds weight_decay * p to g instead)

Without bias correction (DeepSpeed's `bias_correction=False`) both corrections are 1.

Lion: `1 - beta1`, `1 - beta2` and `decay = 1 - lr * weight_decay` (no step count). Adagrad, for step `t`:
`clr = lr / (1 + (t - 1) * lr_decay)` (torch.optim.Adagrad's decayed learning rate).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

__all__ = [
    "AdagradHyper",
    "AdamHyper",
    "Corrections",
    "LionHyper",
    "adagrad_clr",
    "adagrad_hyper",
    "adam_hyper",
    "corrections",
    "lion_hyper",
]


def _f32(x: float) -> float:
    """`x` rounded to the nearest float32, as a C cast does (what the kernel receives)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the cast gives an infinity
        return math.copysign(math.inf, x)


class Corrections(NamedTuple):
    """A step's bias-corrected scalars in double, not rounded: what torch's Adam and the kernel's share."""

    step_size: float
    """`lr / (1 - beta1^t)`."""
    bias_correction2: float
    """`1 - beta2^t`; its square root divides the second moment's (each caller takes the root its own way)."""


def corrections(step: int, lr: float, beta1: float, beta2: float, bias_correction: bool = True) -> Corrections:
    """The step size and the second bias correction of step `step` (1-based), in double.

    The one definition of Adam's bias corrections: `fzero.adamw` uses them as they are (torch's operation order),
    `adam_hyper` rounds them to the kernel's float32 scalars.

    Args:
      step: the 1-based number of the update.
      lr, beta1, beta2: the step's learning rate and moment coefficients (schedules already evaluated).
      bias_correction: False turns both corrections into 1 (DeepSpeed's `bias_correction=False`).

    Returns:
      `Corrections(step_size, bias_correction2)`.

    Example:
      >>> corrections(1, 0.1, 0.9, 0.999)
      Corrections(step_size=1.0000000000000002, bias_correction2=0.0010000000000000009)
    """
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    return Corrections(lr / bc1, bc2)


class AdamHyper(NamedTuple):
    """The float32 scalars of one step, field for field the C `fz_adam_hyper`."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    step_size: float
    inv_sqrt_bc2: float
    decay: float
    l2: float
    grad_scale: float


def adam_hyper(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    bias_correction: bool,
    grad_scale: float = 1.0,
) -> AdamHyper:
    """The scalars of step `step` (1-based), each rounded once to float32.

    Args:
      step: the 1-based number of the update.
      lr, beta1, beta2, eps, weight_decay: the step's hyper-parameters (schedules already evaluated).
      decoupled: AdamW's decoupled decay (`decay = 1 - lr * weight_decay`) or Adam's L2 penalty (`l2`).
      bias_correction: False turns both bias corrections into 1.
      grad_scale: the factor the kernel multiplies into every gradient as it loads it.

    Returns:
      The `AdamHyper` the kernel receives.

    Raises:
      ValueError: `step` is not a positive integer.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adam step must be a positive integer (1 for the first update), got {step!r}")
    step_size, bc2 = corrections(step, lr, beta1, beta2, bias_correction)
    values = (
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        step_size,
        1 / math.sqrt(bc2),  # the kernel multiplies by this inverse; torch's Adam divides by bc2 ** 0.5
        1 - lr * weight_decay if decoupled else 1.0,
        0.0 if decoupled else weight_decay,
        grad_scale,
    )
    return AdamHyper(*(_f32(float(v)) for v in values))


class LionHyper(NamedTuple):
    """The float32 scalars of one Lion step, field for field the C `fz_lion_hyper`."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    lr: float
    decay: float
    grad_scale: float


def lion_hyper(lr: float, beta1: float, beta2: float, weight_decay: float, grad_scale: float = 1.0) -> LionHyper:
    """The scalars of a Lion step, each rounded once to float32 (`1 - beta` and `1 - lr * weight_decay` in double).

    Args:
      lr, beta1, beta2, weight_decay: the step's hyper-parameters (schedules already evaluated).
      grad_scale: the factor the kernel multiplies into every gradient as it loads it.

    Returns:
      The `LionHyper` the kernel receives.

    Example:
      >>> lion_hyper(1e-4, 0.9, 0.99, 0.0).decay
      1.0
    """
    values = (beta1, 1 - beta1, beta2, 1 - beta2, lr, 1 - lr * weight_decay, grad_scale)
    return LionHyper(*(_f32(float(v)) for v in values))


class AdagradHyper(NamedTuple):
    """The float32 scalars of one Adagrad step, field for field the C `fz_adagrad_hyper`."""

    eps: float
    step_size: float
    l2: float
    grad_scale: float


def adagrad_clr(step: int, lr: float, lr_decay: float) -> float:
    """torch.optim.Adagrad's learning rate of step `step` (1-based), in double: `lr / (1 + (step - 1) * lr_decay)`.

    Raises:
      ValueError: `step` is not a positive integer.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adagrad step must be a positive integer (1 for the first update), got {step!r}")
    return lr / (1 + (step - 1) * lr_decay)


def adagrad_hyper(
    step: int, lr: float, lr_decay: float, eps: float, weight_decay: float, grad_scale: float = 1.0
) -> AdagradHyper:
    """The scalars of Adagrad's step `step` (1-based), each rounded once to float32 (`clr` computed in double).

    Args:
      step: the 1-based number of the update (for the learning-rate decay).
      lr, lr_decay, eps, weight_decay: the step's hyper-parameters (an `lr` schedule already evaluated).
      grad_scale: the factor the kernel multiplies into every gradient as it loads it.

    Returns:
      The `AdagradHyper` the kernel receives.

    Raises:
      ValueError: `step` is not a positive integer.

    Example:
      >>> adagrad_hyper(3, 0.1, 0.5, 1e-10, 0.0).step_size  # 0.1 / 2, rounded to float32
      0.05000000074505806
    """
    values = (eps, adagrad_clr(step, lr, lr_decay), weight_decay, grad_scale)
    return AdagradHyper(*(_f32(float(v)) for v in values))

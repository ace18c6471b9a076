"""The scalars of one Adam step, computed once per step in double and rounded once to float32.

For step `t` (1-based), with bias correction:

    step_size    = lr / (1 - beta1^t)
    inv_sqrt_bc2 = 1 / sqrt(1 - beta2^t)
    decay        = 1 - lr * weight_decay      (AdamW: decoupled; Adam's L2 mode adds weight_decay * p to g instead)

Without bias correction (DeepSpeed's `bias_correction=False`) both corrections are 1.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

__all__ = ["AdamHyper", "adam_hyper"]


def _f32(x: float) -> float:
    """`x` rounded to the nearest float32, as a C cast does (what the kernel receives)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: the cast gives an infinity
        return math.copysign(math.inf, x)


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
    """The scalars of step `step` (1-based), each rounded once to float32."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adam step must be a positive integer (1 for the first update), got {step!r}")
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    values = (
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        lr / bc1,
        1 / math.sqrt(bc2),
        1 - lr * weight_decay if decoupled else 1.0,
        0.0 if decoupled else weight_decay,
        grad_scale,
    )
    return AdamHyper(*(_f32(float(v)) for v in values))

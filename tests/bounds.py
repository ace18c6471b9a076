"""The tolerances of tests whose two runs do not perform the same arithmetic, each derived from the operations.

The suite compares in one of three ways (docs/equivalence.md has the table):

1. **Bitwise** (`torch.equal`) wherever both runs do the same floating-point operations in the same order.
2. **float64 runs that reorder a sum** (`reorder_bound`): the two orders of a sum of `n` terms each lie within
   `gamma_n * sum|t|` of the exact sum (Higham 4.2), which Adam's step turns into at most `lr * 2 n u G / eps` per
   element and step (the worst case, `|g| ~ eps`). Tight enough in float64 to catch any real bug (which moves a
   parameter by ~`lr`), and independent of which instruction set torch's kernels pick.
3. **float32 runs against a differently reduced (or differently fused) reference**: no bound of kind 2 exists in
   float32 (`u = 6e-8`: Adam's worst-case amplification `lr / eps` makes it vacuous), and the gradients of the later
   steps depend on the earlier differences through the model. What holds whatever the arithmetic is Adam's own step
   bound (`adam_drift`): every step moves an element by at most `lr * r_t`, so two runs from the same start differ
   by at most `2 lr sum_t r_t`. That catches blow-ups, not subtle bugs, so these tests also check a **detection
   threshold** (`tracks`): the mean difference over all elements is a small fraction of the mean distance the
   reference moved. Rounding moved it by at most 3.8e-6 of that distance in float32 (docs/equivalence.md); a
   wrong mean, a shifted shard or a missing step moves it by order 1. The threshold is not an error bound.

Every bound here holds on AVX-512, AVX2 and the portable paths alike (`ATEN_CPU_CAPABILITY`, `FZERO_ISA`): none of
them was tuned to a machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

U32 = 2.0**-24  # unit roundoff, float32
U64 = 2.0**-53  # unit roundoff, float64

TRACKS = 1e-3  # the detection threshold of kind 3: mean |got - ref| <= 0.1% of the mean distance the reference moved


def adam_ratio(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest `|m_hat / (sqrt(v_hat) + eps)|` Adam's step `step` can take, whatever the gradients.

    With `m_t = (1-b1) sum_i b1^(t-i) g_i` and `v_t = (1-b2) sum_i b2^(t-i) g_i^2`, Cauchy-Schwarz gives

        |m_hat| / sqrt(v_hat) <= (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{k<t} (b1^2/b2)^k)

    (1 at t = 1, 1.0014 at t = 2, 1.0036 at t = 3 for the default betas).

        >>> round(adam_ratio(1), 6), round(adam_ratio(3), 4)
        (1.0, 1.0036)
    """
    b1, b2 = betas
    q = b1 * b1 / b2
    return (1 - b1) / (1 - b1**step) * math.sqrt((1 - b2**step) / (1 - b2)) * math.sqrt(sum(q**k for k in range(step)))


def adam_drift(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999), scale: float = 1.0) -> float:
    """Per element, the most two Adam/AdamW runs from the same start can differ after `steps` steps, whatever
    their gradients: each moves an element by at most `lr * adam_ratio(t)` per step (decoupled weight decay
    multiplies both by the same factor `1 - lr wd <= 1`, which only shrinks the difference), plus each step's
    own rounding, a few ulp of the parameter (`scale`: the largest |parameter|).

    Args:
      lr: the largest learning rate of any group.
      steps: optimizer steps taken.
      betas: Adam's.
      scale: the largest parameter magnitude.
    """
    return sum(2 * lr * adam_ratio(t, betas) + 8 * U32 * scale for t in range(1, steps + 1))


def reorder_bound(lr: float, terms: int, steps: int, grad: float = 10.0, eps: float = 1e-8) -> float:
    """float64: per element, the most two Adam runs differ when each gradient element is a sum of `terms` terms of
    magnitude at most `grad`, added in two orders: `2 gamma_terms grad` per gradient element (each order within
    `gamma_terms sum|t|` of the exact sum), through `lr * m / (sqrt(v) + eps)` (first moment and denominator:
    `2 lr / eps`), per step."""
    gamma = terms * U64 / (1 - terms * U64)
    return steps * 2 * lr * 2 * gamma * grad / eps


def max_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() if b[k].numel() else 0.0 for k in b)


def tracks(
    got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]
) -> float:
    """The mean |got - ref| over every element as a fraction of the mean |ref - start| (kind 3's statistic)."""
    diff = sum((got[k].double() - ref[k].double()).abs().sum().item() for k in ref)
    moved = sum((ref[k].double() - start[k].double()).abs().sum().item() for k in ref)
    return diff / moved


def adam_check(
    got: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    lr: float,
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
) -> dict[str, float]:
    """Kind 3's figures (plain floats, so a worker process can report them): the largest difference and its bound,
    and the mean difference as a fraction of the distance the reference moved."""
    assert got.keys() >= ref.keys(), sorted(ref.keys() - got.keys())
    scale = max(v.double().abs().max().item() for v in ref.values() if v.numel())
    return {"max": max_diff(got, ref), "bound": adam_drift(lr, steps, betas, scale), "tracks": tracks(got, ref, start)}


def assert_adam_close(
    got: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor],
    lr: float,
    steps: int,
    betas: tuple[float, float] = (0.9, 0.999),
) -> None:
    """Kind 3: every element within Adam's step bound, and the mean difference under the detection threshold."""
    assert_within(adam_check(got, ref, start, lr, steps, betas))


def assert_within(check: Mapping[str, float], threshold: float | None = TRACKS) -> None:
    """`adam_check`'s figures: the bound always; the detection threshold unless `threshold` is None (low-precision
    compute, where rounding alone moves the mean by more: docs/equivalence.md)."""
    assert check["max"] <= check["bound"], check
    assert threshold is None or check["tracks"] <= threshold, check

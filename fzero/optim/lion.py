"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as DeepSpeed's `FusedLion` and
`DeepSpeedCPULion` compute it, on flat tensors.

For learning rate `lr`, betas `(b1, b2)`, weight decay `wd`, gradient `g`, momentum `m` (zero at first):

    c <- b1 * m + (1 - b1) * g          # the interpolation whose sign is the update
    p <- p * (1 - lr * wd)              # decoupled decay (skipped when wd == 0, as DeepSpeed's CPU kernel does)
    p <- p - lr * sign(c)               # sign(0) = 0
    m <- b2 * m + (1 - b2) * g          # the momentum, from the old m and the raw g

DeepSpeed's source (deepspeedai/DeepSpeed at edaa722):

- `csrc/lion/multi_tensor_lion.cu` (`FusedLion`), per element in float32:
  61 `after_decay = 1.0f - lr * decay;`  83 `c = beta1 * r_m + (1 - beta1) * r_g;`
  84 `update = c > 0 ? (-lr) : lr;`  85 `r_p = r_p * after_decay + update;`
  86 `r_m = beta2 * r_m + (1 - beta2) * r_g;`
- `csrc/lion/cpu_lion_impl.cpp` 48-59 (`DeepSpeedCPULion`'s scalar path): `tmp = momentum * _betta1;
  tmp = grad * betta1_minus1 + tmp; tmp = -std::copysignf(alpha, tmp); param = param * after_decay + tmp` (or
  `param + tmp` when `_weight_decay == 0`); `momentum = momentum * _betta2; momentum = grad * betta2_minus1 +
  momentum`.

The step count is not used (Lion has no bias correction); `count` serves the schedules. DeepSpeed's defaults
(`lr=1e-3, betas=(0.9, 0.999), weight_decay=0`, `deepspeed/ops/lion/fused_lion.py` 36, `cpu_lion.py` 16) are
this module's, so a config's `"type": "Lion"` block means what it means to DeepSpeed.

Where fzero differs, on purpose:

- `sign(0) = 0` (the paper's sign, `torch.sign`). DeepSpeed's CUDA kernel moves an element whose `c` is exactly 0
  by `+lr` (`c > 0 ? -lr : lr`) and its CPU kernel by `-lr` (`-copysign(lr, +0.0)`); here it only decays. So the
  padding of a flat buffer (zero parameter, gradient and momentum) stays zero, at any world size.
- Every product and sum is rounded on its own (the order written above); DeepSpeed's kernels fuse the
  multiply-adds (explicit AVX `fmadd`; `nvcc` contracts by default). Rounding each operation makes the update the
  same on every instruction set and at every position in a shard (so a shard's update is the slice of the full
  buffer's, bitwise); it differs from a fused one by about an ulp of `c`, `m` and `p` per step, and takes the same
  sign decision unless `|c|` is within an ulp of 0.
- The scalars (`1 - b1`, `1 - b2`, `1 - lr * wd`, `-lr`) are computed in double and rounded once to the buffer's
  dtype (as for `fzero.adamw`); DeepSpeed computes them in float32 from float32 `lr` and betas (`1 - b1` then
  differs in its last bits: `1.0f - 0.9f` is `0.100000024`, the double `1 - 0.9` rounds to `0.100000001`).
- A NaN in `c` gives `sign = 0` (`torch.sign`): the element holds still and its momentum turns NaN. DeepSpeed moves
  it by `+lr` (CUDA). Non-finite gradients are the loss scaler's to skip before any update.

(DeepSpeed 0.19.8's AVX path, `csrc/includes/cpu_lion.h`, takes the sign with a sign-bit mask and `xor` onto
`-lr`: `-copysign(lr, c)`, as its scalar path does; its parameters equal fzero's `cpu_lion` bitwise in
tests/test_deepspeed_ops.py, `FZERO_DEEPSPEED_OPS=1`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .base import Hyper, LionState, Optimizer, check_hyper, hyper_value
from .grouped import Ops, elementwise
from .groups import ParamGroups

__all__ = ["LionState", "lion"]


class _Step(NamedTuple):
    """The scalars of one update, in double (torch rounds each once to the buffer's dtype)."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    decay: float | None  # 1 - lr * wd; None when wd == 0 (no multiplication)
    neg_lr: float


def step_values(h: Mapping[str, Any], applied: int) -> tuple[float, float, float, float]:
    """`(lr, beta1, beta2, weight_decay)` of the update after `applied` applied updates (schedules evaluated), from
    the hyper-parameters `h` (shared with `cpu_lion`)."""
    return (hyper_value(h["lr"], applied), hyper_value(h["betas"][0], applied), hyper_value(h["betas"][1], applied),
            hyper_value(h["weight_decay"], applied))  # fmt: skip


def _step(h: Mapping[str, Any], applied: int) -> _Step:
    """The scalars of the update after `applied` applied updates, from the hyper-parameters `h`."""
    lr, b1, b2, wd = step_values(h, applied)
    return _Step(b1, 1 - b1, b2, 1 - b2, 1 - lr * wd if wd != 0 else None, -lr)


def check(h: Mapping[str, Any]) -> None:
    """Validate Lion's hyper-parameters (the defaults, or a parameter group's).

    DeepSpeed validates none; these are `torch.optim.AdamW`'s rules for the names they share, with either beta
    allowed to be 1 (`b1 = 1`: the sign of the momentum alone; `b2 = 1`: a frozen momentum).

    Args:
      h: `lr`, `betas` and `weight_decay`; schedules (callables) are not evaluated.

    Raises:
      TypeError, ValueError: naming the hyper-parameter at fault.
    """
    check_hyper("learning rate", h["lr"], 0.0)
    if not isinstance(h["betas"], (tuple, list)) or len(h["betas"]) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {h['betas']!r}")
    check_hyper("beta parameter at index 0", h["betas"][0], 0.0, 1.0, open_high=False)
    check_hyper("beta parameter at index 1", h["betas"][1], 0.0, 1.0, open_high=False)
    check_hyper("weight_decay value", h["weight_decay"], 0.0)


def lion(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    weight_decay: Hyper = 0.0,
    *,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Lion, DeepSpeed's `FusedLion` / `DeepSpeedCPULion` arithmetic (see the module's notes) and defaults.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied (`fzero.optim.schedules`).
        Lion's updates have size `lr` in every element: its learning rate is typically 3-10x smaller than AdamW's.
      betas: `b1` interpolates the momentum and the gradient for the update's sign, `b2` is the momentum's decay
        (each may be a schedule too).
      weight_decay: decoupled decay: `p <- p * (1 - lr * weight_decay)` before the signed step (a schedule too).
      groups: parameter groups (`fzero.param_groups`): other values of `lr`, `betas`, `weight_decay` for the
        parameters they name.

    Returns:
      The `Optimizer`; its state is `LionState(count, exp_avg)`.

    Example:
      >>> import torch
      >>> opt = lion(lr=0.1)
      >>> p = torch.zeros(3)
      >>> p, s = opt.update(torch.tensor([2.0, -1.0, 0.0]), opt.init(p), p)
      >>> p, s.exp_avg
      (tensor([-0.1000,  0.1000,  0.0000]), tensor([ 0.0020, -0.0010,  0.0000]))
    """
    defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
    check(defaults)

    def init(params: Tensor) -> LionState:
        return LionState(torch.tensor(0, dtype=torch.int64), torch.zeros_like(params))

    return elementwise("lion", init, _update, defaults, check, groups)


def _update(h: Mapping[str, Any], applied: int, ops: Ops, ps: list[Tensor], gs: list[Tensor], ms: list[Tensor]) -> None:
    """One update in place on the pieces `update_by_group` gives, in the order the module's notes state."""
    s = _step(h, applied)
    cs = ops.mul(ms, s.beta1)
    ops.add_(cs, ops.mul(gs, s.one_minus_beta1))
    ops.sign_(cs)
    if s.decay is not None:
        ops.mul_(ps, s.decay)
    # -lr * sign(c) is exact (sign is -1, 0 or 1): one rounding, fused or not
    ops.add_(ps, cs, alpha=s.neg_lr)
    ops.mul_(ms, s.beta2)
    ops.add_(ms, ops.mul(gs, s.one_minus_beta2))

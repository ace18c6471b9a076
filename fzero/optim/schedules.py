"""Learning-rate (and momentum) schedules: pure functions of `n`, the number of updates already applied.

They reproduce DeepSpeed 0.19's schedulers (`runtime/lr_schedules.py`) with its parameter names, so a DeepSpeed
`scheduler` block maps one to one, and compute DeepSpeed's values bitwise (its operations in its order: e.g. the
log warm-up multiplies by a stored `1 / log(N)`). DeepSpeed's schedulers treat each param group alike with its own
values (per-group lists of `warmup_min_lr`, `cycle_max_lr`, ...; a group's own lr as `WarmupLR`'s maximum when it is
None, and as `WarmupCosineLR`'s base): one schedule per group here (`fzero.config.build.build_schedules`).

DeepSpeed steps a scheduler once after each *applied* update, starting from `last_batch_iteration = -1`, and the
value the constructor writes serves the first update; so the update that follows `n` applied updates uses
DeepSpeed's formula at `last_batch_iteration = n - 1`. Quirks reproduced on purpose:

- `warmup_lr`, `warmup_decay_lr`: the first two updates both use `warmup_min_lr` (the constructor writes the
  minimum, and the first `step()` evaluates the warm-up at iteration 0, whose gamma is 0);
  `warmup_num_steps` below 2 counts as 2.
- `warmup_cosine_lr`: the first update uses a learning rate of 0 (the constructor writes ratio 0).
- `one_cycle_momentum`: the first update uses `cycle_min_mom` (the constructor writes it) although the cycle formula
  starts at `cycle_max_mom`; DeepSpeed also forces Adam's beta2 to 0.99 under OneCycle: pass
  `betas=(one_cycle_momentum(...), 0.99)` to reproduce that.

A skipped (non-finite) step applies no update, so it advances no schedule.

Example:
    >>> lr = warmup_lr(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    >>> [lr(n) for n in range(7)]
    [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["constant", "one_cycle", "one_cycle_momentum", "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr"]

Schedule = Callable[[int], float]


def constant(value: float) -> Schedule:
    """`value` at every step."""
    return lambda n: value


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return max(2, warmup_num_steps)


def _warmup_gamma(it: int, steps: int, warmup_type: str) -> float:
    """DeepSpeed's warm-up fraction at iteration `it < steps`: `(1 / log(N)) * log(it + 1)`, computed in that order
    (DeepSpeed keeps `inverse_log_warm_up = 1.0 / math.log(N)`); `log(it + 1) / log(N)` differs from it by one ulp
    at about a quarter of the steps."""
    if warmup_type == "log":
        return (1.0 / math.log(steps)) * math.log(it + 1)
    return it / steps


def warmup_lr(
    warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log"
) -> Schedule:
    """DeepSpeed's `WarmupLR`: from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then constant.

    At iteration `i = n - 1`: `lr = min + (max - min) * gamma`, `gamma = (1 / log(N)) * log(i + 1)` ("log") or
    `i / N` ("linear") while `i < N`, else 1; `lr = min` before the first step (`i = -1`). Bitwise DeepSpeed's.
    """
    steps = _check_warmup(warmup_num_steps, warmup_type)
    delta = warmup_max_lr - warmup_min_lr  # DeepSpeed's delta_lrs

    def lr(n: int) -> float:
        it = n - 1
        if it < 0:
            return warmup_min_lr
        gamma = _warmup_gamma(it, steps, warmup_type) if it < steps else 1.0
        return warmup_min_lr + delta * gamma

    return lr


def warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's `WarmupDecayLR`: `warmup_lr`, then linear decay to `warmup_min_lr` at `total_num_steps`.

    After the warm-up (`i >= N`): `gamma = max(0, (T - i) / max(1, T - N))`.
    """
    steps = _check_warmup(warmup_num_steps, warmup_type)
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
    delta = warmup_max_lr - warmup_min_lr

    def lr(n: int) -> float:
        it = n - 1
        if it < 0:
            return warmup_min_lr
        if it < steps:
            gamma = _warmup_gamma(it, steps, warmup_type)
        else:
            gamma = max(0.0, float(total_num_steps - it) / float(max(1.0, total_num_steps - steps)))
        return warmup_min_lr + delta * gamma

    return lr


def warmup_cosine_lr(
    lr: float,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's `WarmupCosineLR`: `lr` (the optimizer's learning rate) times a ratio that warms up from
    `warmup_min_ratio` to 1, then follows a cosine down to `cos_min_ratio` at `total_num_steps`.

    Warm-up (`i < N`): `ratio = min_ratio + gamma * (1 - min_ratio)`. Then `progress = min(1, (i - N + 1) /
    max(1, T - N))`, `ratio = max(0, cos_min + (1 - cos_min) * (1 + cos(pi * progress)) / 2)`. Ratio 0 before the
    first step.
    """
    steps = _check_warmup(warmup_num_steps, warmup_type)
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
    base = lr

    def schedule(n: int) -> float:
        it = n - 1
        if it < 0:
            return 0.0
        if it < steps:
            ratio = warmup_min_ratio + _warmup_gamma(it, steps, warmup_type) * (1.0 - warmup_min_ratio)
        else:
            progress = min(1.0, (it - steps + 1) / max(1, total_num_steps - steps))
            ratio = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio)
        return base * ratio

    return schedule


class _Cycle:
    """OneCycle's triangular position: `scale(bi)` in [0, 1] for batch index `bi = i + 1`."""

    def __init__(self, first: int, second: int | None, first_stairs: int, second_stairs: int | None) -> None:
        if not first > 0 or (second is not None and not second >= 0):  # DeepSpeed 0.19.8 allows a second half of 0
            raise ValueError(f"cycle_first_step_size must be positive and cycle_second_step_size non-negative, got "
                             f"{first!r} and {second!r}")  # fmt: skip
        self.first = float(first)
        self.second = float(second) if second is not None else self.first
        self.total = self.first + self.second
        self.ratio = self.first / self.total
        self.first_stairs = first_stairs
        self.second_stairs = first_stairs if second_stairs is None else second_stairs

    def scale(self, bi: int) -> float:
        cycle = math.floor(1 + bi / self.total)
        x = 1.0 + bi / self.total - cycle
        rising = x <= self.ratio
        stairs = self.first_stairs if rising else self.second_stairs
        if stairs and stairs > 0:
            ci = bi % self.total
            pos = ci * stairs / self.first if ci <= self.first else (self.total - ci) * stairs / self.second
            return math.floor(pos) / stairs
        return x / self.ratio if rising else (x - 1) / (self.ratio - 1)


def one_cycle(
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
) -> Schedule:
    """DeepSpeed's `OneCycle` learning rate: up from `cycle_min_lr` to `cycle_max_lr` over the first step size,
    down over the second, then (if `decay_step_size` and `decay_lr_rate`) `min / (1 + rate * d / decay_step_size)`
    after `d` post-cycle steps."""
    cyc = _Cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count)
    no_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)

    def lr(n: int) -> float:
        it = n - 1
        if it < 0:
            return cycle_min_lr  # the constructor writes the minimum
        if it < cyc.total:
            return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * cyc.scale(it + 1)
        if no_decay:
            return cycle_min_lr
        return cycle_min_lr / (1 + decay_lr_rate * ((it - cyc.total + 1) / decay_step_size))

    return lr


def one_cycle_momentum(
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
) -> Schedule:
    """DeepSpeed's `OneCycle` momentum (Adam's beta1), inverse to the learning rate: `max - (max - min) * scale`
    in the cycle, `max * (1 + rate * d / decay_step_size)` after it; `cycle_min_mom` for the first update."""
    cyc = _Cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count)
    no_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)

    def mom(n: int) -> float:
        it = n - 1
        if it < 0:
            return cycle_min_mom
        if it < cyc.total:
            return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * cyc.scale(it + 1)
        if no_decay:
            return cycle_max_mom
        return cycle_max_mom * (1 + decay_mom_rate * ((it - cyc.total + 1) / decay_step_size))

    return mom

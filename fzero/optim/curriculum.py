"""Curriculum schedules: a difficulty (a sequence length, a percentile of a data metric) as a pure function of the
step, with DeepSpeed 0.19.8's formulas (`runtime/data_pipeline/curriculum_scheduler.py`), bitwise.

A schedule is a `Curriculum`: `difficulty = schedule(step)`. DeepSpeed's scheduler object adds one rule on top, kept
here as a pure update of the current difficulty (`Curriculum` state is one number): the difficulty starts at
`min_difficulty` and, once it has reached `max_difficulty`, is never computed again (`advance`). A researcher composes
a schedule with the step counter of the loop; the DeepSpeed-compatible `CurriculumScheduler`
(`fzero.engine.curriculum_scheduler`, re-exported at DeepSpeed's path by `fzero.deepspeed`), which the engine's legacy
`curriculum_learning` block and its curriculum data sampler run, wraps these functions.

Example:
    >>> f = fixed_linear(min_difficulty=8, max_difficulty=64, total_curriculum_step=10, difficulty_step=8)
    >>> [f(s) for s in (1, 5, 9, 10, 11)]
    [8, 32, 56, 64, 64]
    >>> current = 8
    >>> for step in range(1, 4):
    ...     current = advance(f, current, step, max_difficulty=64)
    >>> current
    24
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["Curriculum", "advance", "fixed_discrete", "fixed_linear", "fixed_root"]

Number = int | float
Curriculum = Callable[[int], Number]
"""A difficulty as a function of the step (DeepSpeed passes `global_steps + 1`, or its sampler's batch count)."""


def _positive(name: str, value: Number) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def fixed_root(
    min_difficulty: Number,
    max_difficulty: Number,
    total_curriculum_step: Number,
    difficulty_step: Number,
    root_degree: Number,
) -> Curriculum:
    """DeepSpeed's `fixed_root`: `(step / total) ** (1 / root_degree)` of the way from min to max, floored to a
    multiple of `difficulty_step`, at least the first such multiple at or above `min_difficulty`, at most
    `max_difficulty`.

    Args:
      min_difficulty, max_difficulty: the range.
      total_curriculum_step: the step at which the maximum is reached.
      difficulty_step: every difficulty is a multiple of it (8 or 16 for sequence lengths on tensor cores).
      root_degree: 2 for a square root, 1 for linear.

    Returns:
      The schedule.

    Raises:
      ValueError: `total_curriculum_step`, `difficulty_step` or `root_degree` not a positive number.
    """
    for name, value in (("total_curriculum_step", total_curriculum_step), ("difficulty_step", difficulty_step),
                        ("root_degree", root_degree)):  # fmt: skip
        _positive(name, value)
    # DeepSpeed's lowest difficulty: the first multiple of the step at or above min_difficulty
    floor = -(-min_difficulty // difficulty_step) * difficulty_step

    def schedule(step: int) -> Number:
        # DeepSpeed's operations, in its order (float division, float power, floor, then the step's multiple)
        frac = (float(step) / total_curriculum_step) ** (1.0 / root_degree)
        d = math.floor(frac * (max_difficulty - min_difficulty) + min_difficulty)
        d -= d % difficulty_step
        return min(max(d, floor), max_difficulty)

    return schedule


def fixed_linear(
    min_difficulty: Number, max_difficulty: Number, total_curriculum_step: Number, difficulty_step: Number
) -> Curriculum:
    """DeepSpeed's `fixed_linear`: `fixed_root` with `root_degree` 1 (see there)."""
    return fixed_root(min_difficulty, max_difficulty, total_curriculum_step, difficulty_step, 1)


def fixed_discrete(difficulty: Sequence[Number], max_step: Sequence[Number]) -> Curriculum:
    """DeepSpeed's `fixed_discrete`: `difficulty[i]` for the first `i` with `step <= max_step[i]`, and the last
    difficulty after the last `max_step`.

    Args:
      difficulty: the difficulties, one more than `max_step`.
      max_step: the last step of each difficulty but the last.

    Returns:
      The schedule.

    Raises:
      ValueError: empty lists, or `len(difficulty) != len(max_step) + 1`.
    """
    difficulty, max_step = list(difficulty), list(max_step)
    if not max_step or len(difficulty) != len(max_step) + 1:
        raise ValueError(
            f"fixed_discrete needs one more difficulty than max_step (the last difficulty holds after the last "
            f"max_step) and at least one max_step; got {len(difficulty)} difficulties and {len(max_step)} max_step"
        )

    def schedule(step: int) -> Number:
        if step > max_step[-1]:
            return difficulty[-1]
        # (DeepSpeed scans in order: with unsorted max_step the first match wins, here too)
        return next(d for d, m in zip(difficulty, max_step, strict=False) if step <= m)

    return schedule


def advance(schedule: Curriculum, current: Number, step: int, max_difficulty: Number) -> Number:
    """DeepSpeed's `update_difficulty` as a pure function: the difficulty after the update at `step`.

    Args:
      schedule: the difficulty as a function of the step.
      current: the difficulty before (the first is `min_difficulty`).
      step: the step of this update.
      max_difficulty: once `current` has reached it, it is kept and `schedule` is not called again.

    Returns:
      `schedule(step)`, or `current` where `current >= max_difficulty`.
    """
    return schedule(step) if current < max_difficulty else current

"""DeepSpeed's `CurriculumScheduler` (`deepspeed.runtime.data_pipeline.curriculum_scheduler`, which
`fzero.deepspeed` re-exports from here), over fzero's pure schedules (`fzero.optim.curriculum`): the engine's legacy
`curriculum_learning` block and each metric of the curriculum data sampler run one.

    scheduler = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 8}})
    seqlen = scheduler.update_difficulty(global_steps + 1)

The same difficulties as DeepSpeed 0.19.8's, step by step (its formulas, in its order: `fzero.optim.curriculum`),
and the methods its engine and sampler call. Differences, on purpose:

- the config is checked when the scheduler is built (`fzero.config.data_efficiency.check_schedule`): a missing key,
  a zero `total_curriculum_step` or `difficulty_step`, or `fixed_discrete` lists of the wrong lengths raise a
  `ConfigError` naming the key, where DeepSpeed asserts or divides by zero at the first step;
- a `custom` schedule asked for a difficulty before `set_custom_get_difficulty` raises a `RuntimeError` saying so
  (DeepSpeed: `'NoneType' object is not callable`);
- `state_dict()` / `load_state_dict()` hold the scheduler's state as JSON values (DeepSpeed 0.19.8's scheduler has
  none; its sampler saves the current difficulties). `get_state`, `set_state`, `get_current_difficulty`,
  `set_current_difficulty` and `first_step` are those of the DeepSpeed releases that still had the legacy block.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ..config.data_efficiency import check_schedule, schedule_of
from ..config.data_keys import (
    CURRICULUM_LEARNING_CURRENT_DIFFICULTY,
    CURRICULUM_LEARNING_MAX_DIFFICULTY,
    CURRICULUM_LEARNING_MIN_DIFFICULTY,
    CURRICULUM_LEARNING_SCHEDULE_CONFIG,
    CURRICULUM_LEARNING_SCHEDULE_CUSTOM,
    CURRICULUM_LEARNING_SCHEDULE_TYPE,
)
from ..config.schema import ConfigError
from ..optim import curriculum

__all__ = ["CurriculumScheduler"]

_KEYS = (
    CURRICULUM_LEARNING_MIN_DIFFICULTY,
    CURRICULUM_LEARNING_MAX_DIFFICULTY,
    CURRICULUM_LEARNING_SCHEDULE_TYPE,
)


class CurriculumScheduler:
    """DeepSpeed's curriculum scheduler: a difficulty per step, kept once it reaches the maximum.

    Args:
      config: `min_difficulty`, `max_difficulty`, `schedule_type` and `schedule_config` (other keys, such as a
        metric's paths, are ignored).
      path: the block's dotted path in the DeepSpeed config, for the errors (e.g. ``curriculum_learning``).

    Attributes:
      state: DeepSpeed's state dict (`min_difficulty`, `max_difficulty`, `current_difficulty`, `schedule_type`,
        `schedule_config`).
      first_step: True until a caller sets it (DeepSpeed's pipeline engine's flag).

    Raises:
      ConfigError: a missing or invalid key, named by its dotted path.
    """

    def __init__(self, config: Mapping[str, Any], path: str = "") -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(path, f"expected an object (JSON {{...}}), got {type(config).__name__}")
        schedule_config = check_schedule(config, path)
        self.state: dict[str, Any] = {key: config[key] for key in _KEYS}
        self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = config[CURRICULUM_LEARNING_MIN_DIFFICULTY]
        if config[CURRICULUM_LEARNING_SCHEDULE_TYPE] != CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
            self.state[CURRICULUM_LEARNING_SCHEDULE_CONFIG] = copy.deepcopy(
                dict(config[CURRICULUM_LEARNING_SCHEDULE_CONFIG])
            )
        self._schedule: Callable[[int], Any] | None = schedule_of({**config, "schedule_config": schedule_config})
        self.custom_get_difficulty: Callable[[int], Any] | None = None
        self.first_step = True

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """The function of the step a `custom` schedule calls (DeepSpeed's; `engine.set_custom_curriculum_learning_
        schedule` sets it on the sampler's schedulers)."""
        if not callable(schedule_function):
            raise TypeError(f"set_custom_get_difficulty: expected a function of the step, got {schedule_function!r}")
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at `global_steps` (whatever the current difficulty)."""
        if self.state[CURRICULUM_LEARNING_SCHEDULE_TYPE] == CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
            if self.custom_get_difficulty is None:
                raise RuntimeError(
                    "curriculum schedule_type 'custom' has no function yet: call "
                    "engine.set_custom_curriculum_learning_schedule({metric: fn}) (data sampling) or "
                    "scheduler.set_custom_get_difficulty(fn) first"
                )
            return self.custom_get_difficulty(global_steps)
        assert self._schedule is not None  # (built for every other type)
        return self._schedule(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """DeepSpeed's update: the difficulty at `global_steps`, unless the current one has reached the maximum.

        Returns:
          The current difficulty after the update.
        """
        state = self.state
        state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = curriculum.advance(
            self.get_difficulty, state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY], global_steps,
            state[CURRICULUM_LEARNING_MAX_DIFFICULTY],
        )  # fmt: skip
        return state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    def get_current_difficulty(self) -> Any:
        return self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = difficulty

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state as JSON values (a copy): what `load_state_dict` restores."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s state; the schedule itself (type and config) must be this scheduler's.

        Raises:
          ValueError: the saved schedule is another one (naming the differing key), or the state lacks the current
            difficulty.
        """
        for key, value in self.state.items():
            if key == CURRICULUM_LEARNING_CURRENT_DIFFICULTY:
                continue
            if state_dict.get(key) != value:
                raise ValueError(
                    f"curriculum scheduler state: {key} is {state_dict.get(key)!r} in the saved state, {value!r} in "
                    "this scheduler's config: a checkpoint resumes the schedule it was saved with"
                )
        if CURRICULUM_LEARNING_CURRENT_DIFFICULTY not in state_dict:
            raise ValueError(f"curriculum scheduler state: no {CURRICULUM_LEARNING_CURRENT_DIFFICULTY!r}")
        self.state[CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = state_dict[CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

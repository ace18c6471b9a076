"""`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`: DeepSpeed 0.19.8's difficulties step by
step, over fzero's pure schedules (`fzero.optim.curriculum`); the engine's (`fzero.engine.curriculum_scheduler`,
whose docstring lists where it differs on purpose: the config checked when built, a clear error for a `custom`
schedule without its function, `state_dict()` as JSON values)."""

from __future__ import annotations

from ....engine.curriculum_scheduler import CurriculumScheduler
from .constants import *  # noqa: F403 (DeepSpeed's module star-imports its constants too)

__all__ = ["CurriculumScheduler"]

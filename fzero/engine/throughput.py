"""`engine.tput_timer`: DeepSpeed's throughput timer, as scripts read it.

DeepSpeed's engine keeps a `ThroughputTimer` (`deepspeed/utils/timer.py`) that scripts touch directly: DeepSpeed-
Chat calls `model.tput_timer.update_epoch_count()` at every epoch and reads its counters. fzero's engine starts it at
the first forward of a micro-step and stops it at the micro-step's end, as DeepSpeed's does, with DeepSpeed's
counters and average; its progress line stays fzero's own (`fzero.metrics.log`, every `steps_per_print` steps).
"""

from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Micro-step and global-step timing, with DeepSpeed's attributes and methods.

    Attributes:
      batch_size: the global batch size (`train_batch_size`).
      start_step: the global steps left out of the average (DeepSpeed's warm-up, 2).
      epoch_count, micro_step_count, global_step_count: DeepSpeed's counters (`update_epoch_count` restarts the
        micro-steps).
      total_elapsed_time: seconds between `start` and `stop`, summed over the timed micro-steps.
    """

    def __init__(self, batch_size: int, start_step: int = 2) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.start_time = 0.0
        self.started = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro-step began (timed once `start_step` global steps are done)."""
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """The micro-step ended (`global_step`: on the accumulation boundary). `report_speed` is accepted for
        DeepSpeed's signature; the engine's progress line reports the speed."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += global_step
        if self.start_time > 0:
            self.total_elapsed_time += time.time() - self.start_time

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps (DeepSpeed's formula); `-inf` before the first timed one
        (where DeepSpeed's divides by zero)."""
        timed = self.global_step_count - self.start_step
        if timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")

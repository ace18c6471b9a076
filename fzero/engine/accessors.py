"""`ConfigAccessors`: DeepSpeed's engine methods that only read the configuration (`engine.train_batch_size()`,
`engine.zero_optimization_stage()`, ...), apart from the engine's training logic."""

from __future__ import annotations

import os

from ..config import Config

__all__ = ["ConfigAccessors"]


class ConfigAccessors:
    """DeepSpeed's configuration accessors, for a class with a validated `config` (`fzero.Engine`)."""

    config: Config
    micro_steps: int

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.config.gas

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def zero_optimization(self) -> bool:
        return self.config.stage > 0

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    bf16_enabled = bfloat16_enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` updates the parameters: `(micro_steps + 1) % GAS == 0`."""
        return (self.micro_steps + 1) % self.config.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        raise NotImplementedError(
            "set_gradient_accumulation_boundary: fzero's accumulation counts micro-steps in the transform chain "
            "(accumulate(gradient_accumulation_steps)); call step() after every micro-batch"
        )

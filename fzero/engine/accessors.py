"""`ConfigAccessors`: DeepSpeed's engine methods that only read the configuration or the mesh
(`engine.train_batch_size()`, `engine.zero_optimization_stage()`, `engine.get_data_parallel_rank()`, ...), apart from
the engine's training logic."""

from __future__ import annotations

import os

from ..config import Config
from ..mesh import RankMesh

__all__ = ["ConfigAccessors"]


class ConfigAccessors:
    """DeepSpeed's configuration accessors, for a class with a validated `config` and a mesh (`fzero.Engine`)."""

    config: Config
    mesh: RankMesh

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.config.gas

    def get_batch_info(self) -> tuple[int, int, int]:
        """`(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`. (DeepSpeed 0.19.8
        returns the three bound methods uncalled, against its own docstring: here the numbers it documents.)"""
        return self.config.train_batch_size, self.config.micro_batch, self.config.gas

    def dataloader_drop_last(self) -> bool:
        return self.config["dataloader_drop_last"]

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def zero_optimization(self) -> bool:
        return self.config.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned (stages 2 and 3)."""
        return self.config.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Whether parameters are partitioned (stage 3)."""
        return self.config.stage >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`zero_optimization.stage3_gather_16bit_weights_on_model_save`: whether `save_16bit_model` gathers the
        weights at stage 3 (else it saves nothing and returns False)."""
        return self.config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]

    def zero_cpu_offload(self) -> bool:
        return self.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    bf16_enabled = bfloat16_enabled

    def fp16_auto_cast(self) -> bool:
        return self.config["fp16"]["auto_cast"]

    def loss_scale(self) -> float:
        """DeepSpeed's `engine.loss_scale()`: the configured `fp16.loss_scale`, 0.0 for dynamic scaling (whatever the
        precision). The scale in use now is `engine.optimizer.cur_scale` (and `.loss_scale`), as in DeepSpeed."""
        return float(self.config["fp16"]["loss_scale"])

    def dynamic_loss_scale(self) -> bool:
        return self.config["fp16"]["loss_scale"] == 0

    def initial_dynamic_scale(self) -> int:
        return 2 ** self.config["fp16"]["initial_scale_power"]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    # ---------------------------------------------------------------------------------------- parallel groups
    # fzero is data parallel only: every rank is a data-parallel rank, and model (tensor) parallelism has one rank.
    # (DeepSpeed 0.19.8's engine raises "data parallel group is not initialized" for these unless a model-parallel
    # unit `mpu` set up its groups.)
    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.world

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_parallel_rank = get_model_parallel_rank

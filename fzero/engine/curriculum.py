"""`CurriculumMethods`: DeepSpeed's data-efficiency surface on the engine: the legacy `curriculum_learning` block
(the forward's `curriculum_seqlen`), curriculum data sampling (`engine.deepspeed_io`), their accessors and their
state in the engine's checkpoints.

The legacy block, as DeepSpeed's engine before 0.19.8 ran it (0.19.8 refuses the block; fzero keeps it so that
Megatron-DeepSpeed's configs train unchanged): at every `engine(...)` forward while the module is in training mode,

    difficulty = curriculum_scheduler_legacy.update_difficulty(global_steps + 1)
    model(*args, **kwargs, curriculum_seqlen=difficulty)          where curriculum_type is "seqlen"

so the micro-batches of one accumulation window all see the difficulty of the optimizer step they belong to
(`global_steps` advances on the boundary only), evaluation forwards (`module.eval()`) leave it alone, and the model
truncates its sequences itself (Megatron: `tokens[:, :curriculum_seqlen]`). The schedule is `fzero.optim.curriculum`'s,
run by `fzero.engine.curriculum_scheduler.CurriculumScheduler` (DeepSpeed's class).

Curriculum data sampling (`data_efficiency.data_sampling.curriculum_learning.enabled`): `engine.deepspeed_io(dataset)`
returns DeepSpeed's `DeepSpeedDataLoader` (`fzero.engine.dataloader`) over `DeepSpeedDataSampler`
(`fzero.engine.data_sampler`), which draws each global batch from the samples whose metric is within the current
difficulty; `initialize(training_data=...)` builds the engine's `training_dataloader` so (`fzero.engine.build`), as
DeepSpeed's `initialize` does.

Checkpoints: the legacy scheduler's state (`"curriculum_legacy"`) and the training data loader's sampler's
(`"data_sampler"`), `state_dict()`s of JSON values, are parts of the engine's own checkpoint record
(`fzero.engine.checkpointing`: `_checkpoint_parts`), never of the caller's client state, and restored by
`load_checkpoint` unless `load_module_only`, as DeepSpeed restores its sampler's. Nothing is pickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DistributedSampler

from ..config import Config
from ..mesh import RankMesh
from .checkpointing import CheckpointMethods
from .curriculum_scheduler import CurriculumScheduler
from .dataloader import DeepSpeedDataLoader

__all__ = ["CurriculumMethods"]


class CurriculumMethods(CheckpointMethods):
    """The engine's data-efficiency methods (a mixin of `fzero.Engine`, before `CheckpointMethods`)."""

    config: Config
    mesh: RankMesh
    training_dataloader: Any  # (the engine's: what initialize built from training_data, or None)
    _curriculum_legacy: CurriculumScheduler | None = None  # the legacy block's scheduler, built on first use

    # ------------------------------------------------------------------------------------------------ accessors
    def data_efficiency_enabled(self) -> bool:
        return bool(self.config["data_efficiency"]["enabled"])

    def data_efficiency_config(self) -> dict[str, Any]:
        return self.config["data_efficiency"]

    def data_sampling_enabled(self) -> bool:
        return bool(self.config["data_efficiency"]["data_sampling"]["enabled"])

    def data_sampling_config(self) -> dict[str, Any]:
        return self.config["data_efficiency"]["data_sampling"]

    def curriculum_learning_enabled(self) -> bool:
        """Whether curriculum data sampling is on (`data_efficiency.data_sampling.curriculum_learning.enabled`)."""
        return bool(self.curriculum_learning_config()["enabled"])

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self.config["data_efficiency"]["data_sampling"]["curriculum_learning"]

    def curriculum_enabled_legacy(self) -> bool:
        """Whether the legacy top-level `curriculum_learning` block is on."""
        return bool(self.config["curriculum_learning"]["enabled"])

    def curriculum_params_legacy(self) -> dict[str, Any]:
        """The legacy block without `enabled` (DeepSpeed's)."""
        return {k: v for k, v in self.config["curriculum_learning"].items() if k != "enabled"}

    @property
    def curriculum_scheduler_legacy(self) -> CurriculumScheduler:
        """The legacy block's `CurriculumScheduler` (DeepSpeed's attribute; only where the block is enabled).

        Raises:
          AttributeError: the legacy block is not enabled (DeepSpeed's engine has no such attribute then).
        """
        if self._curriculum_legacy is None:
            if not self.curriculum_enabled_legacy():
                raise AttributeError(
                    "curriculum_scheduler_legacy: the config's top-level curriculum_learning block is not enabled"
                )
            self._curriculum_legacy = CurriculumScheduler(self.curriculum_params_legacy(), "curriculum_learning")
        return self._curriculum_legacy

    # ------------------------------------------------------------------------------------------------- the forward
    def _curriculum_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`engine(...)`'s keyword arguments with the legacy block's `curriculum_seqlen` (see the module docstring)."""
        module = self._modules["module"]  # type: ignore[attr-defined]  # (nn.Module's table: the engine's model)
        if not (module.training and self.curriculum_enabled_legacy()):
            return kwargs
        scheduler = self.curriculum_scheduler_legacy
        scheduler.update_difficulty(self.global_steps + 1)  # type: ignore[attr-defined]
        if self.config["curriculum_learning"]["curriculum_type"] == "seqlen":
            kwargs = {**kwargs, "curriculum_seqlen": scheduler.get_current_difficulty()}
        return kwargs

    # -------------------------------------------------------------------------------------------- data sampling
    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """DeepSpeed's `engine.deepspeed_io`: a `DeepSpeedDataLoader` over `dataset`, with the curriculum sampler
        where curriculum data sampling is enabled, else each rank's share (`DistributedSampler`, shuffled for
        training, in order for `route` ``"eval"`` / ``"predict"``).

        Args:
          dataset: a map-style or iterable torch dataset.
          batch_size: the micro-batch size (default the config's).
          route: ``"train"``, ``"eval"`` or ``"predict"``.
          pin_memory, data_sampler, collate_fn, num_local_io_workers: the loader's (DeepSpeed's arguments).

        Returns:
          The loader (not made the engine's `training_dataloader`, as in DeepSpeed).

        Raises:
          ValueError: `dataset` is not a torch dataset.
        """
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) and not hasattr(dataset, "__iter__"):
            raise ValueError(f"deepspeed_io: training data must be a torch Dataset, got {type(dataset).__name__}")
        world, rank = self.mesh.world, self.mesh.rank
        if data_sampler is None and route in ("predict", "eval"):
            data_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        loader_config: dict[str, Any] = {}
        if self.curriculum_learning_enabled():
            loader_config = {
                "curriculum_learning": True,
                "data_efficiency": self.data_efficiency_config(),
                "data_parallel_group": None,  # (fzero's sampler broadcasts through the engine's mesh)
                "gradient_accumulation_steps": self.config.gas,
                "global_rank": rank,
                "data_sampling_num_workers": self.data_sampling_config()["num_workers"],
                "mesh": self.mesh,
            }
        return DeepSpeedDataLoader(
            dataset, batch_size or self.config.micro_batch, pin_memory, int(os.environ.get("LOCAL_RANK", 0)),
            getattr(self, "tput_timer", None) if route == "train" else None, collate_fn=collate_fn,
            num_local_io_workers=num_local_io_workers, data_sampler=data_sampler, data_parallel_world_size=world,
            data_parallel_rank=rank, dataloader_drop_last=self.config["dataloader_drop_last"],
            deepspeed_dataloader_config=loader_config,
        )  # fmt: skip

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], Any]]) -> None:
        """DeepSpeed's: the functions of the step of the `custom` curriculum metrics of the training data loader's
        sampler, by metric name (where curriculum data sampling is on and the engine has a training data loader)."""
        loader = self.training_dataloader
        if loader is not None and self.curriculum_learning_enabled():
            loader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def _curriculum_sampler(self) -> Any:
        loader = self.training_dataloader
        if loader is None or not self.curriculum_learning_enabled():
            return None
        sampler = getattr(loader, "data_sampler", None)
        return sampler if hasattr(sampler, "load_state_dict") else None

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _checkpoint_parts(self) -> dict[str, Any]:
        """`CheckpointMethods._checkpoint_parts`, with the legacy scheduler's and the sampler's states where they run
        (see the module docstring)."""
        parts = super()._checkpoint_parts()
        if self.curriculum_enabled_legacy():
            parts["curriculum_legacy"] = self.curriculum_scheduler_legacy.state_dict()
        sampler = self._curriculum_sampler()
        if sampler is not None:
            parts["data_sampler"] = sampler.state_dict()
        return parts

    def _restore_checkpoint_parts(self, parts: Mapping[str, Any], where: str) -> None:
        """`CheckpointMethods._restore_checkpoint_parts`: the legacy scheduler's and the sampler's states, where the
        checkpoint has them and this engine runs them.

        Raises:
          ValueError: the saved legacy schedule is not this config's (naming the checkpoint and the key).
        """
        super()._restore_checkpoint_parts(parts, where)
        legacy = parts.get("curriculum_legacy")
        if legacy is not None and self.curriculum_enabled_legacy():
            try:
                self.curriculum_scheduler_legacy.load_state_dict(legacy)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        sampler = self._curriculum_sampler()
        if parts.get("data_sampler") is not None and sampler is not None:
            sampler.load_state_dict(parts["data_sampler"])

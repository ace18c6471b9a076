"""DeepSpeed's `DeepSpeedDataLoader`, what `engine.deepspeed_io` returns (`fzero.deepspeed.runtime.dataloader`
re-exports it at DeepSpeed's path): with curriculum data sampling, DeepSpeed's `DeepSpeedDataSampler`
(`fzero.engine.data_sampler`) as its batch sampler; otherwise each rank's share of the data set through a
`DistributedSampler`, as DeepSpeed's.

The curriculum sampler needs NumPy, an optional dependency of fzero: it is imported when a loader with curriculum
learning is built, so that `import fzero` works without NumPy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from math import ceil
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

__all__ = [
    "CURRICULUM_LEARNING",
    "DATA_EFFICIENCY",
    "DATA_PARALLEL_GROUP",
    "DATA_SAMPLING_NUM_WORKERS",
    "GLOBAL_RANK",
    "GRADIENT_ACCUMULATION_STEPS",
    "MESH",
    "DeepSpeedDataLoader",
]

# the keys of `deepspeed_dataloader_config` (DeepSpeed's constants)
CURRICULUM_LEARNING = "curriculum_learning"
DATA_EFFICIENCY = "data_efficiency"
DATA_PARALLEL_GROUP = "data_parallel_group"
DATA_SAMPLING_NUM_WORKERS = "data_sampling_num_workers"
GLOBAL_RANK = "global_rank"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
MESH = "mesh"  # fzero's: the engine's mesh, through which the curriculum sampler broadcasts its batches


def _sampler_class() -> Any:
    """`DeepSpeedDataSampler`, imported where a curriculum loader is built (it needs NumPy; fzero does not).

    Raises:
      ImportError: NumPy is not installed, saying what needs it.
    """
    try:
        from .data_sampler import DeepSpeedDataSampler
    except ImportError as e:
        if "numpy" not in str(e):
            raise
        raise ImportError(
            "curriculum data sampling (data_efficiency.data_sampling.curriculum_learning) needs NumPy, which is not "
            f"installed ({e}): pip install numpy"
        ) from e
    return DeepSpeedDataSampler


def _broadcast(mesh: Any) -> Any:
    """Rank 0's tensor on every rank, through `mesh` where the ranks run in processes of their own."""
    if mesh is None or len(mesh.local_ranks) == mesh.world:
        return None
    return lambda x: mesh.broadcast(x, 0)


class DeepSpeedDataLoader:
    """DeepSpeed's data loader: iterate it for micro-batches (see the module docstring). Built by
    `engine.deepspeed_io`; its arguments are DeepSpeed's (`tput_timer` is accepted and not used: the engine times
    its steps itself).

    Attributes:
      data_sampler: the `DeepSpeedDataSampler` (curriculum) or the `DistributedSampler` (whose epoch the script
        sets, as with torch's loaders).
      post_process_func: DeepSpeed's hook `f(batch, sampler_state) -> batch` for curriculum batches.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        pin_memory: bool,
        local_rank: int,
        tput_timer: Any,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
        data_sampler: Any = None,
        data_parallel_world_size: int | None = None,
        data_parallel_rank: int | None = None,
        dataloader_drop_last: bool = False,
        deepspeed_dataloader_config: Mapping[str, Any] | None = None,
    ) -> None:
        config = dict(deepspeed_dataloader_config or {})
        self.deepspeed_dataloader_config = config
        self.curriculum_learning_enabled = bool(config.get(CURRICULUM_LEARNING, False))
        world = data_parallel_world_size or 1
        rank = data_parallel_rank or 0
        if self.curriculum_learning_enabled:
            data_sampler = _sampler_class()(
                config[DATA_EFFICIENCY], len(dataset), batch_size, rank, world, config.get(DATA_PARALLEL_GROUP),
                config[GRADIENT_ACCUMULATION_STEPS], config[GLOBAL_RANK], drop_last=dataloader_drop_last,
                broadcast=_broadcast(config.get(MESH)),
            )  # fmt: skip
            num_local_io_workers = config[DATA_SAMPLING_NUM_WORKERS]
        else:
            if data_sampler is None:
                data_sampler = DistributedSampler(dataset=dataset, num_replicas=world, rank=rank)
            if num_local_io_workers is None:
                num_local_io_workers = 2  # (DeepSpeed's: two per device, one device per process)
        self.num_local_io_workers = num_local_io_workers
        self.data_sampler = data_sampler
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self.pin_memory = pin_memory
        self.dataloader_drop_last = dataloader_drop_last
        self.post_process_func: Any = None
        self.dataloader: Any = None
        self._iter: Iterator[Any] | None = None
        n = len(self.data_sampler)
        self.len = n // batch_size if dataloader_drop_last else ceil(n / batch_size)

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> DeepSpeedDataLoader:
        self._create_dataloader()
        return self

    def __next__(self) -> Any:
        if self._iter is None:
            self._create_dataloader()
        assert self._iter is not None
        data = next(self._iter)
        if self.curriculum_learning_enabled and self.post_process_func is not None:
            data = self.post_process_func(data, self.data_sampler.state_dict())
        return data

    def _create_dataloader(self) -> Any:
        extra = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        if self.curriculum_learning_enabled:
            self.dataloader = DataLoader(
                self.dataset, pin_memory=self.pin_memory, batch_sampler=self.data_sampler,
                num_workers=self.num_local_io_workers, **extra,
            )  # fmt: skip
        else:
            self.dataloader = DataLoader(
                self.dataset, batch_size=self.batch_size, pin_memory=self.pin_memory, sampler=self.data_sampler,
                num_workers=self.num_local_io_workers, drop_last=self.dataloader_drop_last, **extra,
            )  # fmt: skip
        self._iter = iter(self.dataloader)
        return self.dataloader

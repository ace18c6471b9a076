"""`deepspeed.runtime.dataloader`: `RepeatingLoader` and `DeepSpeedDataLoader` (the engine's,
`fzero.engine.dataloader`: what `engine.deepspeed_io` returns; with curriculum data sampling, DeepSpeed's
`DeepSpeedDataSampler` as its batch sampler; otherwise each rank's share of the data set through a
`DistributedSampler`, as DeepSpeed's). `initialize` returns a torch `DataLoader` over `training_data`, sharded per rank
the same way, or, with curriculum data sampling, `engine.deepspeed_io(training_data)`, as DeepSpeed's.
`DeepSpeedDataSampler` is here too, as in DeepSpeed's module, imported on first use (it needs NumPy)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ...engine.dataloader import (
    CURRICULUM_LEARNING,
    DATA_EFFICIENCY,
    DATA_PARALLEL_GROUP,
    DATA_SAMPLING_NUM_WORKERS,
    GLOBAL_RANK,
    GRADIENT_ACCUMULATION_STEPS,
    DeepSpeedDataLoader,
)
from ..accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it too)
from ..refusal import refuse

__all__ = [
    "CURRICULUM_LEARNING",
    "DATA_EFFICIENCY",
    "DATA_PARALLEL_GROUP",
    "DATA_SAMPLING_NUM_WORKERS",
    "GLOBAL_RANK",
    "GRADIENT_ACCUMULATION_STEPS",
    "DeepSpeedDataLoader",
    "RepeatingLoader",
]

_UNSUPPORTED: dict[str, str] = {}


class RepeatingLoader:
    """Iterate `loader` forever, starting it again each time it is exhausted.

    Args:
      loader: any iterable (a `DataLoader`: its sampler reshuffles at each new pass).
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedDataSampler":  # (DeepSpeed's module imports it; it needs NumPy, which this module does not)
        from ...engine.data_sampler import DeepSpeedDataSampler

        return DeepSpeedDataSampler
    return refuse(__name__, name, _UNSUPPORTED)

"""`deepspeed.runtime.dataloader`: `RepeatingLoader`. DeepSpeed's own loader class is refused: `initialize` returns
a torch `DataLoader` over `training_data` (sharded per rank with a `DistributedSampler`, as DeepSpeed's is)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it too)
from ..refusal import refuse

__all__ = ["RepeatingLoader"]

_UNSUPPORTED = {
    **dict.fromkeys(
        """
        DeepSpeedDataLoader DeepSpeedDataSampler
        """.split(),
        "pass training_data (and collate_fn) to initialize: it returns a torch DataLoader that shards it per rank",
    ),
    **dict.fromkeys(
        """
        CURRICULUM_LEARNING DATA_EFFICIENCY DATA_PARALLEL_GROUP DATA_SAMPLING_NUM_WORKERS GLOBAL_RANK
        GRADIENT_ACCUMULATION_STEPS
        """.split(),
        "DeepSpeed's data-efficiency (curriculum learning) settings: fzero's config refuses data_efficiency",
    ),
}


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
    return refuse(__name__, name, _UNSUPPORTED)

"""What both meshes share: named axes and their sizes, the ledgers they record into, and the reductions' checks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from .handles import ReduceOp
from .ledger import Ledger

__all__ = ["MeshBase", "OwnRank", "coordinate"]


class MeshBase:
    world: int
    _ledgers: list[Ledger]
    shape: dict[str, int]

    @contextlib.contextmanager
    def record(self) -> Iterator[Ledger]:
        """Count the collectives issued inside the `with` block into a fresh `Ledger`."""
        ledger = Ledger(self.world)
        self._ledgers.append(ledger)
        try:
            yield ledger
        finally:  # by identity: two ledgers that recorded the same collectives are equal
            self._ledgers[:] = [x for x in self._ledgers if x is not ledger]

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names, outermost first (empty for a 1-D mesh made with `world=`)."""
        return tuple(self.shape)

    def size(self, axis: str | None = None) -> int:
        """The number of ranks a collective over `axis` spans (`world` for None)."""
        if axis is None:
            return self.world
        n = self.shape.get(axis)
        if n is None:
            raise ValueError(f"{self!r} has no axis {axis!r}; its axes are {list(self.shape) or 'none (1-D)'}")
        return n

    def account(self, kind: str, full: int, axis: str | None = None, itemsize: int = 4) -> None:
        """Count one collective over a buffer of `full` elements per rank (after gather / before scatter) in the
        active ledgers; for code that moves the data itself (`SimMesh` simulations of per-rank collectives)."""
        self._log(kind, full, axis, itemsize)

    def _log(self, kind: str, full: int, axis: str | None = None, itemsize: int = 4) -> None:
        """Log one collective over a buffer of `full` elements per rank (after gather / before scatter)."""
        if not self._ledgers:
            return
        world = self.world if axis is None else self.size(axis)
        factor = 2 if kind == "all_reduce" else 1
        elements = factor * full
        moved = factor * full * (world - 1) // world
        if kind == "broadcast":
            moved = full if world > 1 else 0
        # payload bytes where the mesh has named axes (what crosses which links is then a question), for every
        # collective; a 1-D mesh's ledger keeps its element counts only
        key = kind if axis is None else f"{kind}:{axis}"
        nbytes = full * itemsize if self.shape else None
        for ledger in self._ledgers:
            ledger.add(key, elements, moved, nbytes)


def coordinate(shape: Mapping[str, int], rank: int, axis: str | None) -> int:
    """Rank `rank`'s coordinate along `axis` of a mesh of named axes `shape` (ranks laid out row-major; the rank
    itself for None)."""
    if axis is None:
        return rank
    names = list(shape)
    inner = math.prod(list(shape.values())[names.index(axis) + 1 :])
    return rank // inner % shape[axis]


def _shape(shape: Mapping[str, int], what: str) -> dict[str, int]:
    if not isinstance(shape, Mapping) or not shape:
        raise ValueError(f"{what}: shape must be a non-empty mapping of axis names to sizes, e.g. "
                         f"{{'replicate': 2, 'shard': 4}}, got {shape!r}")  # fmt: skip
    for name, n in shape.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: axis names must be non-empty strings, got {name!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what}: axis {name!r} needs an int size >= 1, got {n!r}")
    return dict(shape)


def _check_chunks(x: Tensor, world: int, what: str) -> int:
    if x.ndim == 0 or x.shape[-1] % world:
        raise ValueError(f"{what}: last dimension of shape {tuple(x.shape)} is not divisible by world={world}")
    return x.shape[-1] // world


def _finish(total: Tensor, op: ReduceOp, world: int) -> Tensor:
    """The reduction's result from its sum `total`, a buffer of the collective's own: divided in place for "mean"
    (bitwise `total / world`, without a fresh buffer)."""
    if op == "sum" or (op == "mean" and world == 1):  # x / 1 == x bitwise: skip a pass over the buffer
        return total
    if op == "mean":
        return total.div_(world)
    raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")


class OwnRank:
    """What a mesh seen from one rank (`RankMesh`) does with per-rank values: they are this rank's own. Its
    `local_ranks` is `(rank,)`; `pick` and `stack` change nothing; per-rank code runs as it is written."""

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks whose values this process holds: its own."""
        return (self.rank,)

    def pick(self, x: Any, rank: int) -> Any:
        """This rank's value of a per-rank pytree: `x` itself."""
        return x

    def stack(self, values: Sequence[Any]) -> Any:
        """The per-rank value of this rank: `values[0]`."""
        return values[0]

    def map(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`: this rank's values are its own."""
        return fn(*args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(self, *args)`: per-rank code runs here as it is written."""
        return fn(self, *args)

    def replicate(self, x: Tensor) -> Tensor:
        return x

    def unreplicate(self, x: Tensor) -> Tensor:
        return x

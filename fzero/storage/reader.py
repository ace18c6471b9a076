"""`UnitReader`: an offloaded buffer read unit by unit, ahead of its use (stage 3's compute shard on disk)."""

from __future__ import annotations

from concurrent.futures import Future

from torch import Tensor

from .store import Offloaded, Store

__all__ = ["UnitReader"]


class UnitReader:
    """Reads an offloaded buffer unit by unit, `depth` units ahead in the direction of travel (up the units in a
    forward, down in a backward), so that a unit's read overlaps the compute of the one before it. Each unit is a
    fresh buffer, dropped by whoever holds it: at most `depth + 1` units are held here.

    Args:
      x: the buffer (a stage-3 compute shard offloaded with `Offload(params="nvme")`).
      depth: units read ahead.
    """

    def __init__(self, x: Offloaded, depth: int = 1) -> None:
        self.x, self.depth = x, depth
        self._pending: dict[int, tuple[Tensor, list[Future]]] = {}
        self._last: int | None = None

    def _start(self, unit: int) -> None:
        if 0 <= unit < len(self.x.store.pieces) and unit not in self._pending:
            self._pending[unit] = self.x.store.read_unit(self.x, unit)

    def __call__(self, unit: int) -> Tensor:
        """Unit `unit`'s piece of every row (`[rows, n]`, or `[n]`), read."""
        step = -1 if self._last is not None and unit < self._last else 1
        self._last = unit
        self._start(unit)
        for k in range(1, self.depth + 1):
            self._start(unit + step * k)
        out, futures = self._pending.pop(unit)
        for fut in futures:
            fut.result()
        return out

    def close(self) -> None:
        """Wait for the reads still in flight (their buffers are dropped)."""
        pending, self._pending = self._pending, {}
        Store._drain({u: f for u, (_, f) in pending.items()}, {})

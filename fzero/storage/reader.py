"""`UnitReader`: an offloaded buffer read unit by unit, ahead of its use (stage 3's compute shard on disk)."""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor

from .store import Offloaded, Store

__all__ = ["UnitReader"]


def _to_device(x: Tensor, device: torch.device) -> Tensor:
    """`x`, a unit just read into host memory, copied to `device`. To a CUDA GPU through a pinned staging buffer,
    asynchronously on the current stream: the gather that reads the copy is queued after it on that stream (or, on
    NCCL's own, made to wait for it), and torch's pinned-memory cache keeps the staging buffer from reuse until the
    copy has run. (A copy from pageable memory would wait for every kernel queued so far.)"""
    if device.type != "cuda":
        return x.to(device)
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    staged.copy_(x)
    return staged.to(device, non_blocking=True)


class UnitReader:
    """Reads an offloaded buffer unit by unit, `depth` units ahead in the direction of travel (up the units in a
    forward, down in a backward), so that a unit's read overlaps the compute of the one before it. Each unit is a
    fresh buffer, dropped by whoever holds it: at most `depth + 1` units are held here.

    Args:
      x: the buffer (a stage-3 compute shard offloaded with `Offload(params="nvme")`).
      depth: units read ahead.
      device: where each unit is handed out, once read (the step's compute device); None or the CPU: the buffer
        read, as it is.
    """

    def __init__(self, x: Offloaded, depth: int = 1, device: torch.device | str | None = None) -> None:
        self.x, self.depth = x, depth
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)
        self._pending: dict[int, tuple[Tensor, list[Future]]] = {}
        self._last: int | None = None

    def _start(self, unit: int) -> None:
        if 0 <= unit < len(self.x.store.pieces) and unit not in self._pending:
            self._pending[unit] = self.x.store.read_unit(self.x, unit)

    def __call__(self, unit: int) -> Tensor:
        """Unit `unit`'s piece of every row (`[rows, n]`, or `[n]`), read (and put on `device`)."""
        step = -1 if self._last is not None and unit < self._last else 1
        self._last = unit
        self._start(unit)
        for k in range(1, self.depth + 1):
            self._start(unit + step * k)
        out, futures = self._pending.pop(unit)
        for fut in futures:
            fut.result()
        return out if self.device is None else _to_device(out, self.device)

    def close(self) -> None:
        """Wait for the reads still in flight (their buffers are dropped)."""
        pending, self._pending = self._pending, {}
        Store._drain({u: f for u, (_, f) in pending.items()}, {})

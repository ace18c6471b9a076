"""`UnitReader`: an offloaded buffer read unit by unit, ahead of its use (stage 3's compute shard on disk).

The memory a step's units pass through is handed back as the step goes: each unit is read into a buffer of its own
mapping (`Store.read_unit`), and every unit read counts its bytes towards a release of the C heap's free pages
(`fzero.host.heap.HeapRelease`). A step frees, per unit, blocks the size of the unit that are not this module's (the
gathered copy's collectives, its gradient and its reduction); glibc serves them from its heap once the first of them
is freed (its mapping threshold rises to that size), cannot put the next one of the same size in the hole a freed
one leaves (`fzero.host.heap`), and keeps each hole resident: the heap grew by a unit's size per unit through the
first steps (25.2M parameters on one rank: 417 MiB over the start at the steps' peak, for 160 MiB of live tensors;
`benchmarks/stage3_memory.py`). Released every unit or so, the holes' pages go back to the kernel and the resident
set follows what is live. A release walks the heap's free blocks (well under a millisecond a unit here).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import Tensor

from ..host.heap import EVERY, HeapRelease
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
        # a unit's worth of blocks freed per unit read (see the module docstring)
        self._heap = HeapRelease(every=max(EVERY, max(x.store.pieces, default=0) * x.dtype.itemsize))

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
        self._heap.freed(self.x.store.pieces[unit] * self.x.dtype.itemsize)
        return out if self.device is None else _to_device(out, self.device)

    def close(self) -> None:
        """Wait for the reads still in flight (their buffers are dropped)."""
        pending, self._pending = self._pending, {}
        Store._drain({u: f for u, (_, f) in pending.items()}, {})

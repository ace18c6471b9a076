"""`Speculation`: SuperOffload's speculation-then-validation for one step (`Offload(..., speculate=True)`).

DeepSpeed's SuperOffload (0.18, `offload_optimizer.super_offload`) takes the offloaded optimizer step off the
critical path: each unit's update runs as soon as the backward has reduced that unit's gradient, before the step's
global checks (an inf or nan anywhere, the clipping norm) are known, speculating that they will change nothing.
Here, for the step that ends an accumulation window:

1. **speculate**: the reduction calls `landed(unit, grads)` as each unit's reduced gradient is complete, and a
   worker thread runs that unit's update while the backward goes on (the native kernel and the file transfers
   release the GIL), into a *new* version of the optimizer's buffers: fresh host buffers (`"cpu"`), or the store's
   other slot (`"nvme"`). The step's input state is never written, so a rollback costs nothing.
2. **validate**: the chain then runs as always, and when it reaches the update, `take(flow, state)` checks that the
   speculation assumed what the chain computed: the same input state; the same gradients (the reduction's own
   buffer, unchanged since, or, at the end of an accumulation window, bitwise the same mean); the same factor
   (`1 / loss scale`: no clipping, the coefficient exactly 1); no step skipped; no unit's gradient changed after it
   landed (a second backward). The speculative version is then the update, bitwise what the plain update computes:
   the optimizer is elementwise and ran on the same values (`fzero.transforms.offload.RangeUpdate`).
3. **roll back** otherwise: the speculative version is dropped and the plain update runs (a clipped step, a
   skipped step, a second backward through the graph). The step's result is the same either way; a miss costs the
   speculative work, done while the backward ran.

Memory: the new version's buffers exist during the step beside the input's, as in any pure step (`"nvme"`: the
store's second slot, which every step uses anyway). Whether it pays: docs/offload.md, measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import optree
import torch
from torch import Tensor

from ..storage import Offloaded, Task
from .accumulate import window_mean
from .base import Flow
from .offload import COMPUTE, RangeUpdate, check_offloaded

__all__ = ["MemoryTarget", "Speculation", "StoreTarget", "Target", "Update"]

Prepare = Callable[[Tensor], Tensor]
"""A unit's reduced gradients to what the optimizer reads (the master dtype, times the factor where the optimizer
cannot fuse it): `shard_update`'s own preparation, elementwise."""


class Update(NamedTuple):
    """A speculative update, taken: the new master parameters and optimizer state (tensors, or handles to a new
    version on disk), the compute copy (on the gradients' device, or its handle), and the bytes the NVMe tier read
    and wrote per rank (None in memory)."""

    params: Any
    state: Any
    compute: Any
    io: dict[str, int] | None


class Target(Protocol):
    """Where a speculative update goes: `run` updates one unit (every row), `result` is the new version,
    `abandon` drops it."""

    def run(self, unit: int, grads: Tensor) -> None: ...

    def result(self) -> Update: ...

    def abandon(self) -> None: ...


class Speculation:
    """One step's speculative update (see the module docstring).

    Args:
      target: the new version's buffers and how to update one unit into them.
      params, state: the step's input master parameters and optimizer state (what `take` checks it is given).
      factor: the factor the gradients are assumed to owe (`1 / loss scale`).
      slices: each unit's slice of a row of the gradients as the update reads them.
      acc, k: at the end of an accumulation window of `k` micro-steps, the window's sum so far: the update then
        reads their mean (`fzero.accumulate`'s arithmetic, `window_mean`); None and 1 without accumulation.
    """

    def __init__(self, target: Target, params: Any, state: Any, factor: float, slices: Sequence[slice],
                 acc: Tensor | None = None, k: int = 1) -> None:  # fmt: skip
        self.target, self.params, self.state, self.factor = target, params, state, factor
        self.slices, self.acc, self.k = tuple(slices), acc, k
        self.mean = None if acc is None else torch.empty_like(acc)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fzero-speculate")
        self._futures: dict[int, Future] = {}
        self.source: Tensor | None = None  # the reduction's buffer the landed gradients are views of
        self.version: int | None = None  # its version counter once the backward is over (in-place changes show)
        self.dirty = False
        self.outcome: str | None = None  # "hit" or "miss" once decided

    @property
    def units(self) -> int:
        """The units updated during the backward."""
        return len(self._futures)

    def landed(self, unit: int, grads: Tensor, piece: int) -> None:
        """The reduction has folded piece `piece` of unit `unit`'s reduced gradients (`grads`, a view of its
        result buffer): speculate on the first; a later piece (a second backward) invalidates the speculation."""
        base = grads if grads._base is None else grads._base
        other = self.source is not None and self.source is not base
        if piece or unit in self._futures or self.outcome is not None or other:
            self.dirty = True
            return
        self.source = base
        self._futures[unit] = self._pool.submit(self._run, unit, grads)

    def _run(self, unit: int, grads: Tensor) -> None:
        if self.mean is not None and self.acc is not None:
            sl = self.slices[unit]
            grads = window_mean(self.acc[..., sl], grads, self.k, out=self.mean[..., sl])
        self.target.run(unit, grads)

    def drain(self) -> None:
        """Wait for the speculative work in flight (the backward is over); raise what it raised."""
        errors = []
        for fut in self._futures.values():
            try:
                fut.result()
            except BaseException as e:
                errors.append(e)
        if self.source is not None and self.version is None:
            self.version = self.source._version
        if errors:
            self.dirty = True
            raise errors[0]

    def take(self, flow: Flow, state: Any) -> Update | None:
        """The speculative update, if what it assumed holds for the update `flow` and `state` ask for; else None,
        the speculation rolled back (the caller runs the plain update)."""
        self.drain()
        grads = flow.gradients("shard_update")
        ok = (
            not self.dirty
            and flow.info.grad_factor == self.factor
            and flow.params is self.params
            and _same_tree(state, self.state)
        )
        if ok and self.mean is not None:  # the window's mean: the same values, unit by unit
            ok = all(torch.equal(grads[..., self.slices[u]], self.mean[..., self.slices[u]]) for u in self._futures)
        elif ok and self.source is not None:  # the reduction's buffer itself (or a view of all of it), unchanged
            src = self.source
            same = grads.data_ptr() == src.data_ptr() and grads.numel() == src.numel() and grads.dtype == src.dtype
            ok = same and grads._version == self.version
        if not ok:
            self.rollback()
            return None
        for unit in range(len(self.slices)):  # units no backward reached: their (zero) gradients, as the chain has them
            if unit not in self._futures:
                self.target.run(unit, grads[..., self.slices[unit]])
        self.outcome = "hit"
        return self.target.result()

    def rollback(self) -> None:
        """Drop the speculative version (the input state was never written)."""
        if self.outcome is None:
            self.outcome = "miss"
            self.target.abandon()

    def close(self) -> None:
        """End the speculation: wait for its work, roll it back unless taken, stop the worker."""
        try:
            self.drain()
        except BaseException:  # (raised by `drain` before the update; here only waited for)
            pass
        self.rollback()
        self._pool.shutdown(wait=True)


def _same_tree(a: Any, b: Any) -> bool:
    """Whether two states hold the very same leaves."""
    la, lb = optree.tree_leaves(a, namespace="fzero"), optree.tree_leaves(b, namespace="fzero")
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb, strict=True))


def _rows(grads: Tensor, task: Task) -> Tensor:
    """Task `task`'s gradients out of a unit's (`[rows, piece]` or `[piece]`)."""
    row = grads[task.row] if grads.ndim == 2 else grads
    return row[task.offset : task.offset + task.size]


class StoreTarget:
    """A new version of an NVMe-offloaded state, written unit by unit (`fzero.storage.Store.stream_units`) into the
    slot the input does not occupy."""

    def __init__(self, piece: RangeUpdate, prepare: Prepare, compute: Tensor | None) -> None:
        params = piece.handles["params"]
        assert isinstance(params, Offloaded)
        self.store, self.piece, self.prepare, self.compute = params.store, piece, prepare, compute
        self.device = torch.device("cpu")  # the gradients' (where the compute copy goes back to)
        check_offloaded(piece.handles, self.store)
        self.version, self.slot = self.store.begin(keep=params)
        self.crcs: dict[str, dict[int, Any]] = {n: {} for n in self.store.leaves}

    def run(self, unit: int, grads: Tensor) -> None:
        self.device = grads.device
        g = self.prepare(grads).cpu()
        got = self.store.stream_units(self.piece.handles, lambda t, v: self.piece(t, v, _rows(g, t)), [unit],
                                      self.version, self.slot)  # fmt: skip
        for n, by_task in got.items():
            self.crcs[n].update(by_task)

    def result(self) -> Update:
        written = self.store.finish(self.version, self.slot, self.crcs)
        io = {k: v // len(self.store.rows) for k, v in self.store.take_io().items()}
        compute = written[COMPUTE] if self.compute is None else self.compute.to(self.device)
        return Update(written["params"], self.piece.state_after(written), compute, io)

    def abandon(self) -> None:
        self.store.abandon(self.version, self.slot)


class MemoryTarget:
    """A new version of a state in host memory: fresh buffers, each unit's range copied from the input and updated
    in place."""

    def __init__(self, piece: RangeUpdate, prepare: Prepare, compute_dtype: torch.dtype,
                 slices: Sequence[slice]) -> None:  # fmt: skip
        self.piece, self.prepare, self.device = piece, prepare, torch.device("cpu")
        self.old = piece.handles
        self.new = {n: torch.empty_like(x) for n, x in self.old.items()}
        params = self.new["params"]
        # the master dtype: the copy is the new parameters themselves (as the plain update's `.to` returns them)
        same = compute_dtype == params.dtype
        self.compute = params if same else torch.empty(params.shape, dtype=compute_dtype)
        piece.compute = self.compute.view(-1)
        rows = self.old["params"].shape[0] if self.old["params"].ndim == 2 else 1
        self.tasks = [[Task(0, r, u, 0, sl.start, sl.stop) for r in range(rows)] for u, sl in enumerate(slices)]

    def run(self, unit: int, grads: Tensor) -> None:
        self.device = grads.device
        g = self.prepare(grads).cpu()
        for task in self.tasks[unit]:
            views = {}
            for n, x in self.new.items():
                dest = (x[task.row] if x.ndim == 2 else x)[task.start : task.stop]
                old = self.old[n]
                dest.copy_((old[task.row] if old.ndim == 2 else old)[task.start : task.stop])
                views[n] = dest
            self.piece(task, views, _rows(g, task))

    def result(self) -> Update:
        return Update(self.new["params"], self.piece.state_after(self.new), self.compute.to(self.device), None)

    def abandon(self) -> None:
        self.new = {}

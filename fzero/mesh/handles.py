"""Handles of collectives in flight: `wait()` gives the result; `is_completed()` says, without blocking, whether it
would block; `progress()` starts what a chain of collectives can start now."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from torch import Tensor

__all__ = ["AllOf", "Guarded", "Pending", "Ready", "ReduceOp", "Work", "completed", "done", "progress"]

ReduceOp = Literal["sum", "mean"]


class Work(Protocol):
    """A collective in flight: `wait()` blocks until its output is written."""

    def wait(self) -> object: ...


class _Done:
    """A collective that completed synchronously."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


done = _Done()


class Ready:
    """A result already computed, as a handle: `wait()` returns it (a `SimMesh`'s `*_start`)."""

    def __init__(self, value: Tensor) -> None:
        self.value = value

    def wait(self) -> Tensor:
        return self.value

    def is_completed(self) -> bool:
        return True


class Pending:
    """A reduction in flight: `wait()` waits for the exchange, then returns the finished result (`finish()`); the
    tensors the exchange reads and writes are held until then."""

    def __init__(self, work: Work, finish: Callable[[], Tensor], *hold: Tensor) -> None:
        self._work, self._finish, self._hold = work, finish, hold

    def wait(self) -> Tensor:
        self._work.wait()
        self._hold = ()
        return self._finish()

    def is_completed(self) -> bool:
        """Whether the exchange is over (`wait()` then only finishes the result); never blocks."""
        return completed(self._work)


def completed(work: Work) -> bool:
    """Whether `work` has completed, without blocking (False for a handle that cannot tell: only `wait()` will)."""
    is_completed = getattr(work, "is_completed", None)
    return is_completed is not None and bool(is_completed())


def progress(work: object) -> bool:
    """Advance a collective in flight without blocking: a handle of chained collectives (a hybrid reduction's
    reduce-scatter, then all-reduce: `fzero.transforms.collective._Chained`) starts its next one if the one before
    has completed. Whether it has nothing left to start (True for a handle of one collective, or a result)."""
    advance = getattr(work, "progress", None)
    return advance is None or bool(advance())


class AllOf:
    """Several collectives in flight as one handle: `wait()` waits for each."""

    def __init__(self, works: list[Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(completed(w) for w in self._works)


class Guarded:
    """An async collective's handle whose `wait()` raises `CollectiveError` instead of the backend's error."""

    def __init__(self, work: Work, fail: Callable[[BaseException], BaseException]) -> None:
        self._work, self._fail = work, fail

    def wait(self) -> object:
        try:
            return self._work.wait()
        except RuntimeError as e:
            raise self._fail(e) from e

    def is_completed(self) -> bool:
        # (a failed collective is completed too: its `wait()` raises the `CollectiveError`)
        return completed(self._work)

"""Who am I, how many are we, and the collectives, with a ledger of what they move.

(Over 500 lines: the two implementations of one protocol, `SimMesh` and `DistMesh`, sit side by side so that their
arithmetic, rank-ordered sums divided by `world`, reads the same: the suite holds them bitwise equal.)

Every collective fzero issues goes through a `Mesh`. Values are *per-rank*:

- on `DistMesh` a per-rank value is this process's tensor;
- on `SimMesh(world=W)` it is a tensor with a leading `[W, ...]` axis, row `r` being rank `r`'s value, so W ranks
  run exactly in one process. Reductions add the ranks' rows in rank order, so results are deterministic.

Collectives act on the last dimension, split into `world` equal chunks (the chunk `r` belongs to rank `r`):

=================  ==========================  =============================================
collective         per-rank input              per-rank output
=================  ==========================  =============================================
`all_reduce`       `[..., n]`                  `[..., n]`, the sum (or mean) over ranks
`reduce_scatter`   `[..., world * s]`          `[..., s]`, chunk `rank` of the sum (or mean)
`all_gather`       `[..., s]`                  `[..., world * s]`, every rank's chunk in rank order
`broadcast`        `[...]`                     `[...]`, rank `src`'s value
`local_shard`      `[..., world * s]`          `[..., s]`, chunk `rank` of the rank's own value
=================  ==========================  =============================================

`all_reduce_start` and `reduce_scatter_start` (over every rank, or a named `axis`) start the same reductions and
return a handle whose `wait()` gives the result and whose `is_completed()` says, without blocking, whether `wait()`
would: a `DistMesh`'s backend works on it meanwhile (stages reduce each unit's gradient this way while the backward
goes on; a hybrid reduction chains an axis's reduce-scatter and the other's all-reduce), a `SimMesh` has computed it
already.

A collective never writes the caller's tensor, except an all-reduce given `inplace=True` (the caller hands `x`
over, e.g. a gradient it has just cast: a `DistMesh` then reduces in it instead of in a copy; a `SimMesh` computes a
new tensor either way). A mean is the rank-ordered sum divided by `world` on every implementation, so `SimMesh` and
`DistMesh` agree bitwise wherever the backend's sum does (always for two ranks).

The ledger (`Mesh.record()`) counts, per collective, calls, the logical element count of the operation
(`elements`: the full buffer size for reduce-scatter and all-gather, twice it for an all-reduce: the ZeRO paper's
accounting) and the elements each rank sends and receives with a bandwidth-optimal ring algorithm
(`(world - 1) / world` of those).

**Named axes.** `SimMesh(shape={"replicate": R, "shard": S})` and `DistMesh(shape=...)` arrange `R * S` ranks
row-major on a grid (rank `i * S + j` sits at `replicate=i, shard=j`), and every collective takes the `axis` it
runs over: `reduce_scatter(x, "mean", axis="shard")` reduces within each group of ranks that differ only in their
`shard` coordinate (the group's ranks in coordinate order play the ranks of a 1-D mesh of size S, with the same
arithmetic, so results stay bitwise reproducible); `axis=None` (the default) runs over every rank, exactly as on a
1-D mesh. `size(axis)` is the group's size and `index(axis)` each rank's coordinate. The ledger records named-axis
collectives under `"{collective}:{axis}"` with the axis's own size in the ring factor, and, there only, `bytes`:
the payload per rank (elements times element size, of the full buffer), so `ledger.on("replicate")` shows what
crossed the slow axis (docs/hybrid.md).

A `DistMesh` collective that fails (it waited longer than the mesh's `timeout` for another rank, or a peer closed
its connection) raises `CollectiveError` on the ranks still running, naming this rank, the collective, its size,
the timeout and, where it can be told, the rank that stopped answering; an async handle's `wait()` does the same.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from ..host import accelerator, process_group

__all__ = ["AllOf", "CollectiveError", "DistMesh", "Ledger", "Mesh", "Pending", "Ready", "SimMesh", "Work", "done"]

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


@dataclass
class Ledger:
    """What the collectives moved while it was recording: `{collective: {calls, elements, sent, received}}`,
    element counts per rank."""

    world: int
    entries: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, kind: str, elements: int, moved: int, nbytes: int | None = None) -> None:
        entry = self.entries.get(kind)
        if entry is None:
            entry = self.entries[kind] = {"calls": 0, "elements": 0, "sent": 0, "received": 0}
            if nbytes is not None:
                entry["bytes"] = 0
        entry["calls"] += 1
        entry["elements"] += elements
        entry["sent"] += moved
        entry["received"] += moved
        if nbytes is not None:
            entry["bytes"] += nbytes

    def on(self, axis: str) -> dict[str, dict[str, int]]:
        """The collectives that ran over the named mesh axis `axis`: `{collective: counts}`."""
        suffix = f":{axis}"
        return {k.removesuffix(suffix): dict(v) for k, v in self.entries.items() if k.endswith(suffix)}

    def total(self, key: str = "elements") -> int:
        return sum(e[key] for e in self.entries.values())

    def crossing(self, shape: Mapping[str, int], inner: str) -> int:
        """Bytes one rank received from ranks outside its group along axis `inner` (of a mesh of this `shape` whose
        collectives recorded bytes: one with named axes): the slow links' share where a group is a node's ranks.

        Per collective over `n` ranks with payload `B` (the ledger's `bytes`), a rank receives `(n - 1) / n B`
        (twice for an all-reduce) from the others; of those, over every rank (`W`, `S` in the group), the
        `(W - S) / W B` from other groups; over another axis all of it (each peer is in another group); over
        `inner` none. (What a ring or tree sends over each link differs; the payload from outside does not.)
        """
        world, size = math.prod(shape.values()), shape[inner]
        out = 0
        for key, entry in self.entries.items():
            kind, _, axis = key.partition(":")
            if "bytes" not in entry or axis == inner:
                continue
            factor = 2 if kind == "all_reduce" else 1
            n = shape[axis] if axis else world
            outside = n - 1 if axis else world - size
            out += factor * entry["bytes"] * outside // n
        return out

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.entries.items()}


@runtime_checkable
class Mesh(Protocol):
    """The collectives of a group of data-parallel ranks (see the module docstring for shapes). A mesh with named
    axes also has `axes`, `size(axis)` and `index(axis)`; `axis=` is only ever passed to one (1-D meshes never see
    it)."""

    world: int
    # per-rank values carry a leading `[world, ...]` axis (all ranks in this process, `SimMesh`), or are this
    # process's own tensors (`DistMesh`): what a caller shapes batches, states and per-rank loops by
    stacked: bool

    @property
    def rank(self) -> int | Tensor: ...

    @property
    def axes(self) -> tuple[str, ...]: ...

    def size(self, axis: str | None = None) -> int: ...

    def index(self, axis: str | None = None) -> int | Tensor: ...

    def set_timeout(self, timeout: float | datetime.timedelta) -> None: ...

    def exchange(self, x: Tensor) -> Tensor: ...

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor: ...

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor: ...

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready | Pending: ...

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready | Pending: ...

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False) -> Work: ...

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor: ...

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def map(self, fn, *args): ...

    def replicate(self, x: Tensor) -> Tensor: ...

    def unreplicate(self, x: Tensor) -> Tensor: ...

    def record(self) -> contextlib.AbstractContextManager[Ledger]: ...


class _LedgerMixin:
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


class SimMesh(_LedgerMixin):
    """`world` ranks simulated in one process on a leading `[world, ...]` axis; deterministic.

    Args:
      world: number of simulated ranks (a 1-D mesh).
      shape: instead of `world`, named axes and their sizes, outermost first, e.g. `{"replicate": 2, "shard": 2}`:
        `world` is their product and rank `r` sits at the row-major coordinates of `r` (see the module docstring).

    Example:
      >>> import torch
      >>> mesh = SimMesh(world=2)
      >>> mesh.reduce_scatter(torch.tensor([[1., 2.], [10., 20.]]))
      tensor([[11.],
              [22.]])
      >>> grid = SimMesh(shape={"replicate": 2, "shard": 2})
      >>> grid.all_reduce(torch.tensor([[1.], [2.], [3.], [4.]]), axis="replicate").flatten()  # ranks 0+2, 1+3
      tensor([4., 6., 4., 6.])
    """

    def __init__(self, world: int | None = None, *, shape: Mapping[str, int] | None = None) -> None:
        if shape is not None:
            self.shape = _shape(shape, "SimMesh(shape=...)")
            n = math.prod(self.shape.values())
            if world is not None and world != n:
                raise ValueError(f"SimMesh: world={world!r} but shape {self.shape} has {n} ranks; give one of them")
            world = n
        else:
            self.shape = {}
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"SimMesh(world=...) needs an int >= 1, got {world!r}")
        self.world = world
        self.stacked = True
        self._ledgers: list[Ledger] = []
        # one 1-D mesh per axis does each group's arithmetic: the same code, so the same bits, as SimMesh(size)
        self._sub = {name: SimMesh(n) for name, n in self.shape.items()}

    def __repr__(self) -> str:
        if self.shape:
            return f"SimMesh(shape={self.shape})"
        return f"SimMesh(world={self.world})"

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Nothing to do: the simulated ranks run in one process and cannot wait for one another."""

    def exchange(self, x: Tensor) -> Tensor:
        """Every rank's `x` (`[world, ...]`), as `DistMesh.exchange` gives each rank: here, `x` itself."""
        return x

    @property
    def rank(self) -> Tensor:
        """Each simulated rank's index, on the world axis."""
        return torch.arange(self.world)

    def index(self, axis: str | None = None) -> Tensor:
        """Each simulated rank's coordinate along `axis` (its rank for None), on the world axis."""
        if axis is None:
            return self.rank
        n = self.size(axis)
        inner = math.prod(list(self.shape.values())[list(self.shape).index(axis) + 1 :])
        return torch.arange(self.world) // inner % n

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s group along `axis`, in coordinate order."""
        n = self.size(axis)
        inner = math.prod(list(self.shape.values())[list(self.shape).index(axis) + 1 :])
        base = rank - (rank // inner % n) * inner
        return [base + k * inner for k in range(n)]

    def _grouped(self, x: Tensor, axis: str, fn: Callable[[SimMesh, Tensor], Tensor]) -> Tensor:
        """`fn(sub, y)` on `y = [n, groups, ...]`: the `n` ranks of each group along `axis` in coordinate order (a
        1-D mesh `sub` of size n acting on every group at once), its result moved back to the world axis."""
        self.size(axis)  # an unknown axis: say which exist
        sizes = list(self.shape.values())
        k = list(self.shape).index(axis)
        grid = x.reshape(*sizes, *x.shape[1:]).movedim(k, 0)  # [n, other axes..., ...]
        others = grid.shape[1 : len(sizes)]
        y = grid.reshape(sizes[k], math.prod(others), *x.shape[1:])
        out = fn(self._sub[axis], y)  # [n, groups, ...]
        out = out.reshape(sizes[k], *others, *out.shape[2:]).movedim(0, k)
        return out.reshape(self.world, *out.shape[len(sizes) :])

    def _rows(self, x: Tensor, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != self.world:
            raise ValueError(
                f"{what}: {self!r} expects a leading world axis of size {self.world}, got shape {tuple(x.shape)}"
            )

    def _sum(self, x: Tensor) -> Tensor:
        total = x[0]
        for r in range(1, self.world):  # rank order, as the docstring promises
            total = total + x[r]
        return total

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor:
        if axis is not None:
            self._rows(x, "all_reduce")
            self._log("all_reduce", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.all_reduce(y, op))
        self._rows(x, "all_reduce")
        self._log("all_reduce", x[0].numel(), None, x.element_size())
        if self.world == 1:
            return _finish(x, op, 1)
        return _finish(self._sum(x), op, self.world).expand_as(x)

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor:
        # (`out`: a DistMesh's; simulated ranks' results are stacked, so they keep buffers of their own)
        if axis is not None:
            self._rows(x, "reduce_scatter")
            _check_chunks(x, self.size(axis), "reduce_scatter")
            self._log("reduce_scatter", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.reduce_scatter(y, op))
        self._rows(x, "reduce_scatter")
        _check_chunks(x, self.world, "reduce_scatter")
        self._log("reduce_scatter", x[0].numel(), None, x.element_size())
        if self.world == 1:
            return _finish(x, op, 1)
        total = _finish(self._sum(x), op, self.world)  # [..., world * s]
        return total.unflatten(-1, (self.world, -1)).movedim(-2, 0).contiguous()

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready:
        """`all_reduce` (over `axis`), as a handle (simulated ranks reduce at once)."""
        return Ready(self.all_reduce(x, op, axis=axis))

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready:
        """`reduce_scatter` (over `axis`), as a handle (simulated ranks reduce at once)."""
        return Ready(self.reduce_scatter(x, op, axis=axis))

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "all_gather")
            self._log("all_gather", x[0].numel() * self.size(axis), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.all_gather(y))
        self._rows(x, "all_gather")
        self._log("all_gather", x.numel(), None, x.element_size())
        full = x.movedim(0, -2).flatten(-2)
        return full.expand(self.world, *full.shape).contiguous()

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor:
        """Each rank's `[..., n * s]` split into `n` chunks, chunk `k` sent to the group's rank `k`: per rank, the
        `[n, ..., s]` chunks received, row `k` from the group's rank `k` (no arithmetic)."""
        self._rows(x, "all_to_all")
        n = self.size(axis)
        _check_chunks(x, n, "all_to_all")  # (SimMesh.all_to_all)
        self._log("all_to_all", x[0].numel(), axis, x.element_size())
        if axis is not None:
            return self._grouped(x, axis, lambda m, y: m._exchange(y).movedim(1, 2))  # [to, groups, from, ...]
        return self._exchange(x)

    def _exchange(self, x: Tensor) -> Tensor:
        chunks = x.unflatten(-1, (self.world, -1))  # [world (from), ..., world (to), s]
        return chunks.movedim(-2, 0).contiguous()  # [to, from, ..., s]

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False) -> Work:
        """Write the all-gather of `x` (`[world, s]`, every rank's chunk) into `out` (`[world * s]`, the value every
        rank receives); synchronous, the returned handle is already complete."""
        self._rows(x, "all_gather_into")
        self._log("all_gather", x.numel(), None, x.element_size())
        out.copy_(x.reshape(-1))
        return done

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "broadcast")
            self._log("broadcast", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.broadcast(y, src))
        self._rows(x, "broadcast")
        self._log("broadcast", x[0].numel(), None, x.element_size())
        return x[src].expand_as(x).contiguous()

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "local_shard")
            _check_chunks(x, self.size(axis), "local_shard")
            return self._grouped(x, axis, lambda m, y: m.local_shard(y))
        self._rows(x, "local_shard")
        _check_chunks(x, self.world, "local_shard")
        chunks = x.unflatten(-1, (self.world, -1))  # [world, ..., world, s]
        return torch.stack([chunks[r, ..., r, :] for r in range(self.world)]).contiguous()

    def replicate(self, x: Tensor) -> Tensor:
        """The per-rank value whose every rank holds `x` (no communication)."""
        return x.expand(self.world, *x.shape).contiguous()

    def unreplicate(self, x: Tensor) -> Tensor:
        """Rank 0's value of a per-rank value that every rank holds alike (after an all-reduce, say)."""
        return x[0]

    def map(self, fn, *args):
        """Run `fn` on each rank's slice of `args` (pytrees whose leaves have the world axis), in rank order, and
        stack the results. A Python loop rather than `vmap`, so each rank runs exactly the kernels a real
        process would and the results are bitwise those of `DistMesh`."""
        import optree

        outs = [fn(*optree.tree_map(lambda a, r=r: a[r], args, none_is_leaf=False)) for r in range(self.world)]
        if self.world == 1:
            return optree.tree_map(lambda x: x.unsqueeze(0), outs[0])
        return optree.tree_map(lambda *xs: torch.stack(xs), *outs)


class CollectiveError(RuntimeError):
    """A collective of a `DistMesh` failed on this rank: it waited longer than the timeout for another rank, or a
    peer closed its connection, or the backend refused it.

    Attributes:
      rank, world: this rank and the group's size.
      collective: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"`` or ``"broadcast"``.
      elements, dtype: the size and dtype of this rank's input.
      timeout: the timeout in seconds (from the backend's message, else the mesh's), None if unknown.
      timed_out: whether the backend reported a timeout.
      peer: the rank that stopped answering or closed its connection, None when the backend does not tell (gloo
        names no rank: it is told in a group of two, where only one other rank exists).
      backend_message: the backend's own message.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world: int,
        collective: str,
        elements: int,
        dtype: str,
        timeout: float | None,
        timed_out: bool,
        peer: int | None,
        backend_message: str,
    ) -> None:
        super().__init__(message)
        self.rank, self.world, self.collective, self.elements, self.dtype = rank, world, collective, elements, dtype
        self.timeout, self.timed_out, self.peer, self.backend_message = timeout, timed_out, peer, backend_message


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_TIMEOUT_MS = re.compile(r"Timed out waiting (\d+)\s*ms|Timeout\(ms\)=(\d+)")
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused", re.IGNORECASE)
_SOURCE = re.compile(r"^\s*\[[^\]]*\.(cc|cpp|h):\d+\]\s*")  # gloo's "[.../unbound_buffer.cc:78] " prefix
_HINT = (
    "Every rank must issue the same collectives in the same order: a rank that hangs, stops, crashes or skips one "
    "leaves the others waiting. Set the limit with DistMesh(timeout=SECONDS), the config's comms_config.timeout, or "
    "fzero train --timeout."
)


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    return None if timeout is None else timeout.total_seconds()


def collective_error(
    err: BaseException, *, rank: int, world: int, collective: str, x: Tensor, timeout: float | None
) -> CollectiveError:
    """The `CollectiveError` for a backend's exception `err` raised by `collective` on tensor `x` (see the class)."""
    backend = _SOURCE.sub("", str(err)).strip()
    timed_out = bool(_TIMED_OUT.search(backend))
    m = _TIMEOUT_MS.search(backend)
    if m:
        timeout = int(m.group(1) or m.group(2)) / 1000
    gone = bool(_PEER_GONE.search(backend))
    peer = 1 - rank if world == 2 and (timed_out or gone) else None
    what = f"{collective} of {x.numel()} {str(x.dtype).removeprefix('torch.')} elements"
    limit = "" if timeout is None else f" after {timeout:g} s"
    if timed_out:
        head = f"rank {rank} of {world} timed out{limit} in {what}"
    else:
        head = f"rank {rank} of {world} failed in {what}"
    if peer is not None:
        how = "stopped answering" if timed_out else "closed its connection (it crashed or was killed)"
        who = f": rank {peer} {how} (the only other rank of the group)"
    elif timed_out or gone:
        how = "stopped answering" if timed_out else "closed its connection"
        who = f": the backend does not say which of the other {world - 1} ranks {how}"
    else:
        who = ""
    message = f"{head}{who}. {_HINT} Backend: {backend}"
    return CollectiveError(
        message, rank=rank, world=world, collective=collective, elements=x.numel(),
        dtype=str(x.dtype).removeprefix("torch."), timeout=timeout, timed_out=timed_out, peer=peer,
        backend_message=backend,
    )  # fmt: skip


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


class _Guarded:
    """An async collective's handle whose `wait()` raises `CollectiveError` instead of the backend's error."""

    def __init__(self, work: Work, fail: Callable[[BaseException], CollectiveError]) -> None:
        self._work, self._fail = work, fail

    def wait(self) -> object:
        try:
            return self._work.wait()
        except RuntimeError as e:
            raise self._fail(e) from e

    def is_completed(self) -> bool:
        # (a failed collective is completed too: its `wait()` raises the `CollectiveError`)
        return completed(self._work)


class DistMesh(_LedgerMixin):
    """The ranks of a `torch.distributed` process group (gloo on CPU, NCCL on GPU).

    Args:
      group: the process group; default the world group. If `torch.distributed` is not initialised yet, it is,
        from the `torchrun` environment variables, with `backend` (default: NCCL where CUDA sees a GPU, else gloo;
        `DS_ACCELERATOR=cpu` forces gloo: `fzero.host.accelerator`) and `timeout`; the group is then shut down before
        the interpreter exits (`fzero.host.process_group`). Over NCCL, a host tensor handed to a collective is copied to
        the current GPU (`torch.cuda.set_device`) and the result back.
      backend: the backend for that initialisation.
      timeout: seconds (or a `datetime.timedelta`) a collective may wait for the other ranks before it fails with
        `CollectiveError`; set on the group, so it applies to everything that uses the group. Default: the
        group's own (torch's default is 30 minutes for gloo).
      shape: named axes and their sizes, outermost first (e.g. `{"replicate": 2, "shard": 2}`), whose product is
        the group's size: every rank makes one sub-group per line of the grid (`torch.distributed.new_group`, a
        collective: call it on every rank alike), and collectives with `axis=` run on this rank's sub-group.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        backend: str | None = None,
        timeout: float | datetime.timedelta | None = None,
        *,
        shape: Mapping[str, int] | None = None,
    ) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        delta = None if timeout is None else process_group.as_timedelta(timeout, "DistMesh(timeout=...)")
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "DistMesh() needs an initialised process group or the torchrun environment "
                    "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); start the script with torchrun, "
                    "or use SimMesh(world=...) in a single process"
                )
            process_group.init_process_group(backend or accelerator.backend(), timeout=delta)
        elif delta is not None:
            process_group.set_timeout(delta, group)
        process_group.shutdown_at_exit()
        self.group = group
        self.stacked = False
        self.world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._timeout = delta
        self._ledgers: list[Ledger] = []
        # gloo's reduce-scatter runs 1.4-2.8x slower than an all-to-all of the chunks summed here (summing in rank order
        # also makes the result SimMesh's, bitwise, at any world size), and its all-gather 1.6-6x slower than one
        # broadcast per rank (benchmarks/collectives.py): on gloo the mesh runs those exchanges instead
        used = dist.get_backend(group)
        self._exchange = used == "gloo"
        # NCCL moves GPU memory only: a host tensor handed to a collective (a seed, an agreement message, an
        # offloaded shard) is staged through the current GPU (`_to_comm`) and the result copied back
        self._nccl = used == "nccl"
        self._global = [dist.get_global_rank(group, r) if group else r for r in range(self.world)]
        self.shape = {} if shape is None else _shape(shape, "DistMesh(shape=...)")
        self._sub: dict[str, DistMesh] = {}
        if self.shape:
            if math.prod(self.shape.values()) != self.world:
                raise ValueError(f"DistMesh(shape={self.shape}) has {math.prod(self.shape.values())} ranks, but the "
                                 f"process group has {self.world}")  # fmt: skip
            self._sub = self._subgroups(delta)

    def _subgroups(self, timeout: datetime.timedelta | None) -> dict[str, DistMesh]:
        """This rank's sub-mesh along every axis; every rank creates every group, in the same order, as
        `new_group` requires."""
        grid = torch.arange(self.world).reshape(*self.shape.values())
        subs = {}
        for k, name in enumerate(self.shape):
            lines = grid.movedim(k, -1).reshape(-1, self.shape[name])
            for line in lines.tolist():
                g = dist.new_group([self._global[r] for r in line], timeout=timeout)
                if self._rank in line:
                    subs[name] = DistMesh(g)
        return subs

    def _axis(self, axis: str) -> DistMesh:
        sub = self._sub.get(axis)
        if sub is None:
            self.size(axis)  # raises, naming the axes
            raise AssertionError(axis)  # (unreachable: size raised)
        return sub

    def index(self, axis: str | None = None) -> int:
        """This rank's coordinate along `axis` (its rank for None)."""
        return self._rank if axis is None else self._axis(axis).rank

    @property
    def timeout(self) -> float | None:
        """The collectives' timeout in seconds, if this mesh set one."""
        return _seconds(self._timeout)

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Set the timeout (seconds or a `timedelta`) of every later collective of the mesh's group."""
        self._timeout = process_group.set_timeout(timeout, self.group)
        for sub in self._sub.values():
            sub.set_timeout(timeout)

    def _error(self, collective: str, x: Tensor, err: BaseException) -> CollectiveError:
        return collective_error(
            err, rank=self._rank, world=self.world, collective=collective, x=x, timeout=self.timeout
        )

    def _to_comm(self, x: Tensor) -> Tensor:
        """`x` where the backend can read it: `x` itself, or for NCCL a host tensor's contiguous copy on the current
        GPU (the one the caller's `torch.cuda.set_device` chose when the collective runs)."""
        if not self._nccl or x.device.type != "cpu":
            return x
        return torch.empty(x.shape, dtype=x.dtype, device=torch.device("cuda", torch.cuda.current_device())).copy_(x)

    def _run(self, collective: str, x: Tensor, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise self._error(collective, x, e) from e

    def __repr__(self) -> str:
        grid = f"shape={self.shape}, " if self.shape else ""
        return f"DistMesh({grid}world={self.world}, rank={self._rank}, backend={dist.get_backend(self.group)})"

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor:
        return self.all_reduce_start(x, op, axis, inplace).wait()

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor:
        return self.reduce_scatter_start(x, op, axis, out).wait()

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready | Pending:
        """Start `all_reduce` (over `axis`: on this rank's group along it): the handle's `wait()` returns the
        result (the backend works meanwhile); `inplace`: reduce in `x` itself (the caller hands it over), not in a
        copy."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_reduce", x.numel(), axis, x.element_size())
            return sub.all_reduce_start(x, op, inplace=inplace)
        self._log("all_reduce", x.numel(), None, x.element_size())
        if self.world == 1:
            return Ready(_finish(x, op, 1))
        out = self._to_comm(x)
        if out is x:  # the backend reduces in place: never in the caller's own buffer unless handed over
            out = x if inplace and x.is_contiguous() else x.clone()
        work = self._run("all_reduce", x, dist.all_reduce, out, dist.ReduceOp.SUM, group=self.group, async_op=True)

        def finish() -> Tensor:
            total = _finish(out, op, self.world)
            if total.device == x.device:
                return total
            return x.copy_(total) if inplace else total.to(x.device)

        return Pending(self._guard(work, "all_reduce", x), finish, out)

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready | Pending:
        """Start `reduce_scatter` (over `axis`: on this rank's group along it): the handle's `wait()` returns the
        result (the backend works meanwhile); `out`: a contiguous buffer of the result's shape and dtype to put it
        in (the result is then `out` unless the group has one rank, bitwise what it would be in its own buffer)."""
        if axis is not None:
            sub = self._axis(axis)
            _check_chunks(x, sub.world, "reduce_scatter")
            self._log("reduce_scatter", x.numel(), axis, x.element_size())
            return sub.reduce_scatter_start(x, op, out=out)
        s = _check_chunks(x, self.world, "reduce_scatter")
        self._log("reduce_scatter", x.numel(), None, x.element_size())
        if self.world == 1:
            return Ready(_finish(x, op, 1))
        chunks = x.unflatten(-1, (self.world, s)).movedim(-2, 0).contiguous()  # [world, ..., s]
        if out is not None and (out.shape != chunks.shape[1:] or out.dtype != x.dtype or not out.is_contiguous()):
            raise ValueError(f"reduce_scatter: out= must be a contiguous {x.dtype} buffer of shape "
                             f"{tuple(chunks.shape[1:])}, got {out.dtype} {tuple(out.shape)}")  # fmt: skip
        if self._exchange:
            # the first and the last rank send and receive only the others' chunks, one contiguous run of them: gloo's
            # all-to-all copied a rank's own chunk to itself first (on 2 ranks both are: the exchange 1.24-1.37x faster)
            lo, hi = int(self._rank == 0), self.world - int(self._rank == self.world - 1)
            received = chunks.new_empty(hi - lo, *chunks.shape[1:])  # received[r - lo]: rank r's chunk of this part
            sizes = [chunks[0].numel() if lo <= r < hi else 0 for r in range(self.world)]
            work = self._run("reduce_scatter", x, dist.all_to_all_single, received.view(-1), chunks[lo:hi].view(-1),
                             sizes, sizes, group=self.group, async_op=True)  # fmt: skip
            rows = [chunks[r] if r == self._rank else received[r - lo] for r in range(self.world)]

            def finish() -> Tensor:
                # rank order, as SimMesh sums: the same value, bitwise, at any world
                total = torch.add(rows[0], rows[1], out=out)
                for r in range(2, self.world):
                    total.add_(rows[r])
                return _finish(total, op, self.world)

            return Pending(self._guard(work, "reduce_scatter", x), finish, chunks, received)
        given, chunks = out, self._to_comm(chunks)
        if out is None or out.device != chunks.device:
            out = torch.empty_like(chunks[0])
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = self._run("reduce_scatter", x, fn, out.view(-1), chunks.view(-1), op=dist.ReduceOp.SUM,
                         group=self.group, async_op=True)  # fmt: skip

        def finish_into() -> Tensor:
            total = _finish(out, op, self.world)
            if given is not None and given is not out:  # staged: the caller's buffer gets the result
                return given.copy_(total)
            return total.to(x.device)  # (itself unless staged)

        return Pending(self._guard(work, "reduce_scatter", x), finish_into, chunks, out)

    def _guard(self, work: object, collective: str, x: Tensor) -> _Guarded:
        # `work` is what torch.distributed returns for async_op=True: a Work (typed Optional there)
        return _Guarded(cast(Work, work), lambda e: self._error(collective, x, e))

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_gather", x.numel() * sub.world, axis, x.element_size())
            return sub.all_gather(x)
        src = x.contiguous()
        out = torch.empty(self.world * src.numel(), dtype=src.dtype, device=src.device)
        self.all_gather_into(out, src.reshape(-1))
        return out.view(self.world, *src.shape).movedim(0, -2).flatten(-2)

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor:
        """`x`'s last dimension split into `n` chunks (n: the group's size), chunk `k` sent to the group's rank
        `k`: the `[n, ..., s]` chunks received, row `k` from the group's rank `k`."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_to_all", x.numel(), axis, x.element_size())
            return sub.all_to_all(x)
        s = _check_chunks(x, self.world, "all_to_all")
        self._log("all_to_all", x.numel(), None, x.element_size())
        chunks = x.unflatten(-1, (self.world, s)).movedim(-2, 0).contiguous()  # [world, ..., s]
        if self.world == 1:
            return chunks
        chunks = self._to_comm(chunks)
        received = torch.empty_like(chunks)
        self._run("all_to_all", x, dist.all_to_all_single, received.view(-1), chunks.view(-1), group=self.group)
        return received.to(x.device)

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False, axis: str | None = None) -> Work:
        """All-gather the 1-D `x` into the preallocated 1-D `out` (`world * x.numel()` elements), in place; with
        `async_op` the returned handle must be waited on before `out` is read."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_gather", x.numel() * sub.world, axis, x.element_size())
            return sub.all_gather_into(out, x, async_op)
        self._log("all_gather", x.numel() * self.world, None, x.element_size())
        if self.world == 1:
            out.copy_(x)
            return done
        x, given = self._to_comm(x.contiguous()), out
        if out.device != x.device:
            out = torch.empty(out.shape, dtype=out.dtype, device=x.device)
        if self._exchange:  # each rank broadcasts its chunk straight into the others' `out`
            chunks = out.view(self.world, -1)
            works = [
                self._run("all_gather", x, dist.broadcast, x if r == self._rank else chunks[r],
                          src=self._global[r], group=self.group, async_op=True)
                for r in range(self.world)
            ]  # fmt: skip
            chunks[self._rank].copy_(x)
            work: Work = AllOf(cast(list[Work], works))
        else:
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = cast(Work, self._run("all_gather", x, fn, out, x, group=self.group, async_op=True))
        guarded: Work = self._guard(work, "all_gather", x)
        if out is not given:
            guarded = Pending(guarded, lambda: given.copy_(out), out)
        if not async_op:
            guarded.wait()
            return done
        return guarded

    def exchange(self, x: Tensor) -> Tensor:
        """Every rank's 1-D `x` (`[world, n]`): a control message (`fzero.mesh.agreement`), not in the ledger."""
        src = self._to_comm(x.contiguous())
        out = torch.empty(self.world * x.numel(), dtype=x.dtype, device=src.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run("exchange", x, fn, out, src, group=self.group)
        return out.view(self.world, -1).to(x.device)

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor:
        """Rank `src`'s `x` (for a named `axis`: the group's rank `src`, by coordinate)."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("broadcast", x.numel(), axis, x.element_size())
            return sub.broadcast(x, src)
        self._log("broadcast", x.numel(), None, x.element_size())
        out = self._to_comm(x)
        out = x.clone() if out is x else out
        root = dist.get_global_rank(self.group, src) if self.group else src
        self._run("broadcast", x, dist.broadcast, out, src=root, group=self.group)
        return out.to(x.device)

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            return self._axis(axis).local_shard(x)
        s = _check_chunks(x, self.world, "local_shard")
        return x[..., self._rank * s : (self._rank + 1) * s].clone()

    def replicate(self, x: Tensor) -> Tensor:
        return x

    def unreplicate(self, x: Tensor) -> Tensor:
        return x

    def map(self, fn, *args):
        return fn(*args)

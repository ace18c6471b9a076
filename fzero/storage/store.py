"""`Store` and `Offloaded`: flat per-rank buffers kept on disk, as versioned, immutable leaves of a state.

A `Store` holds a family of buffers that are updated together (a `shard_update`'s master parameters and its
optimizer's per-element state: the *leaves*), for one or more ranks' rows (a `SimMesh` holds every rank's; a
`DistMesh` process its own). Each row is cut into the layout's units, and each (row, unit) has its own swap file
(`SwapFile`) with two slots per leaf. An `Offloaded` is one leaf at one *version*: which slot holds it and the
checksums of its blocks. A new version is always written to the slot the input does not occupy, so the state a
step started from stays readable while the step writes its successor (a pure step; a speculative step rolled
back). A version that a later write has overwritten cannot be read: `StaleStateError`, never silent garbage.

Every transfer goes through staging buffers: `buffers` sets of one chunk per leaf (`chunk` elements, a multiple of
4096 so that every chunk starts on an aligned file offset). `stream` runs the three-stage pipeline over the rows'
chunks: while chunk i is computed, chunk i+1 is read and chunk i-1 written. So the memory the store holds while a
transfer runs is, by construction,

    buffers x chunk x (sum of the leaves' element sizes)        (+ the I/O threads' stacks)

whatever the size of the model, and "out of buffers" cannot happen: a read waits for its set's previous write. The
sets are mapped when a transfer starts and unmapped when it ends (`mapped_empty`): between updates the store holds
none, so the forward's and the backward's units do not sit beside them, and they are never blocks of the C heap,
which would keep them resident once freed. (Mapping them costs a page fault per 4 KiB page each update: 16,384
for the default sets' 64 MiB, small beside the update's I/O.) A unit read for the gathering (`read_unit`) goes into
a mapping of its own too, reused within the step (`fzero.host.scratch`'s passing buffers).

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = Store(root, {"w": torch.float32}, rows=(0,), pieces=(5000, 3000), chunk=4096)
    ...     x = store.write({"w": torch.arange(8000.0)})["w"]
    ...     y = store.stream({"w": x}, lambda task, views: views["w"].mul_(2))["w"]
    ...     bool(torch.equal(y.read(), 2 * torch.arange(8000.0))), bool(torch.equal(x.read(), torch.arange(8000.0)))
    ...     store.close()
    (True, True)
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..host import scratch
from .aligned import ALIGN, mapped_empty
from .errors import StorageError
from .pool import IOPool
from .scratch import ScratchDir
from .swapfile import Region, SwapFile

__all__ = ["Offloaded", "StaleStateError", "Store", "Task", "in_memory"]


class StaleStateError(StorageError):
    """An offloaded leaf's version was overwritten by a later write (a store keeps two versions per leaf)."""


@dataclass(frozen=True)
class Task:
    """One chunk of the pipeline: elements `[start, stop)` of row `row` (its position in the store's rows), which
    are elements `[offset, offset + stop - start)` of unit `unit`'s piece of that row."""

    index: int
    row: int
    unit: int
    offset: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class Offloaded:
    """One leaf of a `Store` at one version: an immutable handle, the leaf a state holds where the buffer is on
    disk. Shaped like the in-memory buffer it stands for (`[n]`, or `[rows, n]` on a `SimMesh`).

    Attributes:
      store: the store whose files hold it.
      name: the leaf's name in the store.
      version: the write that made it (unique within the store).
      slot: the file slot it occupies (0 or 1).
      crcs: per task, the crc32 of each block of its bytes.
    """

    store: Store
    name: str
    version: int
    slot: int
    crcs: tuple[tuple[int, ...], ...] = field(repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.store.leaves[self.name]

    @property
    def shape(self) -> torch.Size:
        n = sum(self.store.pieces)
        return torch.Size((len(self.store.rows), n) if self.store.stacked else (n,))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def read(self, row: int | None = None) -> Tensor:
        """The leaf's values in memory (a new tensor): all of it, or the row at position `row` (`[n]`)."""
        return self.store.read(self, row)

    def __repr__(self) -> str:
        return f"Offloaded({self.name!r}, {self.dtype}, {tuple(self.shape)}, version={self.version}, {self.store!r})"


def in_memory(x: Any) -> Any:
    """`x` itself, or the values of an `Offloaded` read into memory (for what needs them all: a consolidated
    `state_dict`, a full buffer's checksum)."""
    return x.read() if isinstance(x, Offloaded) else x


_BYTES = torch.empty(0, dtype=torch.uint8)


def _read_buffer(nbytes: int) -> Tensor:
    """A buffer of `nbytes` (a multiple of `ALIGN`) for one unit's read: a mapping of its own, reused within the
    step once nothing holds it (`fzero.host.scratch`'s passing buffers; the NVMe update lets them go), never a
    block of the C heap, which would keep it resident once freed (`fzero.storage.reader`)."""
    out = scratch.new_empty("unit read", _BYTES, (nbytes,), passing=True)
    return out if out.data_ptr() % ALIGN == 0 else mapped_empty(nbytes)  # (reuse off: a fresh mapping)


class Store:
    """Swap files for the leaves `leaves` of the rows `rows`, each row cut into `pieces` (see the module docstring).

    Args:
      root: the directory the run's scratch directory is made in (it must exist).
      leaves: each leaf's name and dtype.
      rows: the ranks whose rows the store holds (their numbers name the files).
      pieces: each unit's element count in a row.
      stacked: leaves are `[rows, n]` (a `SimMesh`), else `[n]` (one row).
      chunk: elements per pipeline stage, a positive multiple of 4096.
      buffers: staging sets (at least 3: one read ahead, one computed, one written behind).
      threads: I/O threads.
      block_size: bytes per I/O request and per checksum.
      direct: O_DIRECT (None: where the filesystem supports it).
    """

    def __init__(
        self,
        root: Any,
        leaves: Mapping[str, torch.dtype],
        rows: Sequence[int],
        pieces: Sequence[int],
        *,
        stacked: bool = False,
        chunk: int = 1 << 20,
        buffers: int = 4,
        threads: int = 1,
        block_size: int = 1 << 20,
        direct: bool | None = None,
    ) -> None:
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"Store: chunk must be a positive multiple of {ALIGN} elements, got {chunk}")
        if buffers < 3:
            raise ValueError(f"Store: buffers must be at least 3 (read ahead, compute, write behind), got {buffers}")
        if not stacked and len(rows) != 1:
            raise ValueError(f"Store: an unstacked store holds one row, got rows {tuple(rows)}")
        self.leaves, self.rows, self.pieces = dict(leaves), tuple(rows), tuple(pieces)
        # no chunk larger than the largest piece: the staging buffers of a small shard stay small
        chunk = min(chunk, max(ALIGN, -(-max(self.pieces, default=0) // ALIGN) * ALIGN))
        self.stacked, self.chunk = stacked, chunk
        self.scratch = ScratchDir(root)
        self.pool = IOPool(threads, block_size)
        self.files: dict[tuple[int, int], SwapFile] = {}
        self._versions = itertools.count()
        self._slots: list[int | None] = [None, None]  # the version each slot holds
        self._lock = threading.Lock()
        self._streaming = threading.Lock()  # one stream at a time: they share the staging buffers
        self.bytes_read = self.bytes_written = 0
        try:
            for r, rank in enumerate(self.rows):
                for u, n in enumerate(self.pieces):
                    regions = [Region(f"{name}.{s}", dtype, n) for name, dtype in self.leaves.items() for s in (0, 1)]
                    self.files[r, u] = SwapFile(self.scratch.file(f"rank{rank}-unit{u}.swap"), regions, direct=direct)
            self.tasks = self._plan()
            self.buffers = buffers
        except BaseException:
            self.close()
            raise

    def _plan(self) -> tuple[Task, ...]:
        tasks: list[Task] = []
        for r in range(len(self.rows)):
            start = 0
            for u, n in enumerate(self.pieces):
                for a in range(0, n, self.chunk):
                    b = min(a + self.chunk, n)
                    tasks.append(Task(len(tasks), r, u, a, start + a, start + b))
                start += n
        return tuple(tasks)

    @property
    def direct(self) -> bool:
        """Whether the files use O_DIRECT."""
        return all(f.direct for f in self.files.values())

    @property
    def staging_bytes(self) -> int:
        """The memory the staging buffers hold while a transfer runs (the store's whole footprint then, but for
        thread stacks; between transfers it holds none)."""
        return self.buffers * self.chunk * sum(dtype.itemsize for dtype in self.leaves.values())

    def _staging(self) -> list[dict[str, Tensor]]:
        """The staging buffers of one transfer: `buffers` sets of one chunk per leaf, each set a mapping of its
        own, unmapped when the transfer ends (every I/O on them waited for): the memory goes back to the system
        between updates, rather than sit beside the forward's and the backward's units."""
        sizes = {name: self.chunk * dtype.itemsize for name, dtype in self.leaves.items()}
        sets = []
        for _ in range(self.buffers):
            whole, at, views = mapped_empty(sum(sizes.values())), 0, {}
            for name, n in sizes.items():  # (each a multiple of ALIGN: every view starts aligned)
                views[name] = whole[at : at + n]
                at += n
            sets.append(views)
        return sets

    def __repr__(self) -> str:
        return f"Store({str(self.scratch.path)!r}, rows={self.rows})"

    # ------------------------------------------------------------------------------------------------ versions
    def _check(self, x: Offloaded) -> None:
        if x.store is not self:
            raise ValueError(f"{x!r} belongs to another store than {self!r}")
        if self._slots[x.slot] != x.version:
            raise StaleStateError(
                f"{x!r} was overwritten by a later step: a state whose leaves are offloaded to disk keeps its two "
                "latest versions (the state a step starts from and the one it makes); keep using the newest state, "
                "or save a checkpoint to keep an older one"
            )

    def _new_version(self, keep: int | None) -> tuple[int, int]:
        """A fresh version and the slot it goes to: not the slot of `keep` (the input's version)."""
        with self._lock:
            version = next(self._versions)
            slot = 1 if keep is not None and self._slots[0] == keep else 0
            self._slots[slot] = version  # from now on the slot's old content is no version anyone may read
        return version, slot

    # ------------------------------------------------------------------------------------------------ transfers
    def _offset(self, task: Task, name: str, slot: int) -> int:
        return self.files[task.row, task.unit].offset(f"{name}.{slot}") + task.offset * self.leaves[name].itemsize

    def _read(self, task: Task, names: Sequence[str], slots: Mapping[str, int], crcs: Mapping[str, Any],
              staging: dict[str, Tensor]) -> list[Future]:  # fmt: skip
        f = self.files[task.row, task.unit]
        out = []
        for name in names:
            nbytes = task.size * self.leaves[name].itemsize
            out.append(self.pool.read(f, self._offset(task, name, slots[name]), staging[name], nbytes,
                                      crcs[name][task.index]))  # fmt: skip
        self._count(read=sum(task.size * self.leaves[n].itemsize for n in names))
        return out

    def _write(self, task: Task, names: Sequence[str], slot: int, staging: dict[str, Tensor]) -> dict[str, Future]:
        f = self.files[task.row, task.unit]
        out = {}
        for name in names:
            nbytes = task.size * self.leaves[name].itemsize
            out[name] = self.pool.write(f, self._offset(task, name, slot), staging[name], nbytes)
        self._count(written=sum(task.size * self.leaves[n].itemsize for n in names))
        return out

    def _views(self, task: Task, staging: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: b.view(self.leaves[n])[: task.size] for n, b in staging.items()}

    def stream(
        self,
        inputs: Mapping[str, Offloaded] | None,
        compute: Callable[[Task, dict[str, Tensor]], Any],
        *,
        write: bool = True,
    ) -> dict[str, Offloaded]:
        """Run `compute(task, views)` on every chunk, in order: `views` holds each leaf's chunk (the input's
        values where `inputs` has the leaf, else uninitialised), which `compute` updates in place; with `write`,
        the chunks are written as a new version of every leaf (returned). Reads run ahead and writes behind on the
        I/O threads (see the module docstring).

        Args:
          inputs: the leaves to read, by name, or None (nothing).
          compute: called once per task, in the tasks' order.
          write: write the results (a new version of every leaf); without, the store is only read.

        Returns:
          The new versions by leaf name ({} without `write`).

        Streams from several threads (a checkpoint writes a `SimMesh`'s rank files side by side) run one after
        another.
        """
        inputs = dict(inputs or {})
        keep = {x.version for x in inputs.values()}
        if len(keep) > 1:
            raise ValueError(f"{self!r}: the leaves to read are of different versions {sorted(keep)}")
        with self._streaming:
            for x in inputs.values():  # before a new version takes a slot
                self._check(x)
            version, slot = self._new_version(next(iter(keep), None)) if write else (-1, -1)
            crcs = self._stream(inputs, compute, self.tasks, (version, slot) if write else None)
        return self.finish(version, slot, crcs) if write else {}

    def stream_units(
        self,
        inputs: Mapping[str, Offloaded],
        compute: Callable[[Task, dict[str, Tensor]], Any],
        units: Sequence[int],
        version: int,
        slot: int,
    ) -> dict[str, dict[int, tuple[int, ...]]]:
        """`stream` over the tasks of `units` only, writing into a version that `begin` started (a version written
        unit by unit, in any order, from any thread: a speculative update); the crcs of the tasks written, by leaf,
        for `finish`."""
        with self._streaming:
            tasks = tuple(t for t in self.tasks if t.unit in set(units))
            return self._stream(dict(inputs), compute, tasks, (version, slot))

    def abandon(self, version: int, slot: int) -> None:
        """Give up a version `begin` started (a speculation rolled back): its slot holds no version any more."""
        with self._lock:
            if self._slots[slot] == version:
                self._slots[slot] = None

    def _stream(
        self,
        inputs: dict[str, Offloaded],
        compute: Callable[[Task, dict[str, Tensor]], Any],
        tasks: Sequence[Task],
        into: tuple[int, int] | None,
    ) -> dict[str, dict[int, tuple[int, ...]]]:
        """The pipeline over `tasks`, writing into version `into` (`(version, slot)`; None: read only); the crcs
        written, by leaf and task."""
        for x in inputs.values():
            self._check(x)
        names = list(self.leaves)
        reads = [n for n in names if n in inputs]
        slots = {n: x.slot for n, x in inputs.items()}
        crcs = {n: x.crcs for n, x in inputs.items()}
        if into is not None and self._slots[into[1]] != into[0]:
            raise StaleStateError(f"{self!r}: version {into[0]} was overwritten while it was being written")
        staging_sets = self._staging()
        nsets = len(staging_sets)
        pending_reads: dict[int, list[Future]] = {}
        pending_writes: dict[int, dict[str, Future]] = {}  # by position in `tasks`
        out_crcs: dict[str, dict[int, tuple[int, ...]]] = {n: {} for n in names}
        ahead = nsets - 2 if into is not None else nsets - 1

        def finish_write(i: int) -> None:
            for n, fut in pending_writes.pop(i).items():
                out_crcs[n][tasks[i].index] = fut.result()

        def start_read(j: int) -> None:
            if j - nsets in pending_writes:  # the set's previous task must be on disk before it is overwritten
                finish_write(j - nsets)
            pending_reads[j] = self._read(tasks[j], reads, slots, crcs, staging_sets[j % nsets]) if reads else []

        try:
            for j in range(min(ahead, len(tasks))):
                start_read(j)
            for i, task in enumerate(tasks):
                if i + ahead < len(tasks):
                    start_read(i + ahead)
                for fut in pending_reads.pop(i):
                    fut.result()
                staging = staging_sets[i % nsets]
                compute(task, self._views(task, staging))
                if into is not None:
                    pending_writes[i] = self._write(task, names, into[1], staging)
            for i in sorted(pending_writes):
                finish_write(i)
        except BaseException:
            self._drain(pending_reads, pending_writes)
            if into is not None:  # the slot holds a partial write: no version
                self.abandon(*into)
            raise
        return out_crcs

    @staticmethod
    def _drain(reads: dict[int, list[Future]], writes: dict[int, dict[str, Future]]) -> None:
        """Wait for every transfer in flight (their buffers must not be reused while a thread writes them)."""
        for futs in [*reads.values(), *(w.values() for w in writes.values())]:
            for fut in futs:
                try:
                    fut.result()
                except BaseException:  # the first error is the one being raised
                    pass

    def write(self, values: Mapping[str, Tensor]) -> dict[str, Offloaded]:
        """Write a first version of every leaf from in-memory `values` (each shaped like the leaf)."""
        missing = set(self.leaves) - set(values)
        if missing:
            raise ValueError(f"{self!r}: no value for leaves {sorted(missing)}")
        version, slot = self.begin()
        return self.finish(version, slot, {n: self.write_leaf(n, values[n], version, slot) for n in self.leaves})

    def row_units(self, x: Offloaded, row: int) -> Iterator[Tensor]:
        """The row at position `row` of `x`, unit by unit (each unit's piece read when asked for: a caller writing
        them out holds one unit at a time)."""
        for unit in range(len(self.pieces)):
            with self._streaming:
                values, futures = self.read_unit(x, unit)
            for fut in futures:
                fut.result()
            yield values[row] if self.stacked else values

    def begin(self, keep: Offloaded | None = None) -> tuple[int, int]:
        """Start writing a new version leaf by leaf (`write_leaf`, then `finish`); its version and slot: not the
        slot of `keep`, which stays readable. The other slot's version can no longer be read."""
        return self._new_version(None if keep is None else keep.version)

    def write_leaf(self, name: str, value: Tensor, version: int, slot: int) -> tuple[tuple[int, ...], ...]:
        """Write leaf `name` of the version `begin` started from the in-memory `value` (shaped like the leaf); the
        crcs of its tasks. Holds no more than the staging buffers besides `value`."""
        with self._streaming:
            if self._slots[slot] != version:
                raise StaleStateError(f"{self!r}: version {version} was overwritten while it was being written")
            staging_sets = self._staging()
            nsets, crcs = len(staging_sets), [()] * len(self.tasks)
            pending: dict[int, Future] = {}
            try:
                for i, task in enumerate(self.tasks):
                    if i - nsets in pending:
                        crcs[i - nsets] = pending.pop(i - nsets).result()
                    staging = staging_sets[i % nsets]
                    src = value[task.row] if self.stacked else value
                    self._views(task, staging)[name].copy_(src[task.start : task.stop])
                    pending[i] = self._write(task, [name], slot, staging)[name]
                for i in sorted(pending):
                    crcs[i] = pending.pop(i).result()
            except BaseException:
                self._drain({}, {i: {name: f} for i, f in pending.items()})
                raise
        return tuple(crcs)

    def finish(self, version: int, slot: int, crcs: Mapping[str, Sequence[Any] | Mapping[int, Any]]
               ) -> dict[str, Offloaded]:  # fmt: skip
        """The handles of a version written leaf by leaf or unit by unit: every task of every leaf must have been
        written (`crcs`: by leaf, each task's block crcs, in task order or by task index)."""
        out = {}
        for n in self.leaves:
            got = crcs.get(n, {})
            table = dict(got) if isinstance(got, Mapping) else dict(enumerate(got))
            if set(table) != set(range(len(self.tasks))):
                raise ValueError(f"{self!r}: version {version} of leaf {n!r} is incomplete")
            out[n] = Offloaded(self, n, version, slot, tuple(table[i] for i in range(len(self.tasks))))
        with self._lock:
            if self._slots[slot] != version:
                raise StaleStateError(f"{self!r}: version {version} was overwritten while it was being written")
        return out

    def read(self, x: Offloaded, row: int | None = None) -> Tensor:
        """The values of `x` in memory: all rows, or the row at position `row`."""
        n = sum(self.pieces)
        out = torch.empty((len(self.rows), n) if self.stacked and row is None else (n,), dtype=x.dtype)

        def take(task: Task, views: dict[str, Tensor]) -> None:
            if row is None or task.row == row:
                dest = out[task.row] if out.ndim == 2 else out
                dest[task.start : task.stop].copy_(views[x.name])

        self.stream({x.name: x}, take, write=False)
        return out

    def read_unit(self, x: Offloaded, unit: int) -> tuple[Tensor, list[Future]]:
        """Start reading unit `unit`'s piece of every row of `x`: a new tensor (`[rows, n]`, or `[n]`) and the
        transfers filling it (wait for them before reading it)."""
        self._check(x)
        n, size = self.pieces[unit], x.dtype.itemsize
        stride = -(-n * size // ALIGN) * ALIGN  # each row's piece starts aligned (O_DIRECT reads into it)
        buf = _read_buffer(stride * len(self.rows))
        futures = []
        for task in self.tasks:
            if task.unit == unit:
                start = task.row * stride + task.offset * size
                nbytes = task.size * size
                dest = buf[start : start + -(-nbytes // ALIGN) * ALIGN]
                futures.append(self.pool.read(self.files[task.row, unit], self._offset(task, x.name, x.slot), dest,
                                              nbytes, x.crcs[task.index]))  # fmt: skip
                self._count(read=nbytes)
        rows = buf.view(x.dtype).as_strided((len(self.rows), n), (stride // size, 1))
        return (rows if self.stacked else rows[0]), futures

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:  # (a speculative update streams on its own thread while the backward reads)
            self.bytes_read += read
            self.bytes_written += written

    def take_io(self) -> dict[str, int]:
        """Bytes read and written since the last call."""
        with self._lock:
            out = {"read": self.bytes_read, "written": self.bytes_written}
            self.bytes_read = self.bytes_written = 0
        return out

    def close(self) -> None:
        """Join the I/O threads, close and remove the files (idempotent)."""
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        for f in getattr(self, "files", {}).values():
            f.close()
        if getattr(self, "scratch", None) is not None:
            self.scratch.close()

"""`Offload`: where `shard_update` keeps the master parameters and the optimizer state (the storage tier), and the
NVMe tier's update.

`Offload("cpu")` is ZeRO-Offload (host memory; `shard_update`'s pieces overlap the transfers). `Offload("nvme",
path=...)` is ZeRO-Infinity's optimizer tier: the master parameters and every per-element leaf of the optimizer's
state (Adam's two moments: 12 bytes per parameter in fp32) live in swap files under `path` (`fzero.storage.Store`),
and the state holds `fzero.storage.Offloaded` handles to them. Each update streams the shard through the store's
pipeline, chunk by chunk: chunk i+1 is read while the optimizer runs on chunk i and chunk i-1 is written, to the
file slot the step's input does not occupy, so the input state stays readable. The optimizer runs on each chunk
exactly as on the whole shard (it is elementwise; the native kernel's results are bitwise the same on any piece),
so the NVMe run equals the in-memory one bit for bit. The compute copy (what the forward computes with) is written
chunk by chunk as the chunks come out of the optimizer: into memory, or with `Offload(params="nvme")` into the same
store, where stage 3's gathering reads it one unit ahead (`fzero.storage.UnitReader`).

`Offload(None | "cpu", params="nvme", path=...)` is ZeRO-Infinity's `offload_param` alone: the master parameters and
the optimizer's state stay in memory (device or host), and a store of one leaf, the compute copy, holds stage 3's
compute shard (`compute_init`). The update writes it chunk by chunk: in the store's pipeline as each chunk comes out
of the optimizer (`disk_update`, a donated update on the CPU: the same `RangeUpdate` as the NVMe tier's, on the
in-memory buffers' ranges), or, where the optimizer runs on the whole shard (a pure step, whole-tensor optimizers,
master weights on an accelerator), cast from the new master just after it (`write_compute`). Either way the copy is
bitwise the in-memory run's (`.to(compute dtype)`, which the native kernel's fused copy-out equals), and memory holds
no more of it than the staging buffers.

Memory held for the tier: `buffers x chunk x (bytes per element of the store's leaves)` while an update streams
(mapped for it, handed back after), for any model size; before each update the spare buffers the step's units
passed through and the C heap's free pages are handed back (`release_host_memory`), so the update's peak is the
gradient and the staging sets, not what the step freed (docs/offload.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from ..host import scratch
from ..host.hostmem import trim_heap
from ..optim import Optimizer
from ..storage import Offloaded, Store, Task

__all__ = [
    "Offload",
    "RangeUpdate",
    "compute_init",
    "disk_update",
    "nvme_init",
    "nvme_update",
    "offload_of",
    "release_host_memory",
    "write_compute",
]

DEVICES = (None, "cpu", "nvme")
COMPUTE = "compute"  # the compute copy's leaf in the store, with `Offload(params="nvme")`
Stream = Callable[[Task, dict[str, Tensor]], None]  # `Store.stream`'s work on one chunk


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where `shard_update` keeps the master parameters and the optimizer state.

    Attributes:
      optimizer: None (with the gradients), `"cpu"` (host memory) or `"nvme"` (swap files under `path`).
      params: None, or `"nvme"`: the compute parameters' shard lives in swap files under `path` (written by the
        update as the new master comes out of the optimizer: with `optimizer="nvme"` in the optimizer's own files,
        else in a store of its own), and each unit is read from them, one unit ahead, when the forward or the
        backward gathers it (ZeRO-Infinity's `offload_param`, stage 3's). The master parameters and the optimizer
        state stay where `optimizer` says. Stages 1-3 with `optimizer="nvme"`; otherwise stage 3 (and stages 1-2
        without accumulation: their windows keep the gathered parameters in memory).
      path: the directory the swap files go in (`"nvme"` either way; it must exist): each process makes its own
        scratch directory there and removes it on exit.
      buffers: staging sets of the pipeline (at least 3).
      chunk: elements per pipeline stage (a multiple of 4096).
      threads: I/O threads.
      block_size: bytes per I/O request and per checksum (a multiple of 4096).
      direct: O_DIRECT (None: where the filesystem supports it; True: required; False: buffered).
      speculate: SuperOffload (`optimizer` "cpu" or "nvme"): each unit's update runs while the backward goes on,
        as soon as that unit's gradient is reduced, before the step's checks (non-finite gradients, clipping) are
        known; validated when they are, and redone on a miss, so the result is the plain step's, bitwise
        (`fzero.transforms.speculate`). Stages whose backward reduces unit by unit (`fzero.Plan.per_unit`).

    Example:
      >>> import tempfile, torch, fzero
      >>> with tempfile.TemporaryDirectory() as d:
      ...     tx = fzero.zero3(fzero.cpu_adamw(), offload=fzero.Offload("nvme", path=d))
      ...     state = fzero.init(torch.nn.Linear(4, 4), tx, fzero.SimMesh(2))
      ...     type(state.params).__name__, fzero.state_bytes(state)["offloaded"]
      ('Offloaded', 192)
    """

    optimizer: str | None = None
    params: str | None = None
    path: str | os.PathLike[str] | None = None
    buffers: int = 4
    chunk: int = 1 << 20
    threads: int = 1
    block_size: int = 1 << 20
    direct: bool | None = None
    speculate: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in DEVICES:
            raise ValueError(f"Offload: optimizer must be None, 'cpu' or 'nvme', got {self.optimizer!r}")
        if self.params not in (None, "nvme"):
            raise ValueError(f"Offload: params must be None or 'nvme', got {self.params!r}")
        if self.speculate and self.optimizer is None:
            raise ValueError("Offload(speculate=True) speculates the offloaded optimizer's step: it needs "
                             "optimizer='cpu' or 'nvme'")  # fmt: skip
        if self.optimizer == "nvme" and self.path is None:
            raise ValueError("Offload('nvme') needs a directory for its swap files: Offload('nvme', path=...)")
        if self.params == "nvme" and self.path is None:
            raise ValueError("Offload(params='nvme') needs a directory for its swap files: Offload(..., "
                             "params='nvme', path=...)")  # fmt: skip
        for name, low in (("buffers", 3), ("chunk", 4096), ("threads", 1), ("block_size", 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Offload: {name} must be an integer >= {low}, got {value!r}")
        for name in ("chunk", "block_size"):
            if getattr(self, name) % 4096:
                raise ValueError(f"Offload: {name} must be a multiple of 4096, got {getattr(self, name)}")


def offload_of(value: Any) -> Offload:
    """`shard_update`'s `offload` argument as an `Offload` (a device name, an `Offload`, or None)."""
    if isinstance(value, Offload):
        return value
    if value == "nvme":
        raise ValueError("offload='nvme' needs a directory for its swap files: offload=fzero.Offload('nvme', "
                         "path=...)")  # fmt: skip
    if value in (None, "none", "cpu"):
        return Offload(None if value == "none" else value)
    raise ValueError(f"offload must be None, 'cpu' or an fzero.Offload, got {value!r}")


def _names(state: Any, probe: Tensor | Offloaded) -> tuple[list[Any], list[str | None]]:
    """The state's leaves, and for each per-element one (shaped like `probe`) a file-safe name (None for the rest)."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, namespace="fzero")
    names: list[str | None] = []
    for i, (acc, leaf) in enumerate(zip(accessors, leaves, strict=True)):
        per_element = isinstance(leaf, (Tensor, Offloaded)) and leaf.ndim > 0 and leaf.shape == probe.shape
        names.append(re.sub(r"[^A-Za-z0-9_]+", "_", acc.codify("")).strip("_") or f"leaf{i}" if per_element else None)
    return leaves, names


def _store(offload: Offload, dtypes: dict[str, torch.dtype], rows: tuple[int, ...], pieces: tuple[int, ...],
           stacked: bool) -> Store:  # fmt: skip
    """A store of the leaves `dtypes` for the ranks `rows`, each row cut into `pieces`, with `offload`'s settings."""
    return Store(offload.path, dtypes, rows, pieces, stacked=stacked, chunk=offload.chunk, buffers=offload.buffers,
                 threads=offload.threads, block_size=offload.block_size, direct=offload.direct)  # fmt: skip


def piece_of(x: Tensor, task: Task) -> Tensor:
    """Task `task`'s range of `x` (one row `[n]`, or rows `[rows, n]`), a view."""
    return (x[task.row] if x.ndim == 2 else x)[task.start : task.stop]


def take_io(store: Store) -> dict[str, int]:
    """The bytes `store` read and wrote since the last call, per rank (the ledger's unit)."""
    return {k: v // len(store.rows) for k, v in store.take_io().items()}


def nvme_init(
    optimizer: Optimizer,
    params: Tensor,
    offload: Offload,
    rows: tuple[int, ...],
    pieces: tuple[int, ...],
    compute_dtype: torch.dtype,
) -> tuple[Offloaded, Any, Offloaded | None]:
    """Write `params` (this rank's master buffer, or a `SimMesh`'s `[world, n]`) and the optimizer's initial state
    to a new store (and, with `offload.params`, the compute copy in `compute_dtype`).

    Returns:
      The handles: the master parameters, the state with its per-element leaves offloaded (the rest, e.g. Adam's
      step count, stays a tensor), and the compute copy's (None when it stays in memory).
    """
    probe = params[..., :1]
    state = optimizer.init(probe)
    leaves, names = _names(state, probe)
    dtypes = {"params": params.dtype, **{n: x.dtype for n, x in zip(names, leaves, strict=True) if n is not None}}
    if offload.params == "nvme":
        dtypes[COMPUTE] = compute_dtype
    if len(dtypes) != 1 + (offload.params == "nvme") + sum(n is not None for n in names):
        raise ValueError(f"optimizer state leaves {names} do not have distinct names")
    store = _store(offload, dtypes, rows, pieces, params.ndim == 2)

    def fill(task: Task, views: dict[str, Tensor]) -> None:
        chunk = piece_of(params, task)
        views["params"].copy_(chunk)
        if COMPUTE in views:
            views[COMPUTE].copy_(chunk)
        for n, x in zip(names, optree.tree_leaves(optimizer.init(chunk), namespace="fzero"), strict=True):
            if n is not None:
                views[n].copy_(x)

    written = store.stream(None, fill)
    store.take_io()  # (the metrics count the steps' transfers)
    handles = [x if n is None else written[n] for n, x in zip(names, leaves, strict=True)]
    state = optree.tree_unflatten(optree.tree_structure(state, namespace="fzero"), handles)
    return written["params"], state, written.get(COMPUTE)


def nvme_update(
    optimizer: Optimizer,
    grads: Tensor,
    state: Any,
    params: Offloaded,
    kw: dict[str, Any],
    compute_dtype: torch.dtype | None,
) -> tuple[Offloaded, Any, Tensor | Offloaded, dict[str, int]]:
    """One update through the store.

    Returns:
      The new master handle, the new state, the compute copy (in memory, on the gradients' device, or its handle
      where the store keeps it) and the bytes read and written per rank.
    """
    store = params.store
    release_host_memory()
    if "tensors" in kw:
        raise ValueError("an optimizer that needs whole parameter tensors (Lamb, Muon) cannot run on the chunks of "
                         "an NVMe-offloaded shard; offload it to 'cpu' instead")  # fmt: skip
    cdt = compute_dtype or params.dtype
    compute = None if COMPUTE in store.leaves else torch.empty(params.shape, dtype=cdt)
    piece = RangeUpdate(optimizer, state, params, kw, cdt, None if compute is None else compute.reshape(-1))
    check_offloaded(piece.handles, store)
    # the compute copy is only written here (the step's gathers read the input's version)
    written = store.stream(piece.handles, update_step(piece, grads))
    # since the last update: the gathers' reads of the compute copy, this update's transfers
    io = take_io(store)
    new_state = piece.state_after(written)
    return written["params"], new_state, written[COMPUTE] if compute is None else compute.to(grads.device), io


def release_host_memory() -> None:
    """Before an update through the store: the spare buffers the step's units passed through
    (`fzero.host.scratch`, kept for the next step's units where they are small) and the C heap's free pages, handed
    back. The update holds the gradient and the staging buffers, neither of which the units' memory serves; kept,
    they added a copy of the whole compute shard (every unit's spare) to the update's peak. The next step's units
    map their buffers afresh (a page fault per 4 KiB page of the shard, a step)."""
    scratch.drop_spares()
    trim_heap()


def update_step(piece: RangeUpdate, grads: Tensor, memory: dict[str, Tensor] | None = None) -> Stream:
    """The pipeline's work for one update.

    Args:
      piece: the update of one range.
      grads: the gradients (shaped like the master; on any device: each task's range is copied to the CPU).
      memory: the leaves that are not on disk (the master, the optimizer's per-element state), by leaf name: the
        views of their task's range are added to the staging views.

    Returns:
      `compute(task, views)` for `Store.stream` / `stream_units`.
    """
    g = grads.reshape(-1)

    def step(task: Task, views: dict[str, Tensor]) -> None:
        for n, x in (memory or {}).items():
            views[n] = piece_of(x, task)
        a = task.row * piece.width + task.start
        piece(task, views, g[a : a + task.size].cpu())

    return step


def cast_into(params: Tensor) -> Stream:
    """The pipeline's work that writes the compute copy from the master `params` (any device): each task's range
    cast into the compute leaf's staging view (rounded to nearest even: `.to`'s bytes)."""

    def fill(task: Task, views: dict[str, Tensor]) -> None:
        views[COMPUTE].copy_(piece_of(params, task))

    return fill


def compute_init(
    params: Tensor, offload: Offload, rows: tuple[int, ...], pieces: tuple[int, ...], compute_dtype: torch.dtype
) -> Offloaded:
    """`Offload(params="nvme")` beside an optimizer in memory: a new store of the compute copy alone.

    Args:
      params: the master parameters (this rank's buffer, or a `SimMesh`'s `[world, n]`; on any device).
      offload: the policy (its path, buffers, chunk, threads, ...).
      rows, pieces: the ranks whose rows `params` holds, and each unit's element count in a row.
      compute_dtype: the compute copy's dtype.

    Returns:
      The handle of the copy's first version, `params` cast chunk by chunk.
    """
    store = _store(offload, {COMPUTE: compute_dtype}, rows, pieces, params.ndim == 2)
    try:
        out = write_compute(store, params, None)
    except BaseException:
        store.close()
        raise
    store.take_io()  # (the metrics count the steps' transfers)
    return out


def write_compute(store: Store, params: Tensor, keep: Offloaded | None) -> Offloaded:
    """Write a new version of the compute copy, cast from the master chunk by chunk (through the staging buffers:
    no copy of the whole in memory), written behind.

    Args:
      store: the compute copy's store (`compute_init`'s).
      params: the new master (this rank's buffer, or a `SimMesh`'s `[world, n]`; on any device).
      keep: the step's input version, which stays readable (the other slot is written), or None.

    Returns:
      The new version's handle.
    """
    return _new_compute(store, keep, cast_into(params))


def _new_compute(store: Store, keep: Offloaded | None, fill: Stream) -> Offloaded:
    """A new version of the compute copy in `store`, beside `keep`: `fill` run on each chunk, written behind."""
    version, slot = store.begin(keep=keep)
    crcs = store.stream_units({}, fill, range(len(store.pieces)), version, slot)
    return store.finish(version, slot, crcs)[COMPUTE]


def disk_copy(compute: Any) -> Offloaded:
    """The state's compute copy, checked to be the handle of a store of its own (`compute_init`'s).

    Raises:
      ValueError: it is not (a chain that keeps the gathered parameters through an accumulation window, which then
        stand in the state where the handle was; a state made with another offload policy).
    """
    if not isinstance(compute, Offloaded) or set(compute.store.leaves) != {COMPUTE}:
        what = type(compute).__name__ if not isinstance(compute, Offloaded) else "leaf of the optimizer's store"
        raise ValueError(f"shard_update: Offload(params='nvme') with the optimizer in memory keeps the compute copy "
                         f"in swap files of its own, but this state's compute parameters are a {what}: a chain that "
                         "keeps them gathered through an accumulation window (zero1, zero2 with accumulate > 1) holds "
                         "them in memory instead (use zero3, the stage DeepSpeed's offload_param is for, or "
                         "Offload('nvme', params='nvme')), or the state was made with another offload "
                         "policy")  # fmt: skip
    return compute


def disk_update(
    optimizer: Optimizer, grads: Tensor, state: Any, params: Tensor, kw: dict[str, Any], compute: Offloaded
) -> tuple[Tensor, Any, Offloaded, dict[str, int]]:
    """A donated update of an in-memory master range by range, in the pipeline of the compute copy's store: each
    range's copy goes into the staging buffers as it comes out of the optimizer (its fused copy-out, or a cast)
    and is written behind while the next range is updated.

    Args:
      optimizer, kw: as for `shard_update`'s update (the gradients prepared: `grads` on any device).
      grads, state, params: the gradients, the optimizer's state and the master (`state` and `params` on the CPU,
        updated in place).
      compute: the compute copy's input version (it stays readable).

    Returns:
      The parameters and the state (updated in place), the new compute copy's handle, the bytes read and written
      per rank.
    """
    piece = RangeUpdate(optimizer, state, params, kw, compute.dtype, None)
    new = _new_compute(compute.store, compute, update_step(piece, grads, piece.handles))
    return params, piece.state_after(piece.handles), new, take_io(compute.store)


def check_offloaded(handles: dict[str, Any], store: Store) -> None:
    """Every leaf the update reads is a version in `store`."""
    for n, x in handles.items():
        if not isinstance(x, Offloaded) or x.store is not store:
            raise ValueError(f"shard_update: the state's leaf {n!r} is not offloaded to {store!r} (a state made "
                             "with another offload policy?)")  # fmt: skip


class RangeUpdate:
    """The optimizer on one range of a row of the shard at a time (a task of `fzero.storage.Store`: a chunk of one
    unit's piece of one row), in place on the views of the new version's buffers: what the NVMe tier's pipeline
    and a speculative update (`fzero.transforms.speculate`) run per chunk. The optimizer is elementwise, so any
    cut of the shard gives, bitwise, the values of one update of the whole.

    Args:
      optimizer, kw: as for `shard_update`'s update (`kw["segments"]` over the whole shard, sliced per range).
      state: the optimizer's state; its per-element leaves (shaped like `params`) are the store's leaves by name.
      params: the master parameters (an `Offloaded` or a tensor: only its shape is read here).
      compute_dtype: the compute copy's dtype.
      compute: the flat compute copy to write each range into, or None: the views' `compute` leaf (on disk).
    """

    def __init__(self, optimizer: Optimizer, state: Any, params: Tensor | Offloaded, kw: dict[str, Any],
                 compute_dtype: torch.dtype, compute: Tensor | None) -> None:  # fmt: skip
        self.optimizer, self.kw, self.compute = optimizer, kw, compute
        leaves, self.names = _names(state, params)
        self.handles = {"params": params, **{n: x for n, x in zip(self.names, leaves, strict=True) if n is not None}}
        self.spec = optree.tree_structure(state, namespace="fzero")
        self.rest = [x if n is None else None for n, x in zip(self.names, leaves, strict=True)]
        self.after: list[Any] = list(self.rest)
        self.width = params.shape[-1]
        self.fused_out = compute_dtype != params.dtype and "out" in optimizer.features

    def __call__(self, task: Task, views: dict[str, Tensor], g: Tensor) -> None:
        """Update `task`'s range of `views` (the params and per-element leaves, and `compute` when on disk) in place
        with its gradients `g` (on the CPU)."""
        a = task.row * self.width + task.start
        names = self.names
        sub = optree.tree_unflatten(
            self.spec, [x if n is None else views[n] for n, x in zip(names, self.rest, strict=True)]
        )
        extra = dict(self.kw)
        if "segments" in extra:
            extra["segments"] = extra["segments"].slice(a, a + task.size)
        out = views[COMPUTE] if self.compute is None else self.compute[a : a + task.size]
        if self.fused_out:
            extra["out"] = out
        p = views["params"]
        new_p, new_sub = self.optimizer.update(g, sub, p, donate=True, **extra)
        keep(p, new_p)
        for i, (n, y) in enumerate(zip(names, optree.tree_leaves(new_sub, namespace="fzero"), strict=True)):
            if n is None:
                self.after[i] = y  # (the step count: every range computes the same)
            else:
                keep(views[n], y)
        if not self.fused_out:
            out.copy_(p)

    def state_after(self, leaves: dict[str, Any]) -> Any:
        """The optimizer's new state: its per-element leaves from `leaves` (by name), the rest as computed."""
        return optree.tree_unflatten(self.spec, [self.after[i] if n is None else leaves[n]
                                                 for i, n in enumerate(self.names)])  # fmt: skip


def keep(dest: Tensor, got: Tensor) -> None:
    """An in-place update returns views of what it was given; anything else is copied into place."""
    if got.data_ptr() != dest.data_ptr():
        dest.copy_(got)

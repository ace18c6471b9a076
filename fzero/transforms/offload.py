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

Memory held for the tier: `buffers x chunk x (bytes per element of the store's leaves)`, for any model size
(docs/offload.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import optree
import torch
from torch import Tensor

from ..optim import Optimizer
from ..storage import Offloaded, Store, Task

__all__ = ["Offload", "RangeUpdate", "nvme_init", "nvme_update", "offload_of"]

DEVICES = (None, "cpu", "nvme")
COMPUTE = "compute"  # the compute copy's leaf in the store, with `Offload(params="nvme")`


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where `shard_update` keeps the master parameters and the optimizer state.

    Attributes:
      optimizer: None (with the gradients), `"cpu"` (host memory) or `"nvme"` (swap files under `path`).
      params: None, or `"nvme"` (stage 3, with `optimizer="nvme"`): the compute parameters' shard also lives in
        the swap files (written by the update in the same pass as the master), and each unit is read from them,
        one unit ahead, when the forward or the backward gathers it (ZeRO-Infinity's `offload_param`).
      path: the directory the swap files go in (`"nvme"`; it must exist): each process makes its own scratch
        directory there and removes it on exit.
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
        if self.params == "nvme" and self.optimizer != "nvme":
            raise ValueError("Offload(params='nvme') keeps the compute shard in the optimizer's swap files: it needs "
                             "optimizer='nvme' too")  # fmt: skip
        if self.speculate and self.optimizer is None:
            raise ValueError("Offload(speculate=True) speculates the offloaded optimizer's step: it needs "
                             "optimizer='cpu' or 'nvme'")  # fmt: skip
        if self.optimizer == "nvme" and self.path is None:
            raise ValueError("Offload('nvme') needs a directory for its swap files: Offload('nvme', path=...)")
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


def nvme_init(
    optimizer: Optimizer,
    params: Tensor,
    offload: Offload,
    rows: tuple[int, ...],
    pieces: tuple[int, ...],
    compute_dtype: torch.dtype,
) -> tuple[Offloaded, Any, Offloaded | None]:
    """Write `params` (this rank's master buffer, or a `SimMesh`'s `[world, n]`) and the optimizer's initial state
    to a new store (and, with `offload.params`, the compute copy in `compute_dtype`); the handles to them: the
    master parameters, the state with its per-element leaves offloaded (the rest, e.g. Adam's step count, stays a
    tensor), and the compute copy's (None when it stays in memory)."""
    stacked = params.ndim == 2
    probe = params[..., :1]
    state = optimizer.init(probe)
    leaves, names = _names(state, probe)
    dtypes = {"params": params.dtype, **{n: x.dtype for n, x in zip(names, leaves, strict=True) if n is not None}}
    if offload.params == "nvme":
        dtypes[COMPUTE] = compute_dtype
    if len(dtypes) != 1 + (offload.params == "nvme") + sum(n is not None for n in names):
        raise ValueError(f"optimizer state leaves {names} do not have distinct names")
    store = Store(offload.path, dtypes, rows, pieces, stacked=stacked, chunk=offload.chunk, buffers=offload.buffers,
                  threads=offload.threads, block_size=offload.block_size, direct=offload.direct)  # fmt: skip
    flat = params.reshape(len(rows), -1) if stacked else params.reshape(1, -1)

    def fill(task: Task, views: dict[str, Tensor]) -> None:
        chunk = flat[task.row, task.start : task.stop]
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
    """One update through the store: returns the new master handle, the new state, the compute copy (in memory,
    on the gradients' device, or its handle where the store keeps it) and the bytes read and written per rank."""
    store = params.store
    if "tensors" in kw:
        raise ValueError("an optimizer that needs whole parameter tensors (Lamb, Muon) cannot run on the chunks of "
                         "an NVMe-offloaded shard; offload it to 'cpu' instead")  # fmt: skip
    cdt = compute_dtype or params.dtype
    compute = None if COMPUTE in store.leaves else torch.empty(params.shape, dtype=cdt)
    piece = RangeUpdate(optimizer, state, params, kw, cdt, None if compute is None else compute.reshape(-1))
    check_offloaded(piece.handles, store)
    device, g, width = grads.device, grads.reshape(-1), piece.width

    def step(task: Task, views: dict[str, Tensor]) -> None:
        a = task.row * width + task.start
        piece(task, views, g[a : a + task.size].cpu())

    # the compute copy is only written here (the step's gathers read the input's version)
    written = store.stream(piece.handles, step)
    # since the last update: the gathers' reads of the compute copy, this update's transfers; per rank (the ledger's)
    io = {k: v // len(store.rows) for k, v in store.take_io().items()}
    new_state = piece.state_after(written)
    return written["params"], new_state, written[COMPUTE] if compute is None else compute.to(device), io


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

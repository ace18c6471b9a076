"""Where a checkpoint's leaves are read from: its files, or a state in memory, behind one small interface.

A `Source` answers one question: what does rank `r`'s file hold for leaf `key` (optionally only a range of the
last dimension)? On top of it, `unit` puts together one unit of a leaf's full, unit-major value, and `named`
cuts a param-space leaf into tensors by parameter name, streaming unit by unit. `fzero.checkpoint.Checkpoint`
(the files) and `MemorySource` (a live state, deciding storage as a save would) both implement it, so resharding
and consolidation are the same code for a checkpoint on disk and a state in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from ..layout import Layout, dtype_of
from ..storage import Offloaded, in_memory
from .errors import IncompatibleCheckpointError
from .manifest import StoredEntry
from .safetensors_io import tensor_sha256
from .tree import FULL, PARAM_SPACE, SHARD, FlatState, rank_value

__all__ = ["MemorySource", "Source", "decide_storage", "named", "rank_chunk", "unit", "unit_into"]


class Source(Protocol):
    layout: Layout
    entries: dict[str, StoredEntry]

    def read(self, key: str, rank: int, index: slice | None = None) -> Tensor:
        """What rank `rank`'s file holds for `key` (rank 0's for leaves stored once); with `index`, only that range
        of the last dimension. A new tensor."""
        ...

    def read_into(self, key: str, rank: int, out: Tensor, index: slice | None = None) -> None:
        """`read`, written into `out` (of the right dtype and shape)."""
        ...


def _last(x: Tensor, index: slice | None) -> Tensor:
    return x if index is None else x[..., index]


def rank_pieces(layout: Layout, full: Tensor, rank: int) -> list[Tensor]:
    """Rank `rank`'s shard of a full, unit-major buffer as one view per unit (their concatenation is
    `shard(layout, full)[rank]`)."""
    return [full[..., u.start + rank * (u.size // layout.world) :][..., : u.size // layout.world] for u in layout.units]


def rank_chunk(layout: Layout, full: Tensor, rank: int) -> Tensor:
    """Rank `rank`'s shard of a full, unit-major buffer (`shard(layout, full)[rank]`, without permuting all of it)."""
    parts = rank_pieces(layout, full, rank)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def unit_into(source: Source, key: str, index: int, out: Tensor) -> None:
    """Write unit `index` of the leaf's full, unit-major value into `out` (`[..., unit size]`), reading every
    rank's part."""
    e = source.entries[key]
    lay = e.layout_in(source.layout)
    if e.storage != "split":  # a full value stored whole (rank 0's)
        source.read_into(key, 0, out, lay.unit_slice(index))
        return
    sl = lay.unit_shard_slice(index)
    c = sl.stop - sl.start
    for r in range(lay.world):
        source.read_into(key, r, out[..., r * c : (r + 1) * c], sl)


def unit(source: Source, key: str, index: int) -> Tensor:
    """Unit `index` of the leaf's full, unit-major value (`[..., unit size]`), read from every rank's part."""
    e = source.entries[key]
    out = torch.empty(*e.lead, e.layout_in(source.layout).units[index].size, dtype=dtype_of(e.dtype))
    unit_into(source, key, index, out)
    return out


def named(
    source: Source, key: str, dtype: torch.dtype | None = None, *, copy: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """A param-space leaf cut into parameters: `(name, tensor)` in layout order, aliases after their parameter,
    holding one unit at a time. Cast to `dtype` if given. With `copy=False` the tensors are views of the unit
    being read (no copy; each keeps its unit's memory alive while held: for streaming them out)."""
    e = source.entries[key]
    if e.kind not in PARAM_SPACE:
        raise ValueError(f"leaf {key!r} is not parameter-shaped (kind {e.kind!r})")
    lay = e.layout_in(source.layout)
    aliases: dict[str, list[str]] = {}
    for alias, name in source.layout.aliases:
        aliases.setdefault(name, []).append(alias)
    current, data, t = -1, None, None
    for leaf in lay.leaves:
        if leaf.unit != current:
            data = t = None  # free the last unit (and our view of it) before reading the next
            current, data = leaf.unit, unit(source, key, leaf.unit)
        start = leaf.offset - lay.units[leaf.unit].start
        assert data is not None  # read at the first leaf
        t = data[..., start : start + leaf.numel].reshape(*e.lead, *leaf.shape)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        elif copy:
            t = t.clone()
        yield leaf.name, t
        for alias in aliases.get(leaf.name, ()):
            yield alias, t


class MemorySource:
    """A state in memory seen as the checkpoint a save would write (all ranks on a `SimMesh`; this rank's file on
    a `DistMesh`)."""

    def __init__(self, flat: FlatState, storage: dict[str, str], rank: int | None = None) -> None:
        self.layout = flat.layout
        self.flat = flat
        self.rank = rank  # None: every rank is here (SimMesh or world 1)
        self._leaves = {e.key: x for e, x in zip(flat.entries, flat.leaves, strict=True)}
        self.entries = {e.key: StoredEntry(**vars(e), storage=storage[e.key]) for e in flat.entries}

    def _value(self, key: str, rank: int) -> Tensor:
        e = self.entries[key]
        if self.rank is not None:
            if rank != self.rank and e.storage == "per_rank":
                raise ValueError(f"rank {rank}'s value of {key!r} lives in another process")
            return in_memory(self._leaves[key])  # split and rank0 values are alike on every rank
        return rank_value(self._leaves[key], e, rank)

    def pieces(self, key: str, rank: int) -> Iterable[Tensor]:
        """`read(key, rank)` as views to be written one after the other (no copy); a shard offloaded to disk as its
        units, each read when the writer gets to it."""
        e = self.entries[key]
        x = self._leaves[key]
        if isinstance(x, Offloaded) and e.kind == SHARD:
            return x.store.row_units(x, rank if x.store.stacked else 0)
        if e.storage == "split" and e.kind == FULL:
            return rank_pieces(e.layout_in(self.layout), self._value(key, 0), rank)
        return [self._view(key, rank, None)]

    def _view(self, key: str, rank: int, index: slice | None) -> Tensor:
        e = self.entries[key]
        if e.storage == "split" and e.kind == FULL:
            # a full value every rank holds alike, stored as the layout's shards: rank r keeps its chunk
            return _last(rank_chunk(e.layout_in(self.layout), self._value(key, 0), rank), index)
        return _last(self._value(key, 0 if e.storage == "rank0" else rank), index)

    def read(self, key: str, rank: int, index: slice | None = None) -> Tensor:
        return self._view(key, rank, index).clone()

    def read_into(self, key: str, rank: int, out: Tensor, index: slice | None = None) -> None:
        out.copy_(self._view(key, rank, index))


def _same_rows(x: Tensor, world_axis: bool) -> bool:
    """Whether every rank's row is bitwise equal to rank 0's (NaN payloads and signed zeros included)."""
    if not world_axis or x.shape[0] == 1:
        return True
    rows = x.reshape(x.shape[0], -1).contiguous()
    bits = rows.view(_INTS.get(rows.element_size(), torch.uint8)) if rows.dtype != torch.bool else rows
    return all(torch.equal(bits[r], bits[0]) for r in range(1, bits.shape[0]))


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # same-size ints: equal iff same bits


def decide_storage(flat: FlatState, digests_of_all_ranks: Any = None) -> dict[str, str]:
    """How each leaf is stored (see `fzero.checkpoint.manifest`): shards split; full and replicated leaves split or
    kept once when all ranks hold the same bits, else per rank.

    Args:
      flat: the state (on a `SimMesh` all ranks' rows are compared here).
      digests_of_all_ranks: on a `DistMesh`, a function mapping this rank's per-leaf sha256 digests (a uint8
        tensor `[n, 32]`) to every rank's (`[world, n, 32]`), e.g. by an all-gather.
    """
    storage: dict[str, str] = {}
    pending = []
    for e, x in zip(flat.entries, flat.leaves, strict=True):
        if e.kind == SHARD:
            storage[e.key] = "split"
            continue
        x = in_memory(x)  # (a full buffer offloaded to disk: stage 0's master)
        whole = "split" if e.kind == FULL else "rank0"
        if flat.world == 1:
            storage[e.key] = whole
        elif digests_of_all_ranks is None:
            storage[e.key] = whole if _same_rows(x, e.world_axis) else "per_rank"
        else:
            pending.append((e, x, whole))
    if pending:
        mine = torch.stack([torch.frombuffer(bytearray(tensor_sha256(x)), dtype=torch.uint8) for _, x, _ in pending])
        every = digests_of_all_ranks(mine)
        for i, (e, _, whole) in enumerate(pending):
            same = bool((every[:, i] == every[:1, i]).all())
            storage[e.key] = whole if same else "per_rank"
    return storage


def check_param_source(e: StoredEntry, key: str, target: str) -> None:
    if e.storage == "per_rank":
        raise IncompatibleCheckpointError(
            f"leaf {key!r}: the saved ranks hold different full buffers (gradients accumulated locally in the middle "
            f"of a step), which cannot be moved to {target}. Save at an accumulation boundary, or load into the same "
            "world size and stage."
        )

"""The leaves of a `TrainState`, named and classified generically (no field of the state is hard-coded).

Every tensor leaf gets a **key**, its path in the pytree: a chain's state is `{transform name: state}`, so the keys
read `"tx_state/shard_update/exp_avg"`, `"tx_state/accumulate/acc"`. Stages put the same transforms at different
chain positions (`accumulate` comes before `reduce_scatter` in stage 1, after it in stage 2) under the same names, so
a key names the same quantity in every stage and a checkpoint moves between them; a sequence position whose child is
a named node (a NamedTuple or dataclass sub-state) becomes that node's type name. Checkpoints of format 1 named the
chain's entries by their state's type (`"tx_state/AdamState/exp_avg"`): `legacy_key` maps those keys.

Every leaf also has a **space** and a **kind**. The space is the flat buffer layout it follows: ``"frozen"`` for
the state's `frozen` field (`layout.frozen_layout`), ``"params"`` (`layout`) for everything else. The kind is told
by the leaf's per-rank shape against its space's layout:

- ``"shard"``: last dimension `shard_numel`: this rank's shard, in the layout's shard order;
- ``"full"``: last dimension `numel`: a full, unit-major buffer;
- ``"replicated"``: anything else (counters, loss-scale values, buffers, which are known by their names in the
  layout), kept as is.

At world 1 a shard is the full buffer; such leaves are called shards. On a `SimMesh` a leaf carries the leading
world axis when its first dimension is the world size and it has at least one dimension; 0-d leaves (counters)
are shared by all ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor

from ..layout import Layout
from ..storage import Offloaded

__all__ = ["FULL", "REPLICATED", "SHARD", "SPACES", "Entry", "FlatState", "dtype_name", "flatten_state", "legacy_key"]

SHARD, FULL, REPLICATED = "shard", "full", "replicated"
PARAM_SPACE = (SHARD, FULL)
KINDS = (*PARAM_SPACE, REPLICATED)  # every kind a leaf can have: a manifest's leaves are checked against it
PARAMS, FROZEN = "params", "frozen"
SPACES = (PARAMS, FROZEN)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Entry:
    """What one leaf is, independently of its values.

    Attributes:
      key: the leaf's stable name (see the module docstring).
      path: where optree finds it, e.g. ``"*.tx_state[4].exp_avg"`` (for messages).
      kind: ``"shard"``, ``"full"`` or ``"replicated"``.
      shape: the shape on one rank (without the `SimMesh` world axis).
      dtype: the dtype's name, e.g. ``"float32"``.
      world_axis: whether the leaf carries the `SimMesh` world axis (False on `DistMesh`).
      space: ``"params"`` or ``"frozen"``: the flat buffer layout a shard or full leaf follows.
    """

    key: str
    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    world_axis: bool
    space: str = PARAMS

    @property
    def lead(self) -> tuple[int, ...]:
        """The dimensions before the flat one, for param-space leaves."""
        return self.shape[:-1]

    def layout_in(self, layout: Layout) -> Layout:
        """The layout this leaf's space follows, within the state's `layout`."""
        if self.space == FROZEN:
            if layout.frozen_layout is None:
                raise ValueError(f"leaf {self.key!r} is in the frozen space, but the layout has no frozen parameters")
            return layout.frozen_layout
        return layout


@dataclass(frozen=True)
class FlatState:
    """A state taken apart: entries and leaves in pytree order, the treespec to rebuild it, and its layout."""

    entries: tuple[Entry, ...]
    leaves: tuple[Tensor, ...]
    treespec: Any
    layout: Layout
    simulated: bool

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def device(self) -> torch.device:
        """Where the state lives (its first leaf's device)."""
        return self.leaves[0].device if self.leaves else torch.device("cpu")

    def by_key(self) -> dict[str, tuple[Entry, Tensor]]:
        return {e.key: (e, x) for e, x in zip(self.entries, self.leaves, strict=True)}


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


def _is_sequence(entry: Any) -> bool:
    return isinstance(entry, optree.SequenceEntry) and entry.type in (tuple, list)


def _named(entry: Any) -> str | None:
    field = getattr(entry, "field", None)
    return field if isinstance(field, str) else None


def _component(entry: Any) -> str:
    name = _named(entry)
    if name is not None:
        return _escape(name)
    if isinstance(entry, optree.MappingEntry):
        return _escape(str(entry.key))
    return _escape(str(entry.entry))


def _keys(accessors: list[Any]) -> list[str]:
    """Keys for all leaves; a sequence position whose child is a named node (a NamedTuple or dataclass sub-state)
    becomes that node's type name, with ``#n`` for the n-th sibling of the same type (n >= 1)."""
    # First pass: for each (parent, child type), the sequence positions holding such a child, to number siblings.
    siblings: dict[tuple[tuple[Any, ...], str], set[int]] = defaultdict(set)
    for acc in accessors:
        entries = list(acc)
        for i, e in enumerate(entries[:-1]):
            if _is_sequence(e) and entries[i + 1].type not in (tuple, list, dict):
                siblings[(tuple(entries[:i]), entries[i + 1].type.__name__)].add(e.index)
    keys = []
    for acc in accessors:
        entries = list(acc)
        parts = []
        for i, e in enumerate(entries):
            if i + 1 < len(entries) and _is_sequence(e) and entries[i + 1].type not in (tuple, list, dict):
                type_name = entries[i + 1].type.__name__
                nth = sorted(siblings[(tuple(entries[:i]), type_name)]).index(e.index)
                parts.append(_escape(type_name) + (f"#{nth}" if nth else ""))
            else:
                parts.append(_component(e))
        keys.append("/".join(parts) if parts else "<root>")
    return keys


_LEGACY = {"AdamState": "shard_update", "SGDState": "shard_update", "AccumulateState": "accumulate"}


def legacy_key(key: str) -> str:
    """Today's key of a format-1 checkpoint's key (`tx_state/AdamState#1/exp_avg` -> `tx_state/shard_update#1/...`).

    Example:
      >>> legacy_key("tx_state/AccumulateState/acc"), legacy_key("loss_scale/cur_iter"), legacy_key("params")
      ('tx_state/accumulate/acc', 'tx_state/scale_loss/cur_iter', 'params')
    """
    parts = key.split("/")
    if parts[0] == "tx_state" and len(parts) > 1:
        base, sep, nth = parts[1].partition("#")
        if base in _LEGACY:
            parts[1] = _LEGACY[base] + sep + nth
    elif parts[0] == "loss_scale":  # the state's own field then; scale_loss's state now
        parts = ["tx_state", "scale_loss", *parts[1:]]
    return "/".join(parts)


def classify(layout: Layout, shape: tuple[int, ...], last_entry: Any) -> str:
    """The kind of a leaf of per-rank `shape` in the space laid out by `layout` (see the module docstring)."""
    if isinstance(last_entry, optree.MappingEntry):
        spec = {s.name: tuple(s.shape) for s in layout.buffers}.get(str(last_entry.key))
        if spec is not None and spec == shape:
            return REPLICATED  # a buffer, whatever its size
    if shape and shape[-1] == layout.shard_numel:
        return SHARD
    if shape and shape[-1] == layout.numel:
        return FULL
    return REPLICATED


def flatten_state(state: Any) -> FlatState:
    """Take a `TrainState` apart into named, classified leaves.

    Raises:
      TypeError: `state` has no `layout` or a leaf is not a tensor.
      ValueError: two leaves get the same key (a state this module cannot name).
    """
    layout = getattr(state, "layout", None)
    if not isinstance(layout, Layout):
        raise TypeError(f"expected an fzero TrainState (with a layout), got {type(state).__name__}")
    if layout.axis is not None:
        raise ValueError(f"a hybrid-sharded state (sharded over mesh axis {layout.axis!r}) is checkpointed as its "
                         "first shard group: fzero.checkpoint.hybrid.shard_group(state)")  # fmt: skip
    params = getattr(state, "params", None)
    simulated = bool(getattr(state, "simulated", isinstance(params, Tensor) and params.ndim == 2))
    accessors, leaves, treespec = optree.tree_flatten_with_accessor(state, namespace="fzero", none_is_leaf=False)
    keys = _keys(accessors)
    entries = []
    for key, acc, leaf in zip(keys, accessors, leaves, strict=True):
        if not isinstance(leaf, (Tensor, Offloaded)):
            what = type(leaf).__name__
            raise TypeError(f"state leaf {acc.codify('state')} is a {what}; a checkpoint holds tensors only")
        world_axis = simulated and leaf.ndim >= 1 and leaf.shape[0] == layout.world
        shape = tuple(leaf.shape[1:] if world_axis else leaf.shape)
        parts = list(acc)
        space = FROZEN if parts and _named(parts[0]) == "frozen" else PARAMS
        lay = layout.frozen_layout if space == FROZEN else layout
        assert lay is not None  # a state with a frozen buffer has a frozen layout
        kind = classify(lay, shape, parts[-1] if parts else None)
        entries.append(Entry(key, acc.codify("state"), kind, shape, dtype_name(leaf.dtype), world_axis, space))
    seen: dict[str, str] = {}
    for e in entries:
        if e.key in seen:
            raise ValueError(f"state leaves {seen[e.key]} and {e.path} get the same checkpoint key {e.key!r}")
        seen[e.key] = e.path
    return FlatState(tuple(entries), tuple(leaves), treespec, layout, simulated)


def rank_value(flat_leaf: Tensor, entry: Entry, rank: int) -> Tensor:
    """Rank `rank`'s value of a leaf of this process (the world-axis row on a `SimMesh`, else the leaf); an
    offloaded leaf's is read from its files (one row of one leaf in memory at a time)."""
    if isinstance(flat_leaf, Offloaded):
        return flat_leaf.read(rank if entry.world_axis else None)
    return flat_leaf[rank] if entry.world_axis else flat_leaf

"""Build a state's leaves, in the target's forms and world size, from any `Source`.

For each leaf of the target (`like`), matched to the source by key:

- param-space (shard or full): when the layouts are equal the stored parts are taken as they are (bitwise the
  saved tensors); otherwise unit by unit: the target unit's buffer is zero-filled (its padding), each parameter is
  copied in from the source unit that holds it, by name, and the ranks' chunks of it go to their shards. Memory: one
  source unit and one target unit beyond the result. This is the whole of resharding W -> W', and of moving
  between stages (a stage-2 shard becomes a stage-0 full buffer, or the reverse);
- replicated: rank `r`'s own value where the source kept one per rank and the world is unchanged, else rank 0's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..layout import Layout, dtype_of, flatten
from .errors import IncompatibleCheckpointError
from .manifest import StoredEntry
from .sources import Source, check_param_source, rank_chunk, unit, unit_into
from .tree import FROZEN, FULL, PARAM_SPACE, REPLICATED, SHARD, Entry, FlatState, _escape

__all__ = ["build_leaves", "check_compatible", "model_difference"]


def model_difference(saved: Layout, target: Layout) -> str | None:
    """The first difference between two layouts' parameters, frozen parameters and buffers (names and shapes),
    or None when they describe the same model (units, alignment and world size may differ)."""
    for what, a, b in (
        ("parameter", [(x.name, x.shape) for x in saved.leaves], [(x.name, x.shape) for x in target.leaves]),
        ("frozen parameter", [(x.name, x.shape) for x in saved.frozen], [(x.name, x.shape) for x in target.frozen]),
        ("buffer", [(x.name, x.shape) for x in saved.buffers], [(x.name, x.shape) for x in target.buffers]),
    ):
        mine, theirs = dict(a), dict(b)
        for name, shape in b:
            if name not in mine:
                return f"{what} {name!r} {tuple(shape)} is in the model but not in the checkpoint"
            if tuple(mine[name]) != tuple(shape):
                return f"{what} {name!r} has shape {tuple(mine[name])} in the checkpoint, {tuple(shape)} in the model"
        for name, shape in a:
            if name not in theirs:
                return f"{what} {name!r} {tuple(shape)} is in the checkpoint but not in the model"
    return None


def _describe(e: Entry, layout: Layout) -> str:
    return f"a {e.kind} leaf of shape {e.shape} (world {layout.world})"


def _remap(source: Source, key: str, target: Layout, t: Entry, outs: dict[int, Tensor]) -> None:
    """Fill the target ranks' values (`outs`) of a param-space leaf laid out by another layout (see the module
    docstring)."""
    src = source.entries[key].layout_in(source.layout)
    target = t.layout_in(target)
    src_leaves = {x.name: x for x in src.leaves}
    dtype = dtype_of(t.dtype)
    by_unit: dict[int, list] = {}
    for leaf in target.leaves:
        by_unit.setdefault(leaf.unit, []).append(leaf)
    cached, data = -1, None
    for index, u in enumerate(target.units):
        buf = torch.zeros(*t.lead, u.size, dtype=dtype)  # zero padding, as every fzero buffer has
        for leaf in by_unit.get(index, []):
            s = src_leaves[leaf.name]
            if s.unit != cached:
                cached, data = s.unit, unit(source, key, s.unit)
            a, b = s.offset - src.units[s.unit].start, leaf.offset - u.start
            assert data is not None  # read at the first leaf
            buf[..., b : b + leaf.numel] = data[..., a : a + leaf.numel]
        for r, out in outs.items():
            if t.kind == SHARD:
                c = u.size // target.world
                out[..., u.shard_start : u.shard_start + c] = buf[..., r * c : (r + 1) * c]
            else:
                out[..., u.start : u.start + u.size] = buf


def _check_leaf(source: Source, e: StoredEntry, t: Entry, target: Layout) -> None:
    """Whether the saved leaf `e` can fill the state's leaf `t` (raises if not; reads nothing)."""
    if e.space != t.space:
        raise IncompatibleCheckpointError(
            f"leaf {t.key!r} follows the {t.space} layout in the state but the {e.space} layout in the checkpoint"
        )
    if e.dtype != t.dtype:
        raise IncompatibleCheckpointError(
            f"leaf {t.key!r} is {e.dtype} in the checkpoint but {t.dtype} in the state (another precision?)"
        )
    if (t.kind in PARAM_SPACE) != (e.kind in PARAM_SPACE) or (t.kind == REPLICATED and e.shape != t.shape):
        raise IncompatibleCheckpointError(
            f"leaf {t.key!r} is {_describe(t, target)} in the state but {_describe(e, source.layout)} in the checkpoint"
        )
    if t.kind in PARAM_SPACE:
        if e.lead != t.lead:
            raise IncompatibleCheckpointError(
                f"leaf {t.key!r} has leading dimensions {e.lead} in the checkpoint, {t.lead} in the state"
            )
        if e.storage == "per_rank" and not (e.layout_in(source.layout) == t.layout_in(target) and t.kind == FULL):
            check_param_source(e, t.key, _describe(t, target))


def _fill_param(source: Source, e: StoredEntry, t: Entry, target: Layout, outs: dict[int, Tensor]) -> None:
    if e.layout_in(source.layout) != t.layout_in(target) or e.storage == "rank0":
        _remap(source, t.key, target, t, outs)
        return
    target = t.layout_in(target)
    # the same layout: the stored tensors as they are, read straight into place
    first = None
    for r, out in outs.items():
        if e.storage == "per_rank" or t.kind == SHARD:
            source.read_into(t.key, r, out)
        elif first is not None:  # a full buffer every rank holds alike: read once
            out.copy_(first)
        else:
            for i in range(len(target.units)):
                unit_into(source, t.key, i, out[..., target.unit_slice(i)])
            first = out


def _fill_replicated(source: Source, e: StoredEntry, t: Entry, target: Layout, outs: dict[int, Tensor]) -> None:
    own = e.storage == "per_rank" and source.layout.world == target.world
    for r, out in outs.items():
        source.read_into(t.key, r if own else 0, out)


def _legacy_frozen(source: Source, like: FlatState) -> dict[str, str]:
    """For checkpoints written before frozen parameters had a flat buffer (one replicated leaf per frozen
    parameter, ``frozen/NAME``): `{name: key}` when the state's flat frozen leaf is missing and those are all there,
    else empty."""
    frozen_layout = like.layout.frozen_layout
    wanted = [e for e in like.entries if e.space == FROZEN and e.key not in source.entries]
    if frozen_layout is None or not wanted:
        return {}
    keys = {leaf.name: f"frozen/{_escape(leaf.name)}" for leaf in frozen_layout.leaves}
    return keys if all(k in source.entries for k in keys.values()) else {}


def _fill_legacy_frozen(source: Source, names: dict[str, str], t: Entry, target: Layout, outs: dict) -> None:
    frozen_layout = t.layout_in(target)
    full = flatten(
        frozen_layout, {name: source.read(key, 0).to(frozen_layout.torch_dtype) for name, key in names.items()}
    )
    for r, out in outs.items():
        out.copy_(rank_chunk(frozen_layout, full, r) if t.kind == SHARD else full)


def check_compatible(
    source: Source, like: FlatState, *, strict: bool = True, select: Callable[[str], bool] | None = None
) -> set[str]:
    """Check, from the entries alone, that `source` can fill `like`; returns the keys to load.

    Raises:
      IncompatibleCheckpointError: another model (the first differing parameter, frozen parameter or buffer),
        another structure (leaves missing or extra, under `strict`), or a leaf whose dtype or form does not fit.
    """
    problem = model_difference(source.layout, like.layout)
    if problem is not None:
        raise IncompatibleCheckpointError(f"checkpoint from another model: {problem}")
    wanted = [e.key for e in like.entries if select is None or select(e.key)]
    legacy = _legacy_frozen(source, like)
    if "seed" in wanted and "seed" not in source.entries:
        warnings.warn(
            "the checkpoint was written before fzero kept the step's random stream in the state: the resumed run "
            "draws from the new state's seed (fzero.init(seed=...))",
            stacklevel=3,
        )
        wanted.remove("seed")
    if strict:
        converted = {e.key for e in like.entries if e.space == FROZEN} if legacy else set()
        missing = [k for k in wanted if k not in source.entries and k not in converted]
        present = {e.key for e in like.entries} | set(legacy.values())
        extra = [k for k in source.entries if k not in present]
        if missing:
            raise IncompatibleCheckpointError(
                f"the checkpoint lacks leaves the state has: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} (saved with another transform chain?); pass strict=False to "
                "keep the state's own values for them"
            )
        if extra and select is None:
            raise IncompatibleCheckpointError(
                f"the checkpoint has leaves the state lacks: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
                " (saved with another transform chain?); pass strict=False to ignore them"
            )
    for t in like.entries:
        e = source.entries.get(t.key)
        if e is not None and t.key in wanted:
            _check_leaf(source, e, t, like.layout)
    converted = {e.key for e in like.entries if e.space == FROZEN} if legacy else set()
    return {k for k in wanted if k in source.entries or k in converted}


def build_leaves(
    source: Source,
    like: FlatState,
    ranks: Sequence[int],
    *,
    strict: bool = True,
    select: Callable[[str], bool] | None = None,
    keep: Callable[[int, Tensor], Any] | None = None,
) -> list[Any]:
    """The leaves of `like`'s structure, with values from `source`, for this process's `ranks`.

    Args:
      source: the checkpoint (or a state in memory).
      like: the target state, taken apart: keys, forms, dtypes and layout; its values are kept for leaves that are
        not loaded (not selected, or missing with `strict=False`).
      ranks: the target ranks this process holds (all of them on a `SimMesh`, its own on a `DistMesh`).
      strict: every leaf of `like` must be in the source and every leaf of the source in `like`.
      select: load only the leaves whose key it accepts; the others keep `like`'s values.
      keep: `keep(i, value)` is what becomes of leaf `i` once built (default: the value itself); e.g. the value
        written to disk and dropped, so that one leaf at a time is in memory.

    Raises:
      IncompatibleCheckpointError: see `check_compatible` (called first: nothing is read if it raises).
    """
    wanted = check_compatible(source, like, strict=strict, select=select)
    out: list[Any] = []
    for i, (t, like_leaf) in enumerate(zip(like.entries, like.leaves, strict=True)):
        if t.key not in wanted:
            out.append(like_leaf)
            continue
        # new tensors, owned by the state (never a file's mapping, never another state's memory)
        value = torch.empty((len(ranks), *t.shape) if t.world_axis else t.shape, dtype=like_leaf.dtype)
        outs = {r: value[i] for i, r in enumerate(ranks)} if t.world_axis else {ranks[0]: value}
        if t.key not in source.entries:  # a flat frozen leaf from an older checkpoint's per-name leaves
            _fill_legacy_frozen(source, _legacy_frozen(source, like), t, like.layout, outs)
        else:
            fill = _fill_param if t.kind in PARAM_SPACE else _fill_replicated
            fill(source, source.entries[t.key], t, like.layout, outs)
        value = value if like_leaf.device.type == "cpu" else value.to(like_leaf.device)
        out.append(value if keep is None else keep(i, value))
    return out

"""Hyper-parameters per parameter, by name: parameter groups resolved once into segments of a flat buffer.

An optimizer runs on one flat buffer (a rank's shard, or the full buffer) and never sees names. Parameter groups
are given by name and resolved, from the layout, into a **segment table** of the buffer the optimizer updates:
`ends` (ascending exclusive end offsets) and `group` (each segment's group), with each group's hyper-parameter
overrides. The optimizer applies group `k`'s hyper-parameters to the elements of its segments; everything else is
the optimizer's own defaults (group 0 when no rule matched). Padding between parameters joins the segment before
it (it is zero and stays zero under every update here).

Groups are a function of names, never of offsets: a checkpoint does not store them, and the same rules give the
same groups at any world size and stage.

    groups = fzero.param_groups({"*.bias|*norm*": {"weight_decay": 0.0}, "head.*": {"lr": 1e-3}})
    opt = fzero.adamw(3e-4, weight_decay=0.1, groups=groups)

Example:
    >>> from fzero.layout import make_layout
    >>> import torch
    >>> lay = make_layout([("w", (3,), torch.float32), ("b", (2,), torch.float32)], world=1, align=4)
    >>> groups = param_groups({"b": {"weight_decay": 0.0}})
    >>> seg = segments(lay, groups.resolve([leaf.name for leaf in lay.leaves], {"weight_decay"}))
    >>> seg.ends, seg.group, seg.overrides
    ((4, 8), (0, 1), ({}, {'weight_decay': 0.0}))
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..layout import Layout

__all__ = ["ParamGroups", "Resolved", "Segments", "param_groups", "segments"]

Rules = Mapping[str, Mapping[str, Any]]


def _frozen_items(overrides: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Hashable overrides (lists, e.g. betas, as tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()))


@dataclass(frozen=True)
class Resolved:
    """Every parameter's group (`labels`, in the order of the names given) and each group's overrides; group 0 is
    the optimizer's defaults."""

    labels: tuple[int, ...]
    overrides: tuple[tuple[tuple[str, Any], ...], ...]


@dataclass(frozen=True, eq=False)
class ParamGroups:
    """Parameter groups by name (see `param_groups`)."""

    rules: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    fn: Callable[[str], Mapping[str, Any] | None] | None = None
    explicit: tuple[tuple[tuple[str, ...], tuple[tuple[str, Any], ...]], ...] | None = None
    missing: str = "default"

    def resolve(self, names: Sequence[str], allowed: Iterable[str]) -> Resolved:
        """Each name's group and the groups' overrides.

        Raises:
          ValueError: a rule matches no parameter, a parameter matches two rules that set one key to different
            values, a parameter is in two explicit groups (or in none, where that is refused), or a callable's
            value is not a mapping.
          KeyError: an override names a hyper-parameter the optimizer does not have.
        """
        allowed = set(allowed)
        per_name = [self._overrides(name) for name in names] if self.explicit is None else self._explicit(names)
        for name, over in zip(names, per_name, strict=True):
            unknown = sorted(set(over) - allowed)
            if unknown:
                raise KeyError(
                    f"parameter group of {name!r} sets {', '.join(map(repr, unknown))}: not a hyper-parameter of "
                    f"this optimizer (it has {', '.join(sorted(allowed))})"
                )
        if self.rules:
            used = {pattern for pattern, _ in self.rules if any(_match(pattern, n) for n in names)}
            unused = [p for p, _ in self.rules if p not in used]
            if unused:
                raise ValueError(
                    f"param_groups: rule {unused[0]!r} matches no trainable parameter (names look like "
                    f"{', '.join(repr(n) for n in names[:3])}, ...)"
                )
        groups: dict[tuple[tuple[str, Any], ...], int] = {(): 0}
        labels = tuple(groups.setdefault(_frozen_items(over), len(groups)) for over in per_name)
        return Resolved(labels, tuple(groups))

    def _overrides(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for pattern, over in self.rules:
            if not _match(pattern, name):
                continue
            for key, value in over:
                if key in out and out[key] != value:
                    raise ValueError(
                        f"param_groups: parameter {name!r} matches rules {origin[key]!r} and {pattern!r}, which set "
                        f"{key} to {out[key]!r} and {value!r}; make the rules disjoint"
                    )
                out[key], origin[key] = value, pattern
        if self.fn is not None:
            got = self.fn(name)
            if got is not None and not isinstance(got, Mapping):
                raise ValueError(f"param_groups: the function gave {type(got).__name__} for {name!r}, not a dict")
            out.update(got or {})
        return out

    def _explicit(self, names: Sequence[str]) -> list[dict[str, Any]]:
        explicit = self.explicit or ()  # (only called for explicit groups)
        owner: dict[str, int] = {}
        for index, (members, _) in enumerate(explicit):
            for name in members:
                if name in owner:
                    raise ValueError(
                        f"parameter {name!r} is in parameter groups {owner[name]} and {index}: a parameter belongs to "
                        "one group"
                    )
                owner[name] = index
        absent = [n for n in names if n not in owner]
        if absent and self.missing == "error":
            raise ValueError(
                f"parameter {absent[0]!r} (and {len(absent) - 1} more) requires grad but is in no parameter group"
            )
        return [dict(explicit[owner[n]][1]) if n in owner else {} for n in names]


def _match(pattern: str, name: str) -> bool:
    """`fnmatch` of any of the `|`-separated alternatives (`*` matches dots too)."""
    return any(fnmatch.fnmatchcase(name, alt) for alt in pattern.split("|"))


def param_groups(
    rules: Rules | Callable[[str], Mapping[str, Any] | None] | None = None,
    *,
    groups: Sequence[tuple[Iterable[str], Mapping[str, Any]]] | None = None,
    missing: str = "default",
) -> ParamGroups:
    """Hyper-parameters per parameter name, for an optimizer's `groups=`.

    Args:
      rules: `{pattern: {hyper: value}}`, patterns `fnmatch` globs over parameter names with `|` for
        alternatives; a parameter takes the values of every rule it matches (two matching rules must not set one
        key differently); or a function `name -> {hyper: value}` (or None) for anything else, e.g. layer-wise decay.
        Values may be schedules (functions of the applied-update count), like the optimizer's own.
      groups: explicit groups instead, as torch's param groups: `[(names, {hyper: value}), ...]`; a parameter may
        be in one group at most.
      missing: for explicit groups, what a trainable parameter in no group gets: `"default"` (the optimizer's
        own values) or `"error"`.

    Returns:
      The groups, resolved against the layout's names when the optimizer's state is created.
    """
    if groups is not None:
        if rules is not None:
            raise ValueError("param_groups: give rules or groups=, not both")
        if missing not in ("default", "error"):
            raise ValueError(f"param_groups: missing must be 'default' or 'error', got {missing!r}")
        explicit = tuple((tuple(names), _frozen_items(dict(over))) for names, over in groups)
        return ParamGroups(explicit=explicit, missing=missing)
    if callable(rules):
        return ParamGroups(fn=rules)
    if not isinstance(rules, Mapping):
        raise TypeError(f"param_groups: rules must be a dict of pattern -> hyper-parameters or a function, got "
                        f"{type(rules).__name__}")  # fmt: skip
    for pattern, over in rules.items():
        if not isinstance(pattern, str) or not isinstance(over, Mapping):
            raise TypeError(f"param_groups: rule {pattern!r} must map a string pattern to a dict of hyper-parameters")
    return ParamGroups(rules=tuple((p, _frozen_items(dict(o))) for p, o in rules.items()))


@dataclass(frozen=True)
class Segments:
    """A flat buffer cut into runs of one group each: segment `i` covers `[ends[i-1], ends[i])` (from 0) and has
    group `group[i]`, whose hyper-parameter overrides are `overrides[group[i]]`."""

    ends: tuple[int, ...]
    group: tuple[int, ...]
    overrides: tuple[dict[str, Any], ...]

    @property
    def numel(self) -> int:
        return self.ends[-1] if self.ends else 0

    def tensors(self) -> tuple[Tensor, Tensor]:
        """`(ends, group)` as int64 tensors (what the native kernel takes)."""
        return _as_tensors(self.ends, self.group)

    def pieces(self) -> dict[int, list[tuple[int, int]]]:
        """For each group, its `(start, stop)` ranges."""
        out: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for end, g in zip(self.ends, self.group, strict=True):
            if end > start:
                out.setdefault(g, []).append((start, end))
            start = end
        return out

    def slice(self, start: int, stop: int) -> Segments:
        """The table of elements `[start, stop)`, offsets relative to `start`."""
        ends: list[int] = []
        group: list[int] = []
        lo = 0
        for end, g in zip(self.ends, self.group, strict=True):
            a, b = max(lo, start), min(end, stop)
            if b > a or (not ends and start == stop):
                ends.append(b - start if b > a else 0)
                group.append(g)
            lo = end
        return Segments(tuple(ends) or (0,), tuple(group) or (0,), self.overrides)


@functools.lru_cache(maxsize=256)
def _as_tensors(ends: tuple[int, ...], group: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    return torch.tensor(ends, dtype=torch.int64), torch.tensor(group, dtype=torch.int64)


def _runs(layout: Layout, labels: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """`(end, group)` runs over the full buffer's range `[lo, hi)`, offsets relative to `lo`; padding joins the run
    before it (or the first parameter's group when the range starts with padding)."""
    runs: list[tuple[int, int]] = []
    for leaf, g in sorted(zip(layout.leaves, labels, strict=True), key=lambda x: x[0].offset):
        a, b = max(leaf.offset, lo), min(leaf.offset + leaf.numel, hi)
        if b <= a:
            continue
        if runs and runs[-1][1] == g:
            runs[-1] = (b - lo, g)
        else:
            if runs:
                runs[-1] = (a - lo, runs[-1][1])  # padding before this leaf ends the previous run here
            runs.append((b - lo, g))
    if not runs:
        return [(hi - lo, 0)]
    runs[-1] = (hi - lo, runs[-1][1])
    return runs


@functools.lru_cache(maxsize=256)
def _segments(layout: Layout, resolved: Resolved, full: bool, ranks: tuple[int, ...]) -> Segments:
    ends: list[int] = []
    group: list[int] = []
    base = 0
    for rank in ranks:
        if full:
            runs = _runs(layout, resolved.labels, 0, layout.numel)
            size = layout.numel
        else:
            runs, size = [], 0
            for u in layout.units:
                c = u.size // layout.world
                lo = u.start + rank * c
                runs += [(e + size, g) for e, g in _runs(layout, resolved.labels, lo, lo + c)]
                size += c
        for e, g in runs:
            if group and group[-1] == g:
                ends[-1] = base + e
            else:
                ends.append(base + e)
                group.append(g)
        base += size
    return Segments(tuple(ends), tuple(group), tuple(dict(o) for o in resolved.overrides))


def segments(layout: Layout, resolved: Resolved, *, full: bool = True, ranks: Sequence[int] = (0,)) -> Segments:
    """The segment table of the buffer an optimizer updates: the full buffer (`full`) or a shard, of each rank in
    `ranks` end to end (a `SimMesh`'s `[world, n]` buffer is all ranks' buffers end to end). Cached."""
    return _segments(layout, resolved, full, tuple(ranks))

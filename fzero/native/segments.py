"""Per-group hyper-parameters and segment tables for `adam_step(..., segments=(ends, group))`.

A segment table cuts the flat buffer into runs: segment `s` is the elements `[ends[s-1], ends[s])` (`ends[-1]`
read as 0) and uses group `group[s]`'s hyper-parameters. Here: the table's conversion to int64 tensors, its checks
(the kernel checks it again in C, before it writes anything), and the per-group values' shape.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard

import torch
from torch import Tensor

__all__ = ["PerGroup", "PerGroupValues", "Segments", "check_table", "per_group", "segment_arrays", "slice_segments"]

PerGroup = float | Sequence[float]
"""A hyper-parameter for `adam_step(..., segments=...)`: one float for every group, or one per group."""
Segments = tuple[Tensor | Sequence[int], Tensor | Sequence[int]]
"""`(ends, group)`: the exclusive end offset of each segment (non-decreasing, the last one the buffer's length) and
the group index of each segment (1-D integer CPU tensors, or sequences of ints)."""


def is_sequence(x: object) -> TypeGuard[Sequence[Any] | Tensor]:
    """Whether `x` gives one value per group (a sequence other than a string, or a 1-D tensor)."""
    if type(x) in (float, int, list, tuple):  # the common cases, without the ABC checks below
        return type(x) in (list, tuple)
    return (isinstance(x, Sequence) and not isinstance(x, str)) or (isinstance(x, Tensor) and x.ndim == 1)


class PerGroupValues(NamedTuple):
    """What `per_group` finds in a call's hyper-parameters."""

    ngroups: int | None
    """The number of groups the per-group sequences give; None when every value is one number for all groups."""
    first: str | None
    """The name of the first per-group value (for the messages); None with `ngroups`."""
    rows: list[tuple[Any, ...]]
    """Each group's values, in the order of the names given."""


def per_group(where: str, values: Mapping[str, object]) -> PerGroupValues:
    """The groups that the per-group sequences among `values` give (their lengths must agree), and each group's
    values: a per-group entry as a Python float (so `adam_hyper` computes in double, as for a float given to an
    ungrouped call), a shared value as given (exactly what an ungrouped call receives).

    Args:
      where: the calling function's name, for the messages.
      values: the hyper-parameters by name, each a number or a sequence with one number per group.

    Returns:
      `PerGroupValues(ngroups, first, rows)`, one row per group (one row when no value is per group).

    Raises:
      TypeError: a per-group entry is not a real number. ValueError: an empty sequence, or lengths that differ.
    """
    ngroups: int | None = None
    first: str | None = None
    for name, x in values.items():
        if not is_sequence(x):
            continue
        if len(x) == 0:
            raise ValueError(f"{where}: {name} is an empty sequence; expected a float or one float per group")
        for i, item in enumerate(x):
            if type(item) is float:  # the common case, without the ABC check below
                continue
            if isinstance(item, bool) or not isinstance(item, numbers.Real | Tensor):
                raise TypeError(f"{where}: {name}[{i}] is {item!r}; expected a float (one per group)")
        if ngroups is None:
            ngroups, first = len(x), name
        elif len(x) != ngroups:
            raise ValueError(f"{where}: {name} has {len(x)} values but {first} has {ngroups}: per-group "
                             "hyper-parameters need one value per group each")  # fmt: skip
    columns = [[float(i) for i in x] if is_sequence(x) else [x] * (ngroups or 1) for x in values.values()]
    return PerGroupValues(ngroups, first, list(zip(*columns, strict=True)))


def index_tensor(where: str, name: str, x: object) -> Tensor:
    """`x` (a 1-D integer tensor or a sequence of ints) as a contiguous int64 CPU tensor (no copy if it is one).

    Raises:
      TypeError: not integers. ValueError: not one dimension, or not on the CPU.
    """
    if isinstance(x, Tensor) and x.dtype == torch.int64 and x.ndim == 1 and x.device.type == "cpu":
        return x.contiguous()  # the common case (a table built once), with the fewest tensor attribute reads
    if isinstance(x, Tensor):
        t = x
    elif is_sequence(x):
        t = torch.tensor(list(x)) if len(x) else torch.zeros(0, dtype=torch.int64)
    else:
        raise TypeError(f"{where}: segments {name} must be a 1-D integer tensor or a sequence of ints, got "
                        f"{type(x).__name__}")  # fmt: skip
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{where}: segments {name} has dtype {t.dtype}; expected integers")
    if t.ndim != 1:
        raise ValueError(f"{where}: segments {name} has shape {tuple(t.shape)}; expected one dimension")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: segments {name} is on {t.device}; expected a CPU tensor")
    return t.to(torch.int64).contiguous()


def segment_arrays(where: str, segments: object) -> tuple[Tensor, Tensor]:
    """`segments` as `(ends, group)`, contiguous int64 CPU tensors of equal length (contents not checked).

    Raises:
      TypeError: not a pair of integer arrays. ValueError: arrays of different lengths (or see `index_tensor`).
    """
    if not isinstance(segments, Sequence) or len(segments) != 2:
        raise TypeError(f"{where}: segments must be a pair (ends, group), got {type(segments).__name__}")
    ends, group = index_tensor(where, "ends", segments[0]), index_tensor(where, "group", segments[1])
    if group.numel() != ends.numel():
        raise ValueError(f"{where}: segments group has {group.numel()} entries but ends has {ends.numel()}: one "
                         "group index per segment")  # fmt: skip
    return ends, group


def check_table(where: str, ends: Tensor, group: Tensor, n: int, ngroups: int | None, first: str | None) -> None:
    """Raise ValueError naming the first fault of the segment table `(ends, group)` for a buffer of `n` elements
    and `ngroups` groups (None: any non-negative group index); the same rules as the kernel's own check.

    Args:
      where: the calling function's name, for the messages.
      ends, group: the table, as `segment_arrays` gives it.
      n: the buffer's length.
      ngroups: the number of groups the hyper-parameters give, None if they give one value for all.
      first: the hyper-parameter that gave `ngroups` (named in the message for a group out of range).
    """
    if ends.numel() == 0:
        if n:
            raise ValueError(f"{where}: segments has no segments, but params has {n} elements (the last end must "
                             f"be {n})")  # fmt: skip
        return
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    bad = torch.nonzero(ends < starts)
    if bad.numel():
        i = int(bad[0])
        if i == 0:
            raise ValueError(f"{where}: segments ends[0] = {int(ends[0])} is negative")
        raise ValueError(f"{where}: segments ends must be non-decreasing, but ends[{i}] = {int(ends[i])} follows "
                         f"ends[{i - 1}] = {int(ends[i - 1])}")  # fmt: skip
    if int(ends[-1]) != n:
        raise ValueError(f"{where}: segments end at {int(ends[-1])}, but params has {n} elements (the last end "
                         "must be the buffer's length)")  # fmt: skip
    low = int(group.min())
    high = int(group.max())
    if low < 0:
        i = int(torch.nonzero(group < 0)[0])
        raise ValueError(f"{where}: segments group[{i}] = {int(group[i])} is negative")
    if ngroups is not None and high >= ngroups:
        i = int(torch.nonzero(group >= ngroups)[0])
        raise ValueError(f"{where}: segments group[{i}] = {int(group[i])} is out of range: the hyper-parameters "
                         f"give {ngroups} groups ({first} has {ngroups} values)")  # fmt: skip


def slice_segments(segments: Segments, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """The segment table of the elements `[start, stop)` of the buffer `segments` describes, with offsets relative
    to `start`: what `adam_step(..., segments=...)` needs for a piece of a flat buffer (e.g. one pipelined piece
    of an offloaded shard).

    Args:
      segments: `(ends, group)` as for `adam_step` (the table is not validated here).
      start, stop: `0 <= start <= stop <= ends[-1]`.

    Returns:
      `(ends, group)`, int64 tensors: the segments that intersect `[start, stop)` (a single empty one when
      `start == stop`), their ends clipped to `stop` and shifted by `-start`.

    Raises:
      ValueError: `start`, `stop` outside the table.
    """
    ends, group = (index_tensor("slice_segments", k, x) for k, x in zip(("ends", "group"), segments, strict=True))
    total = int(ends[-1]) if ends.numel() else 0
    if not 0 <= start <= stop <= total:
        raise ValueError(f"slice_segments: need 0 <= start <= stop <= {total} (the table's length), got start "
                         f"{start}, stop {stop}")  # fmt: skip
    first = int(torch.searchsorted(ends, start, right=True)) if start < total else max(ends.numel() - 1, 0)
    last = int(torch.searchsorted(ends, stop, right=False)) if stop > start else first
    sub_ends = ends[first : last + 1].clamp(max=stop) - start
    return sub_ends, group[first : last + 1].clone()

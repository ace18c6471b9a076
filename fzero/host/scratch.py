"""Large step-sized buffers reused from one step to the next, each only while nothing else holds it.

A step needs a few buffers as large as the model or its shard, whose values never outlive it: the full buffer that
stages 1-2 gather the parameters into, the gradient (shard) the reduction assembles. Allocated afresh each step, a
block that size is a mapping of its own (glibc maps every block of 32 MiB or more and unmaps it on `free`), so its
pages fault in again, zero-filled by the kernel, every step: DDP keeps its gradient buckets instead, and torch's
CUDA caching allocator does the same on a GPU. `new_empty` keeps one buffer per slot (a purpose, shape, dtype and
device) and hands it out again, but only when no tensor other than the slot's own refers to its storage (torch's
storage use count): a buffer that anything still holds (a transform that kept the gradient in its state, an
autograd graph that saved it, a collective in flight) is never handed out twice; the slot then gets a fresh one.
What a step reads from a handed-out buffer it has written first, so its values are the same whether the buffer is
fresh or reused (`poisoned()` fills every buffer with NaN to prove it).

The slots hold their buffers between steps, as DDP holds its buckets: `clear()` (or
`fzero.hostmem.release_freed_memory()`) lets them go.

Example:
    >>> import torch
    >>> like = torch.zeros(1)
    >>> a = new_empty("example", like, (1 << 20,))
    >>> ptr = a.data_ptr()
    >>> b = new_empty("example", like, (1 << 20,))   # `a` still holds the first one: a second buffer
    >>> b.data_ptr() != ptr
    True
    >>> del a, b
    >>> new_empty("example", like, (1 << 20,)).data_ptr() == new_empty("example", like, (1 << 20,)).data_ptr()
    True
    >>> clear()
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "clear", "disabled", "new_empty", "poisoned"]

MIN_BYTES = 1 << 20
"""Smaller buffers are left to the allocator, which serves them from its heap without faults."""

_slots: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], Tensor] = {}
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (private; where absent, nothing is reused)
_reuse, _poison = True, False


def _holders(x: Tensor) -> tuple[int, int]:
    """The users of `x`'s storage (its tensors, and the storage object asked for here) and the references to that
    storage object (a Python one held elsewhere adds one, but no use: torch keeps one object per storage)."""
    storage = x.untyped_storage()
    return (_use_count(storage._cdata) if _use_count is not None else 0), sys.getrefcount(storage)


@functools.cache
def _alone() -> tuple[int, int]:
    """What an unshared tensor's storage counts in this torch (asked once, at the first reuse: not on import, which
    must allocate nothing before `fzero.hostmem.enable_huge_pages`)."""
    return _holders(torch.empty(1))


def _free(kept: Tensor) -> bool:
    """Whether nothing but the slot's own tensor holds `kept`'s storage."""
    uses, refs = _holders(kept)
    alone = _alone()
    return uses <= alone[0] and refs <= alone[1]


def new_empty(slot: str, like: Tensor, shape: Sequence[int]) -> Tensor:
    """An uninitialised buffer of `shape` with `like`'s dtype and device, reused from an earlier call for the same
    slot when nothing holds that one any more (module docstring).

    Args:
      slot: what the buffer is for (the gathered parameters, the gradient shard, ...): buffers of one purpose
        share their slots.
      like: a tensor whose dtype and device the buffer takes.
      shape: the buffer's shape.

    Returns:
      A tensor of its own (not a view: no `_base`) on the slot's storage, or a fresh one under `MIN_BYTES`, under
      `disabled()` or where torch cannot count a storage's users.
    """
    shape = tuple(shape)
    if not _reuse or _use_count is None or math.prod(shape) * like.element_size() < MIN_BYTES:
        out = like.new_empty(shape)
    else:
        key = (slot, shape, like.dtype, like.device)
        kept = _slots.get(key)
        if kept is None or not _free(kept):
            kept = _slots[key] = like.new_empty(shape)
        out = like.new_empty(0).set_(kept.untyped_storage(), 0, shape, kept.stride())
    if _poison and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def clear() -> None:
    """Let every slot's buffer go (freed once nothing else holds it)."""
    _slots.clear()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within: every buffer fresh (nothing reused), as without this module."""
    global _reuse
    before, _reuse = _reuse, False
    try:
        yield
    finally:
        _reuse = before


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within: every floating buffer handed out filled with NaN, so a step that read one before writing it would
    show NaN in its results (the tests' proof that reuse changes no value)."""
    global _poison
    before, _poison = _poison, True
    try:
        yield
    finally:
        _poison = before

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

Stage 3's gathered units need the other kind of reuse: each unit's buffer is emptied after its forward and filled
again for its backward under the very storage autograd saved views of (FSDP's technique), so it cannot be a slot's
buffer handed out anew. `empty(storage)` takes the memory out of such a storage and keeps it as a spare; `refill`
gives an emptied storage a spare of at least its size (torch's `_swap_data_ptr_`: the storage object, and every
view of it, stays; only the memory behind it changes), or a fresh mapping of its own where none fits. Freed to the
heap and allocated afresh instead, each unit's buffer took fresh pages every gather: glibc serves a 64-byte-aligned
block of a freed block's own size only from new memory (`fzero.host.heap`), so the heap grew by a unit's size a
gather through the first steps and kept it (stage 3's peak above stage 2's, its step slower, in
`benchmarks/stage3_memory.py`). The spares never hold more than the most memory lent out at once (the smallest
spares go first when a fresh block makes them too many). Those under `KEPT_BELOW` stay from step to step; larger
ones go once a step's units are released (`drop_spares`: the update's peak does not carry them), and every one with
`clear()`, their mappings back to the system at once.

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
import mmap
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "HUGE_PAGE", "KEPT_BELOW", "MIN_BYTES", "PASSING", "clear", "disabled", "drop_spares", "empty", "mapped_storage",
    "new_empty", "poisoned", "refill",
]  # fmt: skip

MIN_BYTES = 1 << 20
"""Smaller buffers are left to the allocator, which serves them from its heap without faults."""

_slots: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], Tensor] = {}
_passing: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], list[Tensor]] = {}  # `passing=True` slots
PASSING = 4
"""The most buffers a `passing` slot keeps (the reductions in flight at once, and one more)."""
KEPT_BELOW = 32 << 20
"""Spares and `passing` buffers smaller than this are kept from one step to the next (each step would fault them in
afresh: 15-18% of a 27.3M model's step at stages 2-3 on 2 ranks, measured); larger ones go when a step's units are
released (`drop_spares`), so the update's peak does not carry them, and are mapped afresh the next step, on huge
pages (`mapped_storage`: 16 faults per 32 MiB where 4 KiB pages take 8192). glibc's malloc maps and unmaps every
block this large itself (its largest mmap threshold on 64-bit), on 4 KiB pages unless asked otherwise."""
HUGE_PAGE = 2 << 20
"""A transparent huge page on x86-64 and most arm64 kernels: `mapped_storage` aligns its large mappings to it."""
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (private; where absent, nothing is reused)
_reuse, _poison = True, False
_swap: Any = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)  # (private; absent: emptied storages freed)
_spares: dict[torch.device, list[torch.UntypedStorage]] = {}
_lent: dict[int, tuple[torch.device, int]] = {}  # address -> (device, bytes) of spare memory lent to storages now
_most: dict[torch.device, int] = {}  # the most bytes lent at once


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


def new_empty(slot: str, like: Tensor, shape: Sequence[int], passing: bool = False) -> Tensor:
    """An uninitialised buffer of `shape` with `like`'s dtype and device, reused from an earlier call for the same
    slot when nothing holds that one any more (module docstring).

    Args:
      slot: what the buffer is for (the gathered parameters, the gradient shard, ...): buffers of one purpose
        share their slots.
      like: a tensor whose dtype and device the buffer takes.
      shape: the buffer's shape.
      passing: a buffer that lives a moment, several at once (a unit's reduction, while others are in flight): the
        slot keeps up to `PASSING` of them, each handed out while nothing else holds it; those of `KEPT_BELOW` bytes
        or more go at the end of the step's units (`drop_spares`), the others stay from step to step.

    Returns:
      A tensor of its own (not a view: no `_base`) on the slot's storage, or a fresh one under `MIN_BYTES`, under
      `disabled()` or where torch cannot count a storage's users.
    """
    shape = tuple(shape)
    if not _reuse or _use_count is None or math.prod(shape) * like.element_size() < MIN_BYTES:
        out = like.new_empty(shape)
    else:
        key = (slot, shape, like.dtype, like.device)
        if passing:
            kept_ones = _passing.setdefault(key, [])
            kept = next((k for k in kept_ones if _free(k)), None)
            if kept is None:  # (on the host, a mapping of its own: dropped, it goes back to the system at once)
                n = math.prod(shape) * like.element_size()
                mapped = like.device.type == "cpu"
                strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # (contiguous)
                kept = like.new_empty(0).set_(mapped_storage(n), 0, shape, strides) if mapped else like.new_empty(shape)
                if len(kept_ones) < PASSING:
                    kept_ones.append(kept)
        else:
            kept = _slots.get(key)
            if kept is None or not _free(kept):
                kept = _slots[key] = like.new_empty(shape)
        out = like.new_empty(0).set_(kept.untyped_storage(), 0, shape, kept.stride())
    if _poison and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def _spared(device: torch.device, nbytes: int) -> bool:
    """Whether a storage of `nbytes` on `device` takes spare memory: host memory (a GPU's caching allocator reuses
    its blocks itself) of at least `MIN_BYTES`, with reuse on and torch able to swap a storage's memory."""
    return _reuse and _swap is not None and device.type == "cpu" and nbytes >= MIN_BYTES


def refill(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give the emptied `storage` (0 bytes) at least `nbytes` of memory: the smallest spare that fits, or fresh.

    Args:
      storage: a storage holding no memory (new, or `empty`-ed), which every view of it keeps referring to.
      nbytes: the bytes it needs; its values are undefined (NaN-filled under `poisoned()`) until written.
    """
    device = storage.device
    if not _spared(device, nbytes):
        storage.resize_(nbytes)
    else:
        spares = _spares.setdefault(device, [])
        fits = [s for s in spares if s.nbytes() >= nbytes]
        if fits:
            spare = min(fits, key=lambda s: s.nbytes())
            spares.remove(spare)
        else:
            spare = mapped_storage(nbytes)
        _lent[spare.data_ptr()] = (device, spare.nbytes())
        _swap(storage, spare)  # `storage` gets the memory; `spare`, now empty, goes
        lent = _lent_on(device)
        _most[device] = most = max(_most.get(device, 0), lent)
        spares.sort(key=lambda s: s.nbytes())
        while spares and sum(s.nbytes() for s in spares) + lent > most:
            spares.pop(0)  # a fresh block made them too many: the smallest serve the fewest units
    if _poison:
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage).fill_(255)  # NaN in every float dtype


def mapped_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of host memory in a mapping of its own (unmapped once the last storage holding it goes: never a
    hole in the heap), where the platform has private anonymous mappings; else the allocator's.

    From `HUGE_PAGE` bytes on, the storage starts on a 2 MiB boundary and its whole 2 MiB pages are asked for as
    transparent huge pages (`madvise(MADV_HUGEPAGE)`, this mapping's alone: no process-wide setting; nothing where
    the kernel's `transparent_hugepage/enabled` is `never`). A fresh mapping's pages fault in on first touch, and
    those of the step's large buffers do every step (those `drop_spares` let go): 32 MiB written into a fresh mapping
    took 24 ms on 4 KiB pages (8192 faults) and 6 ms on huge pages (16) on a Zen 3 (`docs/performance.md`). The
    partial page at the end stays on 4 KiB pages, so no byte past `nbytes` becomes resident."""
    if not hasattr(mmap, "MAP_PRIVATE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8).untyped_storage()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)  # (the bytes before the boundary are never touched)
    at = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # (a kernel without transparent huge pages: 4 KiB pages, as before)
        region.madvise(advice, at, nbytes - nbytes % HUGE_PAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=at).untyped_storage()


def empty(storage: torch.UntypedStorage) -> None:
    """Take `storage`'s memory back (it then holds 0 bytes, every view of it still referring to it): kept as a
    spare for `refill` when it came from one, else freed.

    Args:
      storage: a storage given its memory by `refill` (or any other, whose memory is then freed).
    """
    if not storage.nbytes():
        return
    if _lent.pop(storage.data_ptr(), None) is None or _swap is None:
        storage.resize_(0)
        return
    spare = torch.UntypedStorage(0, device=storage.device)
    _swap(storage, spare)
    _spares.setdefault(storage.device, []).append(spare)


def _lent_on(device: torch.device) -> int:
    """The bytes of spare memory lent on `device` now."""
    return sum(n for d, n in _lent.values() if d == device)


def drop_spares(at_least: int = 0) -> None:
    """Let the spares and the `passing` slots' buffers of at least `at_least` bytes go (their memory back to the
    system at once: `refill` maps each afresh); what storages hold now stays lent.

    Args:
      at_least: the smallest size dropped (0: every one). The end of a step drops those of `KEPT_BELOW` or more.
    """
    if not at_least:
        _spares.clear()
        _most.clear()
        _passing.clear()
        return
    for spares in _spares.values():
        spares[:] = [s for s in spares if s.nbytes() < at_least]
    for kept in _passing.values():
        kept[:] = [k for k in kept if k.untyped_storage().nbytes() < at_least]


def clear() -> None:
    """Let every slot's buffer and every spare go (freed once nothing else holds them)."""
    _slots.clear()
    drop_spares()


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

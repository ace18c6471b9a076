"""Handing the pages of freed heap blocks back to the kernel while a construction frees large blocks one after another.

A construction that makes each large tensor whole, keeps a piece of it and frees the rest (`zero.Init`: each
parameter made by its module, this rank's partition kept, rank 0's values received a chunk at a time; `fzero.init`
from such a model: each unit gathered, its shard kept) frees as much as it builds, yet glibc's heap keeps most of it
resident. After the first free of a block it had mapped, glibc raises its mapping threshold to that block's size, so
the later large tensors come from its heap; torch allocates each one 64-byte aligned (`posix_memalign`), which asks
glibc for the size plus 64 plus a minimum chunk, so a freed block of exactly a tensor's size never holds the next
tensor of that size; and the small pieces split off to align each block, soon taken by small allocations that stay
(tensors' and modules' objects, torch.distributed's record of each collective), keep neighbouring freed blocks from
merging. Each freed block stays a resident hole and the next tensor takes fresh pages. Measured with
`benchmarks/zero_init.py` (16 layers, d 512, 2 ranks, glibc's default settings): a rank's resident set grew by
109-249 MiB under `zero.Init` for 97 MiB of partitions (by how far the process had raised the threshold before),
the heap walked chunk by chunk a row of freed 256 KiB and 4 MiB blocks, each pinned by one ~100-byte block in use;
moving the partitions out of the heap (their own memory maps) did not help (225 MiB): the holes are pinned by the
small blocks, not by the partitions.

`HeapRelease` counts the bytes the construction frees and, every `every` bytes, asks glibc to hand the free pages
back (`malloc_trim(0)`, which since glibc 2.8 releases the whole free pages inside freed blocks too, not only the
heap's top): the holes stay in the address space, their pages go, so the resident set follows what is held (the
same construction: 102 MiB, its partitions plus the largest module's own parameters plus 1-1.5 MiB of objects). It
changes no allocator setting (no `mallopt`, no environment variable) and does nothing off glibc; a release walks
the heap's free blocks (146 of them cost 0.06 s in all on that construction).
"""

from __future__ import annotations

from .hostmem import trim_heap

__all__ = ["EVERY", "HeapRelease"]

EVERY = 2 << 20
"""By default the free pages are handed back each time this many bytes more have been freed."""


class HeapRelease:
    """Hands the free pages of the C heap back to the kernel each time `every` bytes more were freed (module
    docstring).

    Args:
      every: how many freed bytes to let accumulate between two releases (each walks the heap's free blocks).

    Example:
        >>> heap = HeapRelease(every=1 << 20)
        >>> heap.freed(1 << 19)   # not yet
        >>> heap.pending
        524288
        >>> heap.freed(1 << 19)   # 1 MiB: released (where glibc is), the count starts again
        >>> heap.pending
        0
    """

    def __init__(self, every: int = EVERY) -> None:
        self.every = every
        self.pending = 0  # bytes freed since the last release

    def freed(self, nbytes: int) -> None:
        """Count `nbytes` freed; release the free pages once `every` bytes have been counted."""
        self.pending += nbytes
        if self.pending >= self.every:
            self.release()

    def release(self) -> bool:
        """Hand the free pages back now.

        Returns:
          Whether any memory was released (False off glibc).
        """
        self.pending = 0
        return trim_heap()

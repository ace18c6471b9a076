"""Large host buffers on transparent huge pages: a fresh buffer faults in 2 MiB at a time, not 4 KiB.

A training step allocates its large buffers afresh every step (the gathered parameters, each unit's gradient, the
reduction's receive and sum buffers, the assembled gradient shard). glibc serves each block of 32 MiB or more with
a `mmap` of its own and unmaps it on `free`, so every step maps them again and each 4 KiB page faults in again,
zero-filled by the kernel, on first touch: a fresh 27.3M-element fp32 buffer took 70 ms to fill on this project's
reference machine (26,664 page faults) against 14 ms on huge pages (93 faults), and fzero's sharded steps ran
1.3x slower than DDP's (which keeps its gradient buckets) for that alone (docs/performance.md).

torch's CPU allocator puts every block of 2 MiB or more on transparent huge pages (2 MiB aligned, `madvise(...,
MADV_HUGEPAGE)`) when the environment says `THP_MEM_ALLOC_ENABLE=1`. It reads that variable once, at the process's
first large allocation, so `import fzero` sets it (unless it is set already: `THP_MEM_ALLOC_ENABLE=0` opts out);
import fzero before building large tensors, or export the variable. The peak resident memory is unchanged (the
1.5 GB stage-3 memory test: 3,873 MiB either way); the kernel must allow `madvise` huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`, the usual default).
"""

from __future__ import annotations

import os

__all__ = ["huge_pages"]

_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages (see the module docstring); returns whether it is asked.

    Effective only before the process's first allocation of 2 MiB or more; importing this module (so `import
    fzero`) calls it.

    Example:
        >>> huge_pages() == (os.environ["THP_MEM_ALLOC_ENABLE"] == "1")
        True
    """
    os.environ.setdefault(_VARIABLE, "1")
    return os.environ[_VARIABLE] == "1"


huge_pages()  # on import: before the process's first large allocation, which fixes torch's choice

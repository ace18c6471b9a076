"""Large host buffers: on transparent huge pages, and kept in the process from one step to the next.

A training step allocates large buffers afresh every step (autograd's gradients, each unit's gradient, the
reduction's receive buffers; stage 3's gathered units and gradient shard; fzero's own step-sized buffers of stages
0-2, the gathered parameters and the assembled gradient, it keeps itself: `fzero.scratch`). glibc serves each block
of 32 MiB or more with a `mmap` of its own and unmaps it on `free`, so every step maps them again and each 4 KiB page
faults in again, zero-filled by the kernel, on first touch: a fresh 27.3M-element fp32 buffer took 70 ms to fill on
this project's reference machine (26,664 page faults) against 14 ms on huge pages (93 faults), and fzero's sharded
steps ran 1.3x slower than DDP's (which keeps its gradient buckets) for that alone (docs/performance.md). Two
remedies for all of them, each the process's choice, so each asked for explicitly (`import fzero` changes nothing):

**Huge pages** (`enable_huge_pages`). torch's CPU allocator puts every block of 2 MiB or more on transparent huge
pages (2 MiB aligned, `madvise(..., MADV_HUGEPAGE)`) when the environment says `THP_MEM_ALLOC_ENABLE=1`. It reads
that variable once, in its first allocation of any size (`c10::alloc_cpu`, which keeps the answer in a
function-local static for the life of the process); `import torch` alone allocates nothing through it. So the choice
is made before the process's first CPU tensor: call `enable_huge_pages()` at the top of the training script, right
after the imports, or export `THP_MEM_ALLOC_ENABLE=1` (`=0` opts out, and `enable_huge_pages` respects it). A later
call only sets the variable for the child processes started after it. The peak resident memory is unchanged (the
1.5 GB stage-3 memory test: 3,873 MiB either way); the kernel must allow `madvise` huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`, the usual default).

**Freed memory kept** (`retain_freed_memory`). Huge pages make a fault cheaper; keeping what a step frees in glibc's
heap removes the faults: the next step's buffers of the same sizes reuse the pages already mapped, as DDP reuses its
buckets and as torch's CUDA caching allocator does on a GPU. glibc is told (`mallopt`) to serve blocks up to 1 GiB
from its heap rather than a mapping of their own (`M_MMAP_THRESHOLD`) and not to hand the heap's free top back to
the kernel below 2 GiB (`M_TRIM_THRESHOLD`), which also stops its threshold from moving with the sizes freed. The
resident memory then stays at the step's peak between steps instead of dipping, and the peak itself may rise, as
blocks that had mappings of their own now share one heap with its gaps (docs/performance.md, fp32: fzero's 5-12%,
FSDP2's 8%, DeepSpeed's 18%, DDP's 1%; bf16: -7% to +1%), for fzero's steps 1.05-1.25x DDP's before, 0.96-1.10x
after. Takes effect from the next allocation on: call it any time before the training loop. `release_freed_memory()`
hands the heap's free memory back (glibc's `malloc_trim`), e.g. after training.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from . import scratch

__all__ = [
    "VARIABLE",
    "enable_huge_pages",
    "huge_pages_requested",
    "release_freed_memory",
    "retain_freed_memory",
    "trim_heap",
]

VARIABLE = "THP_MEM_ALLOC_ENABLE"
"""The environment variable torch's CPU allocator reads."""


def enable_huge_pages() -> bool:
    """Ask torch's CPU allocator for transparent huge pages: sets `THP_MEM_ALLOC_ENABLE=1` unless it is set already.

    Takes effect only if called before the process allocates its first CPU tensor (of any size; see the module
    docstring): at the top of a script, before the model is built. Called later, it changes nothing for this
    process (torch has read the variable) but still sets it for child processes started after it.

        import fzero
        fzero.hostmem.enable_huge_pages()  # before any tensor is made
        model = build_model()

    Returns:
      Whether the environment asks for huge pages now: False where the user opted out with
      `THP_MEM_ALLOC_ENABLE=0`.
    """
    os.environ.setdefault(VARIABLE, "1")
    return huge_pages_requested()


def huge_pages_requested() -> bool:
    """Whether the environment asks torch's CPU allocator for huge pages (`THP_MEM_ALLOC_ENABLE=1`); changes nothing.

    Returns:
      True when the variable is `1`. Whether torch follows it depends on when it first allocated (module docstring).

    Example:
      >>> huge_pages_requested() == (os.environ.get("THP_MEM_ALLOC_ENABLE") == "1")
      True
    """
    return os.environ.get(VARIABLE) == "1"


# mallopt's parameters (glibc's malloc.h) and the values `retain_freed_memory` sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, MMAP_THRESHOLD_CAP, TRIM_THRESHOLD = 1 << 30, 32 << 20, (1 << 31) - 1
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
"""glibc's own environment variables for the same settings: where one is set, the user has chosen."""


def retain_freed_memory() -> bool:
    """Keep the host memory a step frees in the process, for the next step's buffers (glibc's malloc; module
    docstring): blocks up to 1 GiB come from the heap, not a mapping of their own unmapped on `free`, and the heap's
    free top stays mapped up to 2 GiB.

    Leaves glibc alone where the environment already tunes it (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
    `MALLOC_TOP_PAD_`, or `glibc.malloc.` in `GLIBC_TUNABLES`). A glibc that refuses a 1 GiB threshold (older ones cap
    it at 32 MiB) gets the cap.

        import fzero
        fzero.hostmem.enable_huge_pages()
        fzero.hostmem.retain_freed_memory()

    Returns:
      Whether glibc took both settings: False off glibc (musl's `mallopt` does nothing; macOS has none) or where the
      environment has chosen.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(os.environ.get(name) for name in MALLOC_VARIABLES) or "glibc.malloc." in tunables:
        return False
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_CAP) == 1
    return mapped and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def release_freed_memory() -> bool:
    """Hand the free memory glibc's heap holds back to the kernel (`malloc_trim(0)`), e.g. after the training loop
    under `retain_freed_memory`, after letting go of the buffers fzero keeps for its next step (`fzero.scratch`);
    changes no setting.

    Returns:
      Whether any memory was released (False off glibc).
    """
    scratch.clear()
    return trim_heap()


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)` alone: the free pages of its heap handed back (whole free pages inside freed blocks
    too, not only the heap's top); changes no setting.

    Returns:
      Whether any memory was released (False off glibc).
    """
    trim = _libc("malloc_trim")
    return trim is not None and trim(0) == 1


def _libc(name: str) -> Callable[..., int] | None:
    """The process's C library function `name` (int arguments and result), or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn

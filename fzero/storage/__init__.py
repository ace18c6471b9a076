"""The storage layer under NVMe offload (ZeRO-Infinity's swap): files, aligned buffers, threads, checksums.

Offload keeps state that does not fit in host memory in scratch files between its uses. This package is the
bottom of that: it moves bytes between host buffers and files, and knows nothing of models, optimizers or ranks
(of fzero it imports only `fzero.host`, the layer under everything).

- `SwapFile` (swapfile.py): one preallocated file of named regions, each at a 4096-aligned offset, in the
  safetensors layout, so `safetensors.safe_open` can read a swap file like any checkpoint. Preallocation makes a
  disk too small for the run fail at creation (`StorageFullError`), never in the middle of a step.
- `aligned_empty`, `round_up`, `ALIGN` (aligned.py): O_DIRECT, which bypasses the page cache so streaming the
  state does not evict everything else, needs the buffer address, the offset and the length aligned to 4096.
  `SwapFile` uses O_DIRECT where the filesystem takes it and buffered I/O elsewhere.
- `IOPool` (pool.py): transfers split into blocks spread over a few threads (pread, pwrite and crc32 release
  the GIL, so I/O overlaps compute), with a crc32 per block; reading with the write's checksums turns damaged
  or truncated files into `SwapCorruptError` instead of silently wrong weights.
- `ScratchDir` (scratch.py): one directory per process under the offload path, removed at exit; a new one
  removes the directories this host's crashed runs left.
- errors.py: `StorageError` and its kinds (full disk, bad directory, corrupt file), each naming the file.
- `Spill`, `spilled` (spill.py): a buffer built piece by piece in a shared mapping of an unlinked file, its pages
  written back and dropped as it goes (`fzero.init`'s shard for the NVMe tier, before the store takes it;
  `zero.Init(remote_device="nvme")`'s partitions).
- `Store`, `Offloaded` (store.py): versioned per-rank buffers on disk, built on the above (see its docstring).

The memory bound: `IOPool` and `SwapFile` allocate no buffers of their own. Every transfer reads into or writes from
a tensor the caller passes; the pool holds only memoryviews over them while a transfer runs. `Store` maps its
staging sets for each transfer and unmaps them after (`mapped_empty`), and reads each unit into a mapping of its own,
so what it holds is bounded by its settings and the largest unit, however large the files grow, and goes back to the
system once a transfer is over.

Example: a float32 region written through a pool and read back, checksums verified.

    >>> import tempfile, torch
    >>> from fzero.storage import IOPool, Region, SwapFile, aligned_empty
    >>> x = torch.randn(3000)
    >>> buf, back = aligned_empty(x.nbytes), aligned_empty(x.nbytes)
    >>> _ = buf[: x.nbytes].view(torch.float32).copy_(x)
    >>> with tempfile.TemporaryDirectory() as d, IOPool(threads=2, block_size=8192) as pool:
    ...     with SwapFile(f"{d}/swap.safetensors", [Region("m", torch.float32, x.numel())]) as f:
    ...         crcs = pool.write(f, f.offset("m"), buf, x.nbytes).result()
    ...         pool.read(f, f.offset("m"), back, x.nbytes, crcs).result()
    >>> len(crcs), torch.equal(back[: x.nbytes].view(torch.float32), x)
    (2, True)

May import: `fzero.host` (the step-sized buffers a unit's read reuses, the heap release).
"""

from .aligned import ALIGN, aligned_empty, mapped_empty, round_up
from .errors import StorageError, StorageFullError, StoragePathError, SwapCorruptError
from .pool import IOPool
from .reader import UnitReader
from .scratch import ScratchDir
from .spill import Spill, spilled
from .store import Offloaded, StaleStateError, Store, Task, in_memory
from .swapfile import Region, SwapFile

__all__ = [
    "ALIGN",
    "IOPool",
    "Offloaded",
    "Region",
    "ScratchDir",
    "Spill",
    "StaleStateError",
    "StorageError",
    "StorageFullError",
    "StoragePathError",
    "Store",
    "SwapCorruptError",
    "SwapFile",
    "Task",
    "UnitReader",
    "aligned_empty",
    "in_memory",
    "mapped_empty",
    "round_up",
    "spilled",
]

"""`Spill`: a buffer kept in a file of its own rather than in memory, while it is built piece by piece and read once.

What `fzero.init` builds for the NVMe tier (this rank's fp32 shard, unit by unit, before the store takes it chunk by
chunk: `fzero.transforms.offload.nvme_init`) is as large as the model's parameters; in memory it sat beside the
model at init's peak. A `Spill` is a shared mapping of an unlinked file under the tier's directory: what is written
to it goes to the page cache (file pages, not the process's anonymous memory), and `written(stop)` writes back and
drops the pages written so far (`msync`, `madvise(MADV_DONTNEED)`, `posix_fadvise(POSIX_FADV_DONTNEED)`), so a
construction holds at most a unit of it resident whatever the model's size, and none of it counts against a
memory limit for long (clean page cache is reclaimed first). Reading it back faults its pages in from the file,
clean, once each. The file is unlinked as soon as it is made: it goes when the last tensor on it is freed, or with the
process.

Example:
    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as d:
    ...     s = Spill(d, (2, 3000), torch.float32)
    ...     _ = s.tensor[:, :1000].copy_(torch.ones(2, 1000))
    ...     s.written(1000)
    ...     _ = s.tensor[:, 1000:].copy_(torch.zeros(2, 2000))
    ...     s.written(3000)
    ...     float(s.tensor.sum())
    2000.0
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
from typing import Any

import torch

from .errors import storage_error

__all__ = ["Spill", "spilled"]

PAGE = mmap.PAGESIZE


class Spill:
    """A tensor of `shape` and `dtype` in a shared mapping of a new, unlinked file under `directory`.

    Args:
      directory: where the file goes (the NVMe tier's path; it must exist).
      shape: `[n]` or `[rows, n]` (a `SimMesh`'s rows).
      dtype: the elements' dtype.

    Attributes:
      tensor: the buffer (uninitialised: zeros, as the file's holes read).

    Raises:
      StorageError: the file cannot be made (a missing directory, a full disk), naming it.
    """

    def __init__(self, directory: str | os.PathLike[str], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = tuple(shape), dtype
        nbytes = math.prod(self.shape) * dtype.itemsize
        self._done = [0] * (self.shape[0] if len(self.shape) == 2 else 1)  # bytes of each row dropped so far
        self._file: Any = None
        self._region: mmap.mmap | None = None
        if nbytes == 0:
            self.tensor = torch.empty(self.shape, dtype=dtype)
            return
        name: str | os.PathLike[str] = directory
        try:
            fd, name = tempfile.mkstemp(prefix="fzero-init-", suffix=".swap", dir=directory)
            self._file = os.fdopen(fd, "r+b")
            os.unlink(name)  # (nameless from now on: it goes with its last user, or with the process)
            os.ftruncate(fd, nbytes)  # (sparse: blocks are allocated as pages are written back)
        except OSError as e:
            if self._file is not None:
                self._file.close()
            raise storage_error(e, name, "create", nbytes=nbytes, opening=True) from e
        self._region = mmap.mmap(self._file.fileno(), nbytes, flags=mmap.MAP_SHARED)
        # (the tensor keeps the mapping alive; the mapping keeps its own descriptor of the file)
        self.tensor = torch.frombuffer(self._region, dtype=torch.uint8).view(dtype).view(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] * self.dtype.itemsize

    def written(self, stop: int) -> None:
        """Elements `[0, stop)` of every row are written: their whole pages are written back to the file and
        dropped from memory (the page cache included), so that they hold no memory until read again.

        Args:
          stop: the elements of each row written so far (the pieces are written in order).
        """
        if self._region is None or self._file is None:
            return
        fd = self._file.fileno()
        for row, done in enumerate(self._done):
            base = row * self.row_bytes
            lo = -(-(base + done) // PAGE) * PAGE
            hi = (base + stop * self.dtype.itemsize) // PAGE * PAGE
            if hi <= lo:
                continue
            self._region.flush(lo, hi - lo)  # written back, so the pages are clean and can go
            self._region.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            self._done[row] = hi - base

    def close(self) -> None:
        """Close the file (the mapping stays until the last tensor on it goes; then the file's blocks are freed)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def spilled(directory: str | os.PathLike[str], values: torch.Tensor) -> torch.Tensor:
    """A copy of the 1-D tensor `values` in a `Spill` under `directory`, its pages written back and dropped: it holds
    no memory until read (DeepSpeed's `zero.Init(remote_device="nvme")` partitions).

    Args:
      directory: where its file goes (it must exist).
      values: the elements (1-D).

    Returns:
      A tensor equal to `values`, on the file.

    Raises:
      StorageError: the file cannot be made, naming it.
    """
    spill = Spill(directory, (values.numel(),), values.dtype)
    spill.tensor.copy_(values)
    spill.written(values.numel())
    spill.close()
    return spill.tensor

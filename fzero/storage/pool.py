"""Swap-file transfers on a small thread pool, checksummed block by block.

`os.pread`, `os.pwrite` and `zlib.crc32` (on buffers over a few KiB) release the GIL, so a few threads keep an
NVMe device busy while the training step computes, and several threads keep several requests in flight, which is
what a fast NVMe needs to reach its bandwidth. Each transfer is split into blocks of `block_size` bytes spread
over the threads; each block's crc32 is computed on its I/O thread, so checksums cost no time on the caller's.

The checksums exist because a swap file is read back long after it was written, possibly by a device or a
filesystem that dropped or damaged bytes: a mismatch raises `SwapCorruptError` instead of training on garbage.

A transfer's future completes only when every block of it has finished, failed or not, so a caller who sees an
error can reuse its buffer at once: no block is still writing into it. The pool's threads are joined on
`close()`, on `__exit__`, and by a finalizer at garbage collection or interpreter exit.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from .aligned import ALIGN, round_up, tensor_bytes
from .errors import SwapCorruptError
from .scratch import Closing
from .swapfile import SwapFile

__all__ = ["IOPool"]

T = TypeVar("T")


def _shutdown(executor: ThreadPoolExecutor) -> None:
    # the last reference may drop in a callback on one of the pool's own threads, which cannot join itself
    own = threading.current_thread() in getattr(executor, "_threads", ())
    executor.shutdown(wait=not own)


def _combine(blocks: Sequence[Future[T]]) -> Future[tuple[T, ...]]:
    """A future of all the blocks' results in order, or of the first failed block's error, set when all are done."""
    out: Future[tuple[T, ...]] = Future()
    out.set_running_or_notify_cancel()  # a transfer in flight cannot be cancelled: its blocks are already queued
    left = [len(blocks)]
    lock = threading.Lock()

    def one_done(_: Future[T]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for b in blocks:
            e = b.exception()
            if e is not None:
                out.set_exception(e)
                return
        out.set_result(tuple(b.result() for b in blocks))

    if not blocks:
        out.set_result(())
    for b in blocks:
        b.add_done_callback(one_done)
    return out


class IOPool(Closing):
    """pread/pwrite on a small thread pool with a crc32 checksum per block.

    Args:
        threads: the I/O threads, at least 1.
        block_size: the bytes per block (the unit of parallelism and of checksums), a positive multiple of 4096.

    Example:
        >>> import tempfile
        >>> from fzero.storage import aligned_empty, Region, SwapFile
        >>> x = torch.arange(1000, dtype=torch.float32)
        >>> buf = aligned_empty(x.nbytes)  # 4096 bytes: O_DIRECT transfers whole 4096-byte blocks
        >>> buf[: x.nbytes].view(torch.float32).copy_(x)[:3]
        tensor([0., 1., 2.])
        >>> with tempfile.TemporaryDirectory() as d, IOPool(threads=2) as pool:
        ...     with SwapFile(f"{d}/swap", [Region("x", torch.float32, 1000)]) as f:
        ...         crcs = pool.write(f, f.offset("x"), buf, x.nbytes).result()
        ...         back = aligned_empty(x.nbytes)
        ...         pool.read(f, f.offset("x"), back, x.nbytes, crcs).result()
        ...         torch.equal(back[: x.nbytes].view(torch.float32), x)
        True
    """

    threads: int
    block_size: int

    def __init__(self, threads: int = 1, block_size: int = 1 << 20) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"IOPool: threads must be an int >= 1, got {threads!r}")
        if not isinstance(block_size, int) or block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"IOPool: block_size must be a positive multiple of {ALIGN}, got {block_size!r}")
        self.threads = threads
        self.block_size = block_size
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="fzero-io")
        self._finalizer = weakref.finalize(self, _shutdown, self._executor)

    def _blocks(
        self, file: SwapFile, offset: int, buf: torch.Tensor, nbytes: int, what: str
    ) -> list[tuple[int, int, int]]:
        """(start, checksummed end, transferred end) of each block, relative to `offset`; checks the arguments."""
        if nbytes < 0:
            raise ValueError(f"IOPool.{what}: nbytes must be >= 0, got {nbytes}")
        length = round_up(nbytes) if file.direct else nbytes
        have = buf.numel() * buf.element_size()
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"IOPool.{what}: {file.path}: buf must be a contiguous CPU tensor, got {buf.device}")
        if have < length:
            raise ValueError(
                f"IOPool.{what}: {file.path}: buf has {have} bytes, the transfer of {nbytes} bytes at offset {offset} "
                f"needs {length}"
                + (" (O_DIRECT moves whole 4096-byte blocks: use aligned_empty)" if file.direct else "")
            )
        if file.direct and (offset % ALIGN or buf.data_ptr() % ALIGN):
            raise ValueError(
                f"IOPool.{what}: {file.path}: O_DIRECT needs offset and buffer address multiples of {ALIGN}, "
                f"got offset {offset}, address {buf.data_ptr():#x}"
            )
        bs = self.block_size
        return [(s, min(s + bs, nbytes), min(s + bs, length)) for s in range(0, nbytes, bs)]

    def _submit(self, fn: Callable[..., T], jobs: list[tuple[object, ...]]) -> Future[tuple[T, ...]]:
        with self._lock:
            if self._closed:
                raise RuntimeError("IOPool: submit after close()")
            # under the lock: close() cannot shut the executor down between two blocks of one transfer
            blocks: list[Future[T]] = []
            try:
                for job in jobs:
                    blocks.append(self._executor.submit(fn, *job))
            except BaseException:
                # (interpreter shutdown) the blocks already queued use the caller's buffer: let them finish first
                wait(blocks)
                raise
        return _combine(blocks)

    def write(self, file: SwapFile, offset: int, buf: torch.Tensor, nbytes: int) -> Future[tuple[int, ...]]:
        """Writes the first `nbytes` bytes of `buf` at `offset` of `file`.

        Under O_DIRECT the length written is `round_up(nbytes)`: the bytes past `nbytes` come from `buf`'s
        capacity (an `aligned_empty(nbytes)` buffer has it).

        Args:
            file: the swap file.
            offset: the absolute byte offset (a region's `file.offset(name)`, or inside one).
            buf: a contiguous CPU tensor of any dtype, whose bytes are written; hold it, unchanged, until the
                future is done.
            nbytes: the bytes to write.

        Returns:
            A future of the crc32 of each block of the first `nbytes` bytes (block k covers bytes
            [k * block_size, min((k + 1) * block_size, nbytes))); its error, if any, is the first failed block's
            `StorageError`, raised once every block has finished.
        """
        blocks = self._blocks(file, offset, buf, nbytes, "write")
        view = tensor_bytes(buf)
        jobs: list[tuple[object, ...]] = [(file, offset, view, b, buf) for b in blocks]
        return self._submit(_write_block, jobs)

    def read(
        self, file: SwapFile, offset: int, buf: torch.Tensor, nbytes: int, crcs: tuple[int, ...] | None = None
    ) -> Future[None]:
        """Reads `nbytes` bytes (`round_up(nbytes)` under O_DIRECT) at `offset` of `file` into `buf`.

        Args:
            file: the swap file.
            offset: the absolute byte offset.
            buf: a contiguous CPU tensor with room for the transfer; do not use it until the future is done.
            nbytes: the bytes to read.
            crcs: the checksums `write` returned for these bytes, to verify; None to skip verification.

        Returns:
            A future of None; its error, if any, is the first failed block's: `SwapCorruptError` for a checksum
            mismatch (naming the file, the block's byte offset and both checksums) or a truncated file,
            `StorageError` for others; raised once every block has finished.
        """
        blocks = self._blocks(file, offset, buf, nbytes, "read")
        view = tensor_bytes(buf)
        if crcs is not None and len(crcs) != len(blocks):
            raise ValueError(
                f"IOPool.read: {file.path}: {len(crcs)} checksums for {nbytes} bytes at offset {offset}, expected "
                f"{len(blocks)} (one per block of {self.block_size} bytes)"
            )
        jobs: list[tuple[object, ...]] = [
            (file, offset, view, b, buf, None if crcs is None else crcs[k]) for k, b in enumerate(blocks)
        ]
        done = self._submit(_read_block, jobs)
        out: Future[None] = Future()
        out.set_running_or_notify_cancel()
        done.add_done_callback(lambda f: out.set_exception(e) if (e := f.exception()) else out.set_result(None))
        return out

    def close(self) -> None:
        """Waits for pending transfers and joins the threads. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"IOPool(threads={self.threads}, block_size={self.block_size}, {state})"


# `buf` rides along in every job: the memoryview is a raw address that does not keep the tensor alive


def _write_block(file: SwapFile, offset: int, view: memoryview, block: tuple[int, int, int], buf: object) -> int:
    start, end, io_end = block
    file.pwrite(offset + start, view[start:io_end])
    return zlib.crc32(view[start:end])


def _read_block(
    file: SwapFile, offset: int, view: memoryview, block: tuple[int, int, int], buf: object, crc: int | None
) -> None:
    start, end, io_end = block
    file.pread(offset + start, view[start:io_end])
    if crc is not None:
        got = zlib.crc32(view[start:end])
        if got != crc:
            raise SwapCorruptError(
                f"{file.path}: checksum mismatch in the block at byte offset {offset + start} ({end - start} bytes): "
                f"crc32 {got:#010x}, expected {crc:#010x}"
            )

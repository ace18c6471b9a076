"""One swap file: named regions at aligned offsets, in a layout any safetensors reader understands.

Offloaded state (parameters, gradients, optimizer moments) lives in scratch files between its uses. The layout
is safetensors' own, so a swap file left by a crashed run can be opened with `safetensors.safe_open` to look at,
and it costs nothing: safetensors is a JSON header followed by raw bytes, which is all a swap file needs.

Every region starts at a multiple of 4096 bytes, so O_DIRECT can move it straight between the device and an
aligned host buffer. safetensors requires the tensors' byte ranges to tile the data section without gaps, so the
slack after each region (its capacity minus its bytes) is declared as a uint8 tensor named `__pad{i}__`.

The whole file is preallocated at creation: a disk too small for the run fails then, with `StorageFullError`,
rather than in the middle of a training step with half the state written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .aligned import ALIGN, aligned_empty, buffer_address, round_up, tensor_bytes
from .errors import StorageError, SwapCorruptError, errno_name, storage_error
from .scratch import Closing

__all__ = ["Region", "SwapFile"]

# safetensors' dtype names (the checkpoint's files use this table too)
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
METADATA = {"format": "fzero-swap", "version": "1"}
_PAD = re.compile(r"__pad\d+__")
# what open(O_DIRECT) or a direct transfer gives on a filesystem without it
_NO_DIRECT = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


@dataclass(frozen=True)
class Region:
    """A named 1-D run of `numel` elements of `dtype` in a swap file."""

    name: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        """The region's bytes: numel * itemsize."""
        return self.numel * self.dtype.itemsize

    @property
    def capacity(self) -> int:
        """The space reserved for the region in the file: its bytes rounded up to a multiple of 4096."""
        return round_up(self.nbytes)


def _layout(regions: Sequence[Region]) -> tuple[bytes, dict[str, int], int]:
    """The header bytes (length prefix included), each region's absolute offset and the file's size."""
    header: dict[str, object] = {"__metadata__": METADATA}
    rel: dict[str, int] = {}
    at = 0
    for i, r in enumerate(regions):
        rel[r.name] = at
        header[r.name] = {"dtype": DTYPES[r.dtype], "shape": [r.numel], "data_offsets": [at, at + r.nbytes]}
        if r.capacity > r.nbytes:
            header[f"__pad{i}__"] = {
                "dtype": "U8",
                "shape": [r.capacity - r.nbytes],
                "data_offsets": [at + r.nbytes, at + r.capacity],
            }
        at += r.capacity
    text = json.dumps(header, separators=(",", ":")).encode()
    # spaces after the JSON are allowed by the format and put the data section on a 4096-byte boundary
    start = round_up(8 + len(text))
    text += b" " * (start - 8 - len(text))
    return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in rel.items()}, start + at


def _check(regions: Sequence[Region]) -> None:
    seen: set[str] = set()
    for r in regions:
        if not isinstance(r, Region):
            raise TypeError(f"SwapFile: regions must be Region, got {type(r).__name__}")
        if not r.name or r.name == "__metadata__" or _PAD.fullmatch(r.name):
            raise ValueError(f"SwapFile: region name {r.name!r} is empty or reserved (__metadata__, __padN__)")
        if r.name in seen:
            raise ValueError(f"SwapFile: region name {r.name!r} appears twice")
        if r.dtype not in DTYPES:
            raise ValueError(f"SwapFile: region {r.name!r} has dtype {r.dtype}, not one of {sorted(map(str, DTYPES))}")
        if not isinstance(r.numel, int) or r.numel < 0:
            raise ValueError(f"SwapFile: region {r.name!r} has numel {r.numel!r}, expected an int >= 0")
        seen.add(r.name)


def _close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class SwapFile(Closing):
    """One scratch file of named regions, readable by a standard safetensors reader.

    The layout: an 8-byte little-endian header length, a JSON header padded with spaces so that the data starts
    at a multiple of 4096 bytes, then the regions, each at a 4096-aligned file offset, with the gap after each
    declared as a uint8 tensor `__pad{i}__`. The header's `__metadata__` is {"format": "fzero-swap",
    "version": "1"}. The file is created (truncated, mode 0o600) and preallocated for its whole size.

    Args:
        path: the file to create (its directory must exist).
        regions: the regions, in file order; names unique.
        direct: None: O_DIRECT where the filesystem supports it, buffered I/O elsewhere; True: O_DIRECT or
            `StorageError`; False: buffered I/O.

    Raises:
        StorageFullError: the disk (or RLIMIT_FSIZE) has no room for the whole file.
        StoragePathError: the directory is missing, not a directory, or not writable.
        StorageError: any other failure to create the file, or `direct=True` where O_DIRECT is refused.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with SwapFile(f"{d}/swap", [Region("w", torch.float32, 10)]) as f:
        ...         (f.offset("w"), f.size, f.regions["w"].capacity)
        (4096, 8192, 4096)
    """

    path: pathlib.Path
    direct: bool
    size: int
    regions: dict[str, Region]

    def __init__(self, path: str | os.PathLike[str], regions: Sequence[Region], *, direct: bool | None = None) -> None:
        _check(regions)
        self.path = pathlib.Path(path)
        self.regions = {r.name: r for r in regions}
        header, self._offsets, self.size = _layout(regions)
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        try:
            self._create(header)
            self.direct = self._open_direct(header, direct)
        except BaseException:
            created = bool(self._fds)
            self.close()
            if created:  # a half-allocated file would hold on to the very space that was missing
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        self._fd = self._fds[-1]
        if not self.direct:
            try:  # a hint only: longer readahead for the streaming access offload does
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass

    def _create(self, header: bytes) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fds.append(os.open(self.path, flags, 0o600))
        except OSError as e:
            raise storage_error(e, self.path, "create", opening=True) from e
        fd = self._fds[0]
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise storage_error(e, self.path, "preallocate", nbytes=self.size) from e
            # filesystems without fallocate (some network ones): size it sparse; a full disk then shows at write
            try:
                os.ftruncate(fd, self.size)
            except OSError as e2:
                raise storage_error(e2, self.path, "preallocate", nbytes=self.size) from e2
        self._write_all(fd, 0, memoryview(header))

    def _open_direct(self, header: bytes, direct: bool | None) -> bool:
        """Opens the O_DIRECT descriptor when wanted and the filesystem takes it; True when it is in use."""
        if direct is False:
            return False
        flag = getattr(os, "O_DIRECT", 0)
        why = "this platform has no O_DIRECT"
        if flag:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | flag)
            except OSError as e:
                if e.errno not in _NO_DIRECT:
                    raise storage_error(e, self.path, "open (O_DIRECT)", opening=True) from e
                why = f"open(O_DIRECT) gave {errno_name(e)}"
            else:
                self._fds.append(fd)
                # some filesystems accept the flag and refuse the I/O: write the header's first block through it
                # from an aligned buffer and read it back before relying on it
                probe = aligned_empty(ALIGN)
                view = tensor_bytes(probe)
                view[:] = header[:ALIGN]
                try:
                    ok = os.pwrite(fd, view, 0) == ALIGN
                    view[:] = b"\0" * ALIGN
                    ok = ok and os.preadv(fd, [view], 0) == ALIGN and bytes(view) == header[:ALIGN]
                    why = "a 4096-byte O_DIRECT write and read did not return the bytes written"
                except OSError as e:
                    if e.errno not in _NO_DIRECT:
                        raise storage_error(e, self.path, "write (O_DIRECT)", offset=0, nbytes=ALIGN) from e
                    ok, why = False, f"an aligned O_DIRECT write gave {errno_name(e)}"
                if ok:
                    os.close(self._fds.pop(0))  # the buffered descriptor: only the direct one is used from here
                    return True
                os.close(self._fds.pop())
        if direct:
            raise StorageError(f"{self.path}: the filesystem does not support O_DIRECT ({why}); pass direct=None")
        return False

    def offset(self, name: str) -> int:
        """The absolute byte offset of a region (a multiple of 4096).

        Args:
            name: the region's name.

        Returns:
            Its offset in the file.
        """
        try:
            return self._offsets[name]
        except KeyError:
            raise ValueError(f"{self.path}: no region {name!r}; the file has {sorted(self._offsets)}") from None

    def _io_check(self, offset: int, view: memoryview, what: str) -> None:
        if not self._fds:
            raise ValueError(f"{self.path}: {what} on a closed SwapFile")
        if offset < 0 or offset + view.nbytes > self.size:
            raise ValueError(
                f"{self.path}: {what} of {view.nbytes} bytes at offset {offset} is outside the file's {self.size} bytes"
            )
        if self.direct:
            address = buffer_address(view)
            if offset % ALIGN or view.nbytes % ALIGN or address % ALIGN:
                raise ValueError(
                    f"{self.path}: O_DIRECT {what} needs offset, length and buffer address multiples of {ALIGN}; "
                    f"got offset {offset}, length {view.nbytes}, address {address:#x}"
                )

    def pwrite(self, offset: int, view: memoryview) -> None:
        """Writes all of `view` at `offset`.

        Args:
            offset: the absolute byte offset.
            view: the bytes (C-contiguous); under O_DIRECT offset, length and address must be 4096-aligned.

        Raises:
            StorageFullError: no room (ENOSPC, EDQUOT, EFBIG).
            StorageError: any other failure.
            ValueError: a closed file, a range outside the file, or a misaligned O_DIRECT transfer.
        """
        view = view.cast("B")
        self._io_check(offset, view, "write")
        self._write_all(self._fd, offset, view)

    def _write_all(self, fd: int, offset: int, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                raise storage_error(e, self.path, "write", offset=offset + done, nbytes=view.nbytes - done) from e
            if n <= 0:  # regular files never do this; a loop that cannot progress must not spin
                raise StorageError(f"{self.path}: write at byte offset {offset + done} wrote nothing")
            done += n

    def pread(self, offset: int, view: memoryview) -> None:
        """Fills all of `view` from `offset`.

        Args:
            offset: the absolute byte offset.
            view: the writable destination (C-contiguous); under O_DIRECT offset, length and address must be
                4096-aligned.

        Raises:
            SwapCorruptError: the file ends before `view` is full (it was truncated).
            StorageError: any other failure.
            ValueError: a closed file, a range outside the file, or a misaligned O_DIRECT transfer.
        """
        view = view.cast("B")
        self._io_check(offset, view, "read")
        done = 0
        while done < view.nbytes:
            try:
                n = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as e:
                raise storage_error(e, self.path, "read", offset=offset + done, nbytes=view.nbytes - done) from e
            done += n
            # a short read before the end is legal (signals, some filesystems): only the end of the file stops us
            if done < view.nbytes and (n == 0 or offset + done >= os.fstat(self._fd).st_size):
                raise SwapCorruptError(
                    f"{self.path}: truncated: reading {view.nbytes} bytes at byte offset {offset} got {done} "
                    f"(the file is {os.fstat(self._fd).st_size} bytes, expected {self.size})"
                )

    def check_size(self) -> None:
        """Checks that the file still has its full size.

        Raises:
            SwapCorruptError: it is shorter (something truncated it).
        """
        if not self._fds:
            raise ValueError(f"{self.path}: check_size on a closed SwapFile")
        got = os.fstat(self._fd).st_size
        if got < self.size:
            raise SwapCorruptError(f"{self.path}: truncated to {got} bytes, expected {self.size}")

    def close(self) -> None:
        """Closes the file (it stays on disk; the scratch directory removes it). Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if not self._fds else ("O_DIRECT" if self.direct else "buffered")
        return f"SwapFile({str(self.path)!r}, {len(self.regions)} regions, {self.size} bytes, {state})"

"""Streaming safetensors files: written tensor by tensor with the sha256 computed on the way, read with the
`safetensors` library (which parses a JSON header and raw bytes, and never unpickles anything).

The writer exists because `safetensors.torch.save_file` needs every tensor in memory at once and gives no
checksum; streaming lets `consolidate` hold one unit at a time and lets `save` hash what it writes in the same
pass. The format is safetensors' own: an 8-byte little-endian header length, a JSON header (padded with spaces
to a multiple of 8 bytes) mapping each name to its dtype, shape and `[begin, end)` byte offsets in the data that
follows, back to back. Tensors are written in descending order of element size, as `save_file` does, so every
tensor starts at an offset aligned to its element size.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ..storage.aligned import tensor_bytes
from ..storage.swapfile import DTYPES
from .errors import CorruptCheckpointError

__all__ = ["FileRecord", "TensorSpec", "file_sha256", "open_safetensors", "write_safetensors"]

CHUNK = 16 << 20  # bytes per write and hash call: large enough to amortise calls, small enough to stay in cache


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FileRecord:
    """A written file: name (relative to its directory), size in bytes and sha256 (hex)."""

    name: str
    bytes: int
    sha256: str


def tensor_sha256(t: Tensor) -> bytes:
    """sha256 of a tensor's raw bytes (its dtype and shape are not included)."""
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(tensor_bytes(t)).digest()


def _order(specs: Sequence[TensorSpec]) -> list[int]:
    size = lambda i: torch.empty((), dtype=specs[i].dtype).element_size()  # noqa: E731
    return sorted(range(len(specs)), key=lambda i: -size(i))  # stable: equal sizes keep the caller's order


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The file's first bytes (length + JSON header, padded) and the order the data must be written in."""
    order = _order(specs)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for i in order:
        s = specs[i]
        if s.dtype not in DTYPES:
            raise TypeError(f"tensor {s.name!r}: dtype {s.dtype} cannot be stored in a safetensors file")
        header[s.name] = {"dtype": DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    produce: Callable[[int], Tensor | Iterable[Tensor]],
    metadata: dict[str, str] | None = None,
    *,
    fsync: bool = True,
) -> FileRecord:
    """Write a safetensors file tensor by tensor, hashing the bytes as they go out.

    Args:
      path: the file to create (truncated if it exists).
      specs: the tensors' names, dtypes and shapes (names unique).
      produce: `produce(i)` returns tensor `i` of `specs`, or an iterable of tensors whose elements, concatenated,
        are it (written one after the other as they come: no concatenation in memory, and a generator that reads
        each part from disk holds one part at a time); called once per tensor, in descending
        order of element size (then in the order of `specs`), so a caller streaming from another file reads it in
        order.
      metadata: string pairs for the header's ``__metadata__``.
      fsync: flush the file to the disk before returning.

    Returns:
      The `FileRecord` (the sha256 covers the whole file).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in {os.fspath(path)!r}")
    head, order = header_bytes(specs, metadata)
    digest = hashlib.sha256(head)
    size = len(head)
    # sha256 and write() both release the GIL: hash chunk i on a second thread while chunk i is written
    with open(path, "wb") as f, ThreadPoolExecutor(1) as hasher:
        f.write(head)
        pending = None
        for i in order:
            spec = specs[i]
            produced = produce(i)
            # parts may come lazily (read from disk as they are written): checked as they come and in total
            parts = [produced] if isinstance(produced, Tensor) else produced
            got = 0
            for part in parts:
                if part.dtype != spec.dtype:
                    raise ValueError(f"tensor {spec.name!r}: got a {part.dtype} part, the header says {spec.dtype}")
                t = part.detach().cpu().contiguous()
                raw = tensor_bytes(t)
                got += len(raw)
                if got > spec.nbytes:
                    raise ValueError(f"tensor {spec.name!r}: more than the header's {spec.nbytes} bytes "
                                     f"({spec.dtype} {spec.shape})")  # fmt: skip
                for start in range(0, len(raw), CHUNK):
                    piece = raw[start : start + CHUNK]
                    if pending is not None:
                        pending.result()
                    pending = hasher.submit(digest.update, piece)
                    f.write(piece)
                if pending is not None:
                    pending.result()  # `t` must outlive the hashing of its bytes
                    pending = None
                size += len(raw)
                del raw, t, part  # the writer holds no tensor between two parts: a streaming caller frees each
            del produced, parts  # nor between two tensors: a streaming caller frees each before producing the next
            if got != spec.nbytes:
                raise ValueError(f"tensor {spec.name!r}: got {got} bytes, the header says {spec.nbytes} "
                                 f"({spec.dtype} {spec.shape})")  # fmt: skip
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return FileRecord(os.path.basename(os.fspath(path)), size, digest.hexdigest())


def file_sha256(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Size and sha256 of a file, read in chunks (memory: one chunk)."""
    digest = hashlib.sha256()
    buf = bytearray(1 << 20)  # reads of 1 MiB already run at the hash's speed
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def open_safetensors(path: str | os.PathLike[str]):
    """Open a safetensors file for lazy, sliced reads (`safe_open`), turning a parse failure into an error that
    names the file."""
    try:
        return safe_open(os.fspath(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{os.fspath(path)}: not a readable safetensors file ({e})") from None

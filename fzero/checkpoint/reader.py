"""`Checkpoint`: a checkpoint on disk, checked and opened for lazy reads.

Opening reads the manifest; `verify` checks that every shard file is there, has the size and the sha256 the
manifest records; each file's header is checked against the manifest (names, dtypes, shapes) when it is first
opened. Tensors are read with `safetensors.safe_open`, slice by slice: nothing is unpickled, and a read touches
only the bytes it asks for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..layout import dtype_of
from ..storage.aligned import tensor_bytes
from ..storage.scratch import Closing
from ..storage.swapfile import DTYPES
from . import rng
from .atomic import inside, resolve
from .errors import CorruptCheckpointError
from .manifest import Manifest, StoredEntry
from .manifest_schema import read_manifest
from .safetensors_io import file_sha256, open_safetensors
from .sources import named
from .tree import dtype_name, legacy_key

__all__ = ["Checkpoint"]


class _Shard:
    """One shard file, open for positional reads of its tensors' bytes.

    `safe_open` has validated the header (JSON, offsets, dtypes); the byte offsets are taken from the same header
    so that reads land straight in their destination tensors, without the library's memory map."""

    def __init__(self, path: Path, meta: dict[str, str], rng_names: list[str]) -> None:
        self.path, self.meta, self.rng_names = path, meta, rng_names
        self._f = open(path, "rb", buffering=0)
        try:
            (n,) = struct.unpack("<Q", self._f.read(8))
            header = json.loads(self._f.read(n))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise CorruptCheckpointError(f"{path}: unreadable header ({e})") from None
        self._start = 8 + n
        self._where = {k: v for k, v in header.items() if k != "__metadata__"}

    def close(self) -> None:
        self._f.close()

    def tensor(self, name: str) -> Tensor:
        info = self._where[name]
        dtype = {code: dtype for dtype, code in DTYPES.items()}[info["dtype"]]
        out = torch.empty(info["shape"], dtype=dtype)
        self.read_into(name, out, 0)
        return out

    def read_into(self, name: str, out: Tensor, offset: int) -> None:
        """Fill the contiguous `out` with the bytes of tensor `name` from byte `offset` of its data."""
        begin, end = self._where[name]["data_offsets"]
        n = out.numel() * out.element_size()
        if offset < 0 or begin + offset + n > end:
            raise CorruptCheckpointError(f"{self.path}: tensor {name!r} is shorter than the manifest says")
        view = tensor_bytes(out)
        self._f.seek(self._start + begin + offset)
        got = 0
        while got < n:
            k = self._f.readinto(view[got:])
            if not k:
                raise CorruptCheckpointError(f"{self.path}: ends inside tensor {name!r} (truncated)")
            got += k


_CODES = {code: dtype_name(dtype) for dtype, code in DTYPES.items()}


class Checkpoint(Closing):
    """A checkpoint directory opened for reading; a `fzero.checkpoint.sources.Source`.

    Args:
      path: a checkpoint directory, or a root of tagged checkpoints (see `fzero.checkpoint.atomic.resolve`).
      tag: the checkpoint in a root; default: the one ``latest`` names.
      verify: check every shard file's size and sha256 now (reads every byte once).

    Example:
      >>> # with Checkpoint("ckpts") as ckpt: exp_avg = dict(ckpt.named("tx_state/shard_update/exp_avg"))
    """

    def __init__(self, path: str | os.PathLike[str], tag: str | None = None, *, verify: bool = True) -> None:
        self.path: Path = resolve(path, tag)
        self.manifest: Manifest = read_manifest(self.path)
        self.layout = self.manifest.layout
        self.entries: dict[str, StoredEntry] = {}
        self._stored: dict[str, str] = {}  # today's key -> the key in the files, where they differ (format 1)
        for e in self.manifest.leaves:
            key = legacy_key(e.key) if self.manifest.version < 2 else e.key
            if key != e.key:
                self._stored[key] = e.key
                e = dataclasses.replace(e, key=key)
            self.entries[key] = e
        self._open: dict[int, Any] = {}
        if verify:
            self.verify()

    def close(self) -> None:
        """Release the open files (tensors read are the caller's: nothing maps the files)."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def verify(self, ranks: Iterable[int] | None = None) -> None:
        """Check the shard files of `ranks` (default all) against the manifest: present, of the recorded size, of
        the recorded sha256.

        Raises:
          CorruptCheckpointError: naming the first file at fault and what is wrong with it.
        """
        files = self.manifest.files
        ranks = list(range(len(files)) if ranks is None else ranks)
        for rank in ranks:  # cheap checks first, for every file
            info = files[rank]
            path = self._checked(rank)
            size = path.stat().st_size
            if size != info.bytes:
                what = "truncated" if size < info.bytes else "longer than written"
                raise CorruptCheckpointError(f"{path}: {what}: {size} bytes, the manifest records {info.bytes}")
        # then the checksums, files side by side (hashing releases the GIL)
        with ThreadPoolExecutor(max(1, min(len(ranks), os.cpu_count() or 1))) as pool:
            digests = list(pool.map(lambda r: file_sha256(self.path / files[r].name)[1], ranks))
        for rank, digest in zip(ranks, digests, strict=True):
            info = files[rank]
            if digest != info.sha256:
                raise CorruptCheckpointError(
                    f"{self.path / info.name}: checksum mismatch (sha256 {digest[:16]}..., the manifest records "
                    f"{info.sha256[:16]}...): the file was altered or damaged after it was written"
                )

    def _checked(self, rank: int) -> Path:
        """Rank `rank`'s shard file, which must be a file inside the checkpoint directory."""
        path = self.path / self.manifest.files[rank].name
        if not os.path.lexists(path):
            raise CorruptCheckpointError(f"{path}: missing (rank {rank}'s shard, listed in the manifest)")
        if not inside(path, self.path):
            raise CorruptCheckpointError(f"{path}: a symbolic link out of the checkpoint directory; refused")
        if not path.is_file():
            raise CorruptCheckpointError(f"{path}: not a regular file (rank {rank}'s shard)")
        return path

    def file(self, rank: int) -> _Shard:
        """Rank `rank`'s shard file, opened (and its header checked) on first use."""
        if rank not in self._open:
            path = self._checked(rank)
            with open_safetensors(path) as f:  # the library parses and validates the header
                self._check_header(f, rank, path)
                meta = f.metadata() or {}
                rng_names = [k for k in f.keys() if k.startswith(rng.PREFIX)]
            self._open[rank] = _Shard(path, meta, rng_names)
        return self._open[rank]

    def _check_header(self, f: Any, rank: int, path: Path) -> None:
        keys = set(f.keys())
        listed = {e.key for e in self.manifest.leaves if e.in_file(rank)}
        extra = [k for k in keys if k not in listed and not k.startswith(rng.PREFIX)]
        if extra:  # e.g. a leaf the manifest says only rank 0 stores: the manifest is not this file's
            raise CorruptCheckpointError(f"{path}: holds {len(extra)} tensor(s) that the manifest does not list")
        for e in self.manifest.leaves:
            if not e.in_file(rank):
                continue
            if e.key not in keys:
                raise CorruptCheckpointError(f"{path}: no tensor {e.key!r}, which the manifest lists")
            sl = f.get_slice(e.key)
            dtype, shape = _CODES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape())
            want = e.stored_shape(self.layout)
            if dtype != e.dtype or shape != want:
                raise CorruptCheckpointError(
                    f"{path}: tensor {e.key!r} is {dtype} {shape}, the manifest records {e.dtype} {want}"
                )

    def _shape(self, key: str, index: slice | None) -> tuple[int, ...]:
        e = self.entries[key]
        shape = e.stored_shape(self.layout)
        if index is None:
            return shape
        start, stop, _ = index.indices(shape[-1])
        return (*shape[:-1], max(0, stop - start))

    def read(self, key: str, rank: int, index: slice | None = None) -> Tensor:
        """What rank `rank`'s file holds for `key` (rank 0's for leaves stored once); with `index`, only that
        range of the last dimension. A new tensor, read from the file (no mapping of it)."""
        out = torch.empty(self._shape(key, index), dtype=dtype_of(self.entries[key].dtype))
        self.read_into(key, rank, out, index)
        return out

    def read_into(self, key: str, rank: int, out: Tensor, index: slice | None = None) -> None:
        """`read`, straight into `out` (one copy from the file: no intermediate tensor when `out` is contiguous)."""
        e = self.entries[key]
        if e.storage == "rank0":
            rank = 0
        shard = self.file(rank)
        shape = e.stored_shape(self.layout)
        if tuple(out.shape) != self._shape(key, index) or out.dtype != dtype_of(e.dtype):
            raise ValueError(f"read_into {key!r}: out is {out.dtype} {tuple(out.shape)}")
        item = out.element_size()
        if index is not None and len(shape) > 1:  # a range of the last dimension of a 2-d or more: row by row
            rows = out.reshape(-1, out.shape[-1]) if out.is_contiguous() else None
            if rows is None:
                out.copy_(self.read(key, rank, index))
                return
            start = index.indices(shape[-1])[0]
            for i in range(rows.shape[0]):
                shard.read_into(self._stored.get(key, key), rows[i], (i * shape[-1] + start) * item)
            return
        start = 0 if index is None else index.indices(shape[-1])[0]
        key = self._stored.get(key, key)
        if out.is_contiguous():
            shard.read_into(key, out, start * item)
        else:
            tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
            shard.read_into(key, tmp, start * item)
            out.copy_(tmp)

    def rng(self, process: int) -> dict[str, Any]:
        """The generator states process `process` saved (`fzero.checkpoint.rng.split`'s form)."""
        shard = self.file(process)
        tensors = {k: shard.tensor(k) for k in shard.rng_names}
        return rng.split(tensors, shard.meta)

    def named(self, key: str, dtype: torch.dtype | None = None, *, copy: bool = True):
        """A param-space leaf (e.g. ``"params"`` or ``"tx_state/shard_update/exp_avg"``) by parameter name, streamed
        unit by unit: an iterator of `(name, tensor)` (see `fzero.checkpoint.sources.named`)."""
        if key not in self.entries:
            raise KeyError(f"{self.path}: no leaf {key!r}; it has {', '.join(self.entries)}")
        return named(self, key, dtype, copy=copy)

    def value(self, key: str, rank: int = 0) -> Tensor:
        """A replicated leaf's value on `rank` (a copy)."""
        return self.read(key, rank).clone()

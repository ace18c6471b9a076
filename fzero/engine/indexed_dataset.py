"""The Megatron "mmap" indexed dataset DeepSpeed's DataAnalyzer writes (`index_to_sample`, `index_to_metric`) and its
curriculum sampler reads and writes (the data clusters): a reader and a writer, byte for byte DeepSpeed 0.19.8's
format, with no pickle anywhere (the reader parses the header with `struct` and maps the arrays with NumPy, an
optional dependency of fzero that only this module and the sampler import). `fzero.deepspeed` re-exports it at
DeepSpeed's path, `deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`.

    PREFIX.idx   b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q n items, <Q n documents,
                 int32 sizes[n], int64 byte offsets[n], int64 document index[n documents]
    PREFIX.bin   the items' values, one after the other, in the dtype

Item `i` is the 1-D array of `sizes[i]` values at byte `offsets[i]` of the `.bin` file.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "close_mmap_dataset_builder",
    "create_mmap_dataset_builder",
    "data_file_path",
    "find_fit_int_dtype",
    "index_file_path",
]

MAGIC = b"MMIDIDX\x00\x00"
DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32, 8: np.uint64,
}  # fmt: skip
_CODES = {np.dtype(t): c for c, t in DTYPES.items()}


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def find_fit_int_dtype(min_value: int, max_value: int) -> type[np.generic]:
    """DeepSpeed's smallest integer dtype holding `[min_value, max_value]` (unsigned where `min_value >= 0`)."""
    unsigned: tuple[type[np.generic], ...] = (np.uint8, np.uint16, np.uint32)
    signed: tuple[type[np.generic], ...] = (np.int8, np.int16, np.int32)
    if min_value >= 0:
        return next((t for t in unsigned if max_value <= np.iinfo(t).max), np.uint64)  # type: ignore[type-var]
    return next(
        (t for t in signed if np.iinfo(t).min <= min_value and max_value <= np.iinfo(t).max),  # type: ignore[type-var]
        np.int64,
    )


class MMapIndexedDataset:
    """The items of an indexed dataset, read from `prefix.idx` and `prefix.bin` (memory-mapped, read-only).

    Args:
      path: the prefix (without `.idx` / `.bin`).
      skip_warmup: accepted for DeepSpeed's signature (nothing is read ahead).

    Raises:
      ValueError: the index is not this format (naming the file and what was expected), or the data file is shorter
        than the index says.
    """

    def __init__(self, path: str, skip_warmup: bool = True) -> None:
        self._path = path
        idx = index_file_path(path)
        with open(idx, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < len(MAGIC) + 25 or head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx}: not a Megatron mmap index (expected it to start with {MAGIC!r})")
        version, code, n, docs = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != 1:
            raise ValueError(f"{idx}: index version {version}, expected 1")
        if code not in DTYPES:
            raise ValueError(f"{idx}: dtype code {code}, expected one of {sorted(DTYPES)}")
        self.dtype = DTYPES[code]
        offset = len(MAGIC) + 25
        need = offset + n * 4 + n * 8 + docs * 8
        if os.path.getsize(idx) < need:
            raise ValueError(f"{idx}: {os.path.getsize(idx)} bytes, its header says {n} items need {need}")
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(index, dtype=np.int32, count=n, offset=offset)
        self._pointers = np.frombuffer(index, dtype=np.int64, count=n, offset=offset + n * 4)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=docs, offset=offset + n * 12)
        item = np.dtype(self.dtype).itemsize
        data = data_file_path(path)
        end = int(self._pointers[-1]) + int(self.sizes[-1]) * item if n else 0
        if os.path.getsize(data) < end:
            raise ValueError(f"{data}: {os.path.getsize(data)} bytes, the index {idx} needs {end}")
        self._data = np.memmap(data, dtype=np.uint8, mode="r") if end else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: Any) -> Any:
        """Item `i` (a read-only 1-D array), or a list of the items of a contiguous slice."""
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            return [self[j] for j in range(start, stop)]
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self._path}: item {i} of {len(self)}")
        return np.frombuffer(self._data, dtype=self.dtype, count=int(self.sizes[i]), offset=int(self._pointers[i]))


class MMapIndexedDatasetBuilder:
    """Writes `out_file` (the `.bin`) item by item; `finalize(index_file)` writes the `.idx`.

    Args:
      out_file: the data file's path.
      dtype: the items' dtype (one of `DTYPES`).
    """

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        self._dtype = np.dtype(dtype)
        if self._dtype not in _CODES:
            raise ValueError(f"dtype {self._dtype} is not one of the index format's: {sorted(map(str, _CODES))}")
        self._file = open(out_file, "wb")
        self._sizes: list[int] = []
        self._doc_idx = [0]

    def add_item_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtype).reshape(-1)
        self._file.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def add_item(self, tensor: Any) -> None:
        self.add_item_numpy(tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str) -> None:
        self._file.close()
        sizes = np.array(self._sizes, dtype=np.int64)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:  # exclusive scan of the byte sizes
            pointers[1:] = np.cumsum(sizes[:-1] * self._dtype.itemsize)
        with open(index_file, "wb") as f:
            f.write(MAGIC + struct.pack("<QB", 1, _CODES[self._dtype]))
            f.write(struct.pack("<QQ", len(sizes), len(self._doc_idx)))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.array(self._doc_idx, dtype=np.int64).tobytes(order="C"))


def create_mmap_dataset_builder(fname: str, dtype: Any) -> MMapIndexedDatasetBuilder:
    return MMapIndexedDatasetBuilder(data_file_path(fname), dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    builder.end_document()
    builder.finalize(index_file_path(fname))

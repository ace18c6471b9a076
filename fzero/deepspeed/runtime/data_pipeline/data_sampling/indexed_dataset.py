"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: the reader and writer of the Megatron "mmap" index
files (DeepSpeed's DataAnalyzer output and the sampler's data clusters), byte for byte DeepSpeed 0.19.8's format and
without pickle; the engine's (`fzero.engine.indexed_dataset`). Importing it needs NumPy, as DeepSpeed's does."""

from __future__ import annotations

from .....engine.indexed_dataset import (
    DTYPES,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    data_file_path,
    find_fit_int_dtype,
    index_file_path,
)

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

"""`deepspeed.runtime.data_pipeline.data_sampling`: the curriculum sampler (`data_sampler.DeepSpeedDataSampler`) and
the Megatron mmap index files it reads (`indexed_dataset.MMapIndexedDataset`, `MMapIndexedDatasetBuilder`), without
pickle; the engine's (`fzero.engine.data_sampler`, `fzero.engine.indexed_dataset`). DeepSpeed's `DataAnalyzer`
(which writes the index files) is not provided: run DeepSpeed's, or write the files with
`MMapIndexedDatasetBuilder`."""

from __future__ import annotations

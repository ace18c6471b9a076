"""`deepspeed.runtime.data_pipeline`: DeepSpeed's data-efficiency library as its scripts import it.

`curriculum_scheduler.CurriculumScheduler`, `constants` (DeepSpeed's key names), `config`
(`get_data_efficiency_config`, checked by `fzero.config.data_efficiency`), `data_sampling` (`DeepSpeedDataSampler`
and the reader and writer of the DataAnalyzer's index files, `MMapIndexedDataset`, without pickle; they need NumPy)
and `data_routing` (random-LTD). The implementations are the engine's (`fzero.engine.curriculum_scheduler`,
`data_sampler`, `indexed_dataset`, `curriculum`, `random_ltd`): these modules re-export them at DeepSpeed's paths.
"""

from __future__ import annotations

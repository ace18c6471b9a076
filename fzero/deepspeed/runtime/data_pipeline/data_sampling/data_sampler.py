"""`deepspeed.runtime.data_pipeline.data_sampling.data_sampler.DeepSpeedDataSampler`: DeepSpeed 0.19.8's curriculum
data sampler, the same batch indices step by step; the engine's (`fzero.engine.data_sampler`, whose docstring lists
where it differs on purpose: the batch broadcast through the engine's mesh, JSON state with the sampler's own
generator, index files read without pickle). Importing it needs NumPy, as DeepSpeed's does."""

from __future__ import annotations

from .....engine.data_sampler import DeepSpeedDataSampler

__all__ = ["DeepSpeedDataSampler"]

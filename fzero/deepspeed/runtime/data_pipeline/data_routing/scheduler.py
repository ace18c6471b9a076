"""`deepspeed.runtime.data_pipeline.data_routing.scheduler`: DeepSpeed's `RandomLTDScheduler` (its state keys and
arithmetic; the schedule itself is `fzero.optim.random_ltd.fixed_linear`)."""

from __future__ import annotations

from fzero.engine.random_ltd import RandomLTDScheduler

__all__ = ["RandomLTDScheduler"]

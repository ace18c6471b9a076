"""`deepspeed.runtime.data_pipeline.constants`: DeepSpeed 0.19.8's key names of the data-efficiency blocks, data
sampling, curriculum learning, dynamic batching and data routing (random-LTD) included, every name with DeepSpeed's
value. They are `fzero.config.data_keys`' (the engine's curriculum and random-LTD read them there)."""

from __future__ import annotations

from ....config.data_keys import *  # noqa: F403  (DeepSpeed's module is its names)
from ....config.data_keys import __all__ as __all__

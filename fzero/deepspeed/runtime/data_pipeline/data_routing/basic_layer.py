"""`deepspeed.runtime.data_pipeline.data_routing.basic_layer`: the random-LTD layer wrapper.

fzero's `RandomLayerTokenDrop` (`fzero.engine.random_ltd`) keeps the wrapped layer's parameter paths (its tables are
the layer's) and accepts the layer's positional arguments; otherwise it is DeepSpeed's.
"""

from __future__ import annotations

from fzero.engine.random_ltd import RandomLayerTokenDrop

__all__ = ["RandomLayerTokenDrop"]

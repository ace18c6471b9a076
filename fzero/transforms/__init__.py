"""Composable pieces of a training step, and the ZeRO presets built from them."""

from .accumulate import AccumulateState, accumulate
from .base import Context, Flow, Transform, chain, identity
from .collective import all_reduce, gather, gather_params, reduce_scatter
from .presets import zero0, zero1, zero2, zero3
from .update import shard_update

__all__ = [
    "AccumulateState",
    "Context",
    "Flow",
    "Transform",
    "accumulate",
    "all_reduce",
    "chain",
    "gather",
    "gather_params",
    "identity",
    "reduce_scatter",
    "shard_update",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
]

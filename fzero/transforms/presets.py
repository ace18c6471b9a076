"""ZeRO stages 0-3 as chains of the same transforms.

| preset  | chain                                                         | at rest per rank              |
|---------|---------------------------------------------------------------|-------------------------------|
| `zero0` | accumulate, all_reduce, shard_update, gather                  | params, grads, state: full    |
| `zero1` | accumulate, reduce_scatter, shard_update, gather              | optimizer state and master: 1/W |
| `zero2` | reduce_scatter, accumulate, shard_update, gather              | + accumulated gradients: 1/W  |
| `zero3` | reduce_scatter, accumulate, shard_update (gather at step start) | + compute parameters: 1/W   |

Stage 1 accumulates full local gradients and reduce-scatters once per step; stage 2 reduce-scatters every
micro-step and accumulates shards. (DeepSpeed's stage 1 all-reduces and keeps its slice: the same values for the
owned slice, twice the traffic.)
"""

from __future__ import annotations

from ..optim import Optimizer
from .accumulate import accumulate as accumulate_
from .base import Transform, chain
from .collective import all_reduce, gather, reduce_scatter
from .update import shard_update

__all__ = ["zero0", "zero1", "zero2", "zero3"]


def zero0(optimizer: Optimizer, accumulate: int = 1) -> Transform:
    """Plain data parallelism: gradients all-reduced, everything replicated."""
    return chain(accumulate_(accumulate), all_reduce(), shard_update(optimizer), gather())


def zero1(optimizer: Optimizer, accumulate: int = 1) -> Transform:
    """ZeRO-1: optimizer state and master parameters sharded; full gradients accumulated locally."""
    return chain(accumulate_(accumulate), reduce_scatter(), shard_update(optimizer), gather())


def zero2(optimizer: Optimizer, accumulate: int = 1) -> Transform:
    """ZeRO-2: gradients reduce-scattered every micro-step and accumulated as shards."""
    return chain(reduce_scatter(), accumulate_(accumulate), shard_update(optimizer), gather())


def zero3(optimizer: Optimizer, accumulate: int = 1) -> Transform:
    """ZeRO-3: parameters also sharded at rest, gathered at the start of every step."""
    return chain(reduce_scatter(), accumulate_(accumulate), shard_update(optimizer))

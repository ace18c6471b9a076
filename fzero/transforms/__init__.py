"""Composable pieces of a training step, and the ZeRO presets built from them.

The algebra (`base`: `Flow`, `StepInfo`, `Context`, `Transform`; `chain`; `per_rank`, which runs a transform written
for one rank on every rank), the pieces (`accumulate`, `collective`: reductions and gathers, `quantize`, `scaling`,
`clipping`, `update` with its `offload` and `speculate` forms), the plan a chain makes of a step (`planning`) and the
ZeRO presets (`presets`).

May import: `fzero.host`, `fzero.native`, `fzero.storage`, `fzero.layout`, `fzero.mesh`, `fzero.sharding`,
`fzero.state`, `fzero.optim`.
"""

from .accumulate import AccumulateState, accumulate
from .base import (
    Context,
    Does,
    EmptyState,
    Flow,
    GradStats,
    InitFn,
    StepInfo,
    Transform,
    UnitFn,
    UpdateFn,
    identity,
    stateless,
)
from .chain import apply_init, apply_update, chain, find, lookup, named_chain, unit_reducer
from .clipping import clip_by_global_norm
from .collective import Average, GatherState, all_reduce, gather, gather_params, reduce_scatter, shard_params
from .offload import Offload
from .planning import plan_of
from .presets import zero0, zero1, zero2, zero3
from .quantize import quantized_gather, quantized_reduce_scatter
from .scaling import current_loss_scale, scale_loss
from .stats import grad_stats
from .update import shard_update

__all__ = [
    "AccumulateState",
    "Average",
    "Context",
    "Does",
    "EmptyState",
    "Flow",
    "GatherState",
    "GradStats",
    "InitFn",
    "Offload",
    "StepInfo",
    "Transform",
    "UnitFn",
    "UpdateFn",
    "accumulate",
    "all_reduce",
    "apply_init",
    "apply_update",
    "chain",
    "clip_by_global_norm",
    "current_loss_scale",
    "find",
    "gather",
    "gather_params",
    "grad_stats",
    "identity",
    "lookup",
    "named_chain",
    "plan_of",
    "quantized_gather",
    "quantized_reduce_scatter",
    "reduce_scatter",
    "scale_loss",
    "shard_params",
    "shard_update",
    "stateless",
    "unit_reducer",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
]

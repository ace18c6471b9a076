"""The step's global gradient statistics: the sum of squares over every rank's gradients (float64) and whether all
of them are finite, computed once per step by whichever transform asks first (`clip_by_global_norm`, `scale_loss`)
and carried in `StepInfo.stats`."""

from __future__ import annotations

import math

from torch import Tensor

from .. import native
from ..mesh import Mesh
from .base import Context, Flow, GradStats

__all__ = ["SPLIT_STATS_ELEMENTS", "grad_stats"]


def grad_stats(flow: Flow, ctx: Context, what: str) -> tuple[Flow, GradStats]:
    """The step's global gradient statistics: computed on first use (one pass over this rank's gradients and a
    one-element all-reduce when they are sharded; where every rank holds them whole, from `SPLIT_STATS_ELEMENTS` on
    the CPU, each rank's pass over its 1/world of them and the all-reduce), then carried in the flow's info for the
    transforms after."""
    if flow.info.stats is not None:
        return flow, flow.info.stats
    if not flow.info.reduced:
        raise ValueError(f"{what}() needs reduced gradients: put it after reduce_scatter() or all_reduce()")
    # float64; one pass, the native kernel on CPU (torch's vector norm elsewhere)
    grads, mesh = flow.gradients(what), ctx.mesh
    if flow.sharded:
        local = native.sumsq(grads)
        # (a hybrid layout: every replica holds the same reduced shards, summed over one copy of them)
        total = mesh.all_reduce(local, "sum", axis=ctx.layout.axis)
    elif _split(mesh, grads):
        # reduced, every rank holds the whole gradient alike (stage 0): each reads its 1/world of it, a one-element
        # all-reduce sums the parts
        total = mesh.all_reduce(_own_sumsq(mesh, grads), "sum")
    else:
        total = native.sumsq(grads)
    sumsq = float(mesh.unreplicate(total))
    stats = GradStats(sumsq, math.isfinite(sumsq))
    return flow.with_info(stats=stats), stats


# From this many elements of a whole gradient on the CPU, each rank sums the squares of its 1/world of it: below,
# the one-element all-reduce adding the parts costs more than the pass saves (benchmarks/collectives.py, two gloo
# ranks on a Zen 4: the split at 0.38x the whole pass's speed at 1.6M elements, 0.89x at 3.4M, 1.25x at 8.4M,
# 1.24x at 27.4M). On an accelerator a pass over the gradient is faster than any collective: never split there.
SPLIT_STATS_ELEMENTS = 1 << 22


def _split(mesh: Mesh, grads: Tensor) -> bool:
    n = grads.shape[-1]
    return mesh.world > 1 and n % mesh.world == 0 and n >= SPLIT_STATS_ELEMENTS and grads.device.type == "cpu"


def _own_sumsq(mesh: Mesh, x: Tensor) -> Tensor:
    """Per rank, the sum of squares (float64) of rank r's r-th part of the last dimension of `x` (a view: read once,
    so not worth `local_shard`'s copy)."""
    s = x.shape[-1] // mesh.world
    return mesh.stack([native.sumsq(mesh.pick(x, r)[..., r * s : (r + 1) * s]) for r in mesh.local_ranks])

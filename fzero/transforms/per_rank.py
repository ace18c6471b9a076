"""Transforms are written for one rank; this module runs them on every rank of a mesh (shard_map-style).

A transform whose `per_rank` is True (the default for `fzero.Transform` and `fzero.stateless`) sees, in each of its
functions, one rank's values: its gradient (the full one before the reduction; its shard, or at stage 0 the whole
average, after it), its master parameters, its own state; `ctx.mesh` is that rank's `RankMesh`, whose `rank` is an
int and whose collectives take and return this rank's values. The chain calls it through `fzero.Mesh.run`: a
`DistMesh` calls it once, in its process; a `SimMesh` calls it once per simulated rank, in lockstep
(`fzero.mesh.lockstep`), with each rank's slice of the flow and of the transform's state, and stacks what they
return. So a transform gives the same result on every mesh by construction, not by its author's care.

Each rank's context also carries random keys (`Context.key`, `Context.rank_key`) made from the state's seed, the
micro-step, the transform's place in the chain, the unit (for a `unit` function) and what the rank holds:

    what the rank holds                              key                        replicas
    its own gradient (before the reduction)          one per rank               (none: every rank's differs)
    a shard of the average (after reduce_scatter)    one per shard              equal: noise keeps them equal
    the whole average (after all_reduce: stage 0)    one for every rank         equal: noise keeps them equal

so noise drawn with `torch.Generator().manual_seed(ctx.key)` is the same on a `SimMesh` and a `DistMesh` and never
makes replicas differ. (`rank_key` differs on every rank, for draws that may.)

Values other than tensors that a per-rank function returns (a flag, a float metric, the gradient factor) must be
the same on every rank (every rank uses them alike); a `SimMesh` checks it and raises `fzero.mesh.MismatchError`
naming the value where they differ (a `DistMesh` could not tell: its ranks would silently diverge).
"""

from __future__ import annotations

import zlib
from typing import Any

from torch import Tensor

from ..layout.pieces import Pieces, whole
from ..mesh import RankMesh
from ..state.rng import fold
from .base import Context, Flow, Transform, UnitFn

__all__ = ["init", "rank_context", "unit_form", "update"]

_RANK, _SHARD, _ALL = 1, 2, 3  # what a rank holds (see the module docstring)


def rank_context(ctx: Context, mesh: RankMesh, holds: int, unit: int | None = None) -> Context:
    """`ctx` for rank `mesh.rank`: its mesh, and its keys for values of the kind `holds`."""
    tag = zlib.crc32("/".join(ctx.path).encode())
    base = (ctx.step, tag) if unit is None else (ctx.step, tag, unit)
    rank_key = fold(ctx.seed, *base, _RANK, mesh.rank)
    if holds == _RANK:
        key = rank_key
    elif holds == _SHARD:  # the same shard on every replica (its coordinate along the sharding axis)
        key = fold(ctx.seed, *base, _SHARD, mesh.index(None if ctx.layout is None else ctx.layout.axis))
    else:
        key = fold(ctx.seed, *base, _ALL)
    return ctx._replace(mesh=mesh, key=key, rank_key=rank_key)


def _holds(flow: Flow) -> int:
    if flow.grads is not None and not flow.info.reduced:
        return _RANK
    return _SHARD if flow.sharded else _ALL


def init(t: Transform, name: str, flow: Flow, ctx: Context) -> tuple[Flow, Any]:
    """`t.init`, on every rank where `t` is per-rank (its state then has a leading world axis on a `SimMesh`).

    This frame lets go of `flow` before `t.init` runs, as `fzero.init` does: a chain that shards the parameters frees
    the full buffer before the next transform makes its state."""
    ctx = ctx._replace(path=(*ctx.path, name))
    holds, box = _holds(flow), [flow]
    del flow
    if not t.per_rank:
        return t.init(box.pop(), ctx)
    return ctx.mesh.run(lambda mesh, f: t.init(f, rank_context(ctx, mesh, holds)), box.pop())


def update(t: Transform, name: str, flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
    """`t.update`, on every rank where `t` is per-rank."""
    ctx = ctx._replace(path=(*ctx.path, name))
    if not t.per_rank:
        return t.update(flow, state, ctx)
    holds = _holds(flow)
    return ctx.mesh.run(lambda mesh, f, s: t.update(f, s, rank_context(ctx, mesh, holds)), flow, state)


def unit_form(t: Transform, name: str) -> UnitFn | None:
    """`t.unit`, run on every rank where `t` is per-rank (each rank's unit gradient, before the reduction: keys
    per rank and unit). A per-rank `unit` returns its result, not a handle: it runs without `ctx.overlap`."""
    fn = t.unit
    if fn is None or not t.per_rank:
        return fn

    def unit(grads: Tensor | Pieces, index: int, ctx: Context) -> Tensor:
        c = ctx._replace(path=(*ctx.path, name), overlap=False, place=None)
        return ctx.mesh.run(lambda mesh, g: fn(g, index, rank_context(c, mesh, _RANK, index)), whole(grads))

    return unit

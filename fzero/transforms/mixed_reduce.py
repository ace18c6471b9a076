"""Reductions whose dtype is chosen per parameter: `all_reduce` and `reduce_scatter` with `overrides`.

DeepSpeed's `torch_autocast` mode reduces the gradients of the modules autocast runs in low precision (Linear,
Conv) in that dtype and every other gradient in the parameter's own (`comm_dtype` in DeepSpeed 0.19.8's
`runtime/torch_autocast.py`, one reduction bucket per dtype in `zero/stage_1_and_2.py` and `zero/stage3.py`). A
`Policy` expresses it with `reduce_overrides` (parameter name -> dtype); the presets then use these transforms, which
split each unit's gradient into one group of elements per dtype and reduce each group in its dtype:

- `mixed_all_reduce`: each group's elements gathered into one buffer of that dtype, all-reduced, written back;
- `mixed_reduce_scatter`: each rank's shard of a unit holds a different number of a group's elements, so every
  rank's elements of the group are packed into a slot of the largest such count (zero padding), the slots are
  reduce-scattered in the group's dtype, and each rank writes its slot's first elements back to their places in
  its shard.

Each group goes through the plain `all_reduce(dtype)` / `reduce_scatter(dtype)` of `fzero.transforms.collective`,
so an element's value is exactly what that transform gives it when the whole buffer travels in the element's dtype
(the mean of the ranks' values, its division first over a power-of-two world): the grouping moves elements, it
changes no arithmetic. Low-precision results are widened back to the buffer's dtype (exact). Traffic: each
element travels once, in its own dtype (plus the padding of the slots: at most the difference between the ranks'
counts, per unit and group).

Example:
    >>> import torch, fzero
    >>> from fzero.transforms.mixed_reduce import mixed_reduce_scatter
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    >>> mesh = fzero.SimMesh(world=2)
    >>> tx = fzero.chain(mixed_reduce_scatter(None, {"0.weight": torch.bfloat16}), fzero.gather())
    >>> fzero.init(model, tx, mesh).params.shape   # each rank's shard of the master parameters
    torch.Size([2, 32])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from ..layout import Layout
from ..layout.pieces import Pieces, whole
from .base import Context, Does, EmptyState, Flow, Transform
from .collective import all_reduce, reduce_scatter

__all__ = ["mixed_all_reduce", "mixed_reduce_scatter"]


def _check(overrides: Mapping[str, torch.dtype]) -> dict[str, torch.dtype]:
    out = dict(overrides)
    for name, dtype in out.items():
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"reduce dtype override for {name!r} must be a floating torch.dtype, got {dtype!r}")
    return out


def _unit_groups(layout: Layout, unit: int, overrides: dict[str, torch.dtype], default: Any) -> dict[Any, Tensor]:
    """Each dtype's element positions within the unit (a bool mask of the unit's size); padding and parameters
    without an override belong to `default`."""
    u = layout.units[unit]
    key = torch.zeros(u.size, dtype=torch.int64)  # 0: default; i + 1: the i-th override dtype
    dtypes = sorted(set(overrides.values()), key=str)
    for leaf in layout.leaves:
        if leaf.unit == unit and leaf.name in overrides:
            start = leaf.offset - u.start
            key[start : start + leaf.numel] = dtypes.index(overrides[leaf.name]) + 1
    groups = {default: key == 0}
    for i, dtype in enumerate(dtypes):
        if dtype == default:
            groups[default] = groups[default] | (key == i + 1)
        else:
            groups[dtype] = key == i + 1
    return {d: m for d, m in groups.items() if bool(m.any())}


def _names(layout: Layout, overrides: dict[str, torch.dtype]) -> None:
    known = {leaf.name for leaf in layout.leaves}
    aliases = dict(layout.aliases)
    unknown = sorted(n for n in overrides if n not in known and aliases.get(n) not in known)
    if unknown:
        raise ValueError(f"reduce dtype overrides name {unknown}, which are not trainable parameters of the layout "
                         f"(its parameters: {sorted(known)[:8]}{' ...' if len(known) > 8 else ''})")  # fmt: skip


def _canonical(layout: Layout, overrides: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """`overrides` keyed by the layout's names (a tied parameter's alias mapped to its canonical name)."""
    aliases = dict(layout.aliases)
    return {aliases.get(n, n): d for n, d in overrides.items()}


def mixed_all_reduce(dtype: torch.dtype | None, overrides: Mapping[str, torch.dtype]) -> Transform:
    """`all_reduce(dtype)`, except that the gradients of the parameters named in `overrides` are reduced in the
    dtype given there (see the module docstring).

    Args:
      dtype: the dtype every other gradient travels in (None: the gradients' own).
      overrides: parameter name (the layout's, or a tied alias) -> the dtype its gradient travels in.

    Raises:
      ValueError: at init, a name that is not a trainable parameter.
    """
    table = _check(overrides)
    cache: dict[tuple[int, Any], dict[Any, Tensor]] = {}

    def groups(ctx: Context, unit: int, default: Any) -> dict[Any, Tensor]:
        if (unit, default) not in cache:
            cache[unit, default] = {
                d: m.nonzero().flatten()
                for d, m in _unit_groups(ctx.layout, unit, _canonical(ctx.layout, table), default).items()
            }
        return cache[unit, default]

    def reduce_unit(g: Tensor, unit: int, ctx: Context) -> Tensor:
        default = dtype or g.dtype
        c = ctx._replace(overlap=False, place=None)
        out = torch.empty(g.shape, dtype=default, device=g.device)
        for d, index in groups(ctx, unit, default).items():
            index = index.to(g.device)
            reduce = all_reduce(d).unit
            assert reduce is not None  # (all_reduce has a unit form)
            part = cast(Tensor, reduce(g.index_select(-1, index).to(d), unit, c))  # (overlap off: a tensor)
            out.index_copy_(-1, index, part.to(default))
        return out

    def init(flow: Flow, ctx: Context) -> tuple[Flow, EmptyState]:
        _names(ctx.layout, table)
        return flow, EmptyState()

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        if flow.sharded:
            raise ValueError("all_reduce() needs full gradients but they are already sharded: it must come before "
                             "reduce_scatter() in the chain")  # fmt: skip
        g = flow.gradients("all_reduce")
        parts = [reduce_unit(g[..., ctx.layout.unit_slice(u)], u, ctx) for u in range(len(ctx.layout.units))]
        return flow._replace(grads=torch.cat(parts, -1)).with_info(reduced=True), state

    def unit(grads: Tensor | Pieces, index: int, ctx: Context) -> Tensor:
        return reduce_unit(whole(grads), index, ctx)

    return Transform(init, update, "all_reduce", unit, reduces=True, per_rank=False)


def mixed_reduce_scatter(dtype: torch.dtype | None, overrides: Mapping[str, torch.dtype]) -> Transform:
    """`reduce_scatter(dtype)` (over every rank, the mean after the sum), except that the gradients of the
    parameters named in `overrides` are reduced in the dtype given there (see the module docstring). Shards the
    parameters at init, as `reduce_scatter` does.

    Args:
      dtype: the dtype every other gradient travels in (None: the gradients' own).
      overrides: parameter name (the layout's, or a tied alias) -> the dtype its gradient travels in.

    Raises:
      ValueError: at init, a name that is not a trainable parameter.
    """
    table = _check(overrides)
    base = reduce_scatter(dtype)
    # per (unit, default dtype): for each dtype, the gather index of the packed slots ([world * C], positions in the
    # unit's gradient, `size` for padding) and every rank's positions in its shard ([world, C], `shard` for padding)
    cache: dict[tuple[int, Any], dict[Any, tuple[Tensor, Tensor]]] = {}

    def plan(layout: Layout, unit: int, default: Any) -> dict[Any, tuple[Tensor, Tensor]]:
        if (unit, default) in cache:
            return cache[unit, default]
        world, size = layout.world, layout.units[unit].size
        shard = size // world
        out = {}
        for d, mask in _unit_groups(layout, unit, _canonical(layout, table), default).items():
            local = [mask[r * shard : (r + 1) * shard].nonzero().flatten() for r in range(world)]
            width = max(len(p) for p in local)
            gather = torch.full((world, width), size, dtype=torch.int64)
            place = torch.full((world, width), shard, dtype=torch.int64)
            for r, p in enumerate(local):
                gather[r, : len(p)] = p + r * shard
                place[r, : len(p)] = p
            out[d] = (gather.flatten(), place)
        cache[unit, default] = out
        return out

    def reduce_unit(g: Tensor, unit: int, ctx: Context) -> Tensor:
        """One rank's unit gradient `g` ([size]) -> its shard of the mean ([size / world])."""
        default = dtype or g.dtype
        c = ctx._replace(overlap=False, place=None)
        padded = torch.cat([g, g.new_zeros(1)])  # (the slots' padding reads the last element: a zero)
        shard = g.shape[-1] // ctx.layout.world
        out = torch.zeros(shard + 1, dtype=default, device=g.device)  # (the last element takes the padding)
        rank = cast(Any, ctx.mesh).rank  # (a rank's mesh: `per_rank` runs this once per rank)
        for d, (gather, place) in plan(ctx.layout, unit, default).items():
            slots = padded.index_select(0, gather.to(g.device)).to(d)
            mine = base_unit(d)(slots, unit, c)
            out.index_copy_(0, place[rank].to(g.device), mine.to(default))
        return out[:shard]

    units: dict[Any, Transform] = {}

    def base_unit(d: torch.dtype) -> Any:
        if d not in units:
            units[d] = reduce_scatter(d)
        return units[d].unit

    def per_rank(g: Tensor, unit: int, ctx: Context) -> Tensor:
        # each rank places its slot differently: run once per rank (a SimMesh's ranks in lockstep)
        return ctx.mesh.run(lambda mesh, x: reduce_unit(x, unit, ctx._replace(mesh=mesh)), g)  # type: ignore[no-any-return]

    def init(flow: Flow, ctx: Context) -> tuple[Flow, EmptyState]:
        _names(ctx.layout, table)
        return base.init(flow, ctx)  # type: ignore[no-any-return]

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        if flow.sharded:
            raise ValueError("reduce_scatter() needs full gradients but they are already sharded: it must come "
                             "before reduce_scatter() in the chain")  # fmt: skip
        g, layout = flow.gradients("reduce_scatter"), ctx.layout
        parts = [per_rank(g[..., layout.unit_slice(u)], u, ctx) for u in range(len(layout.units))]
        return flow._replace(grads=torch.cat(parts, -1), sharded=True).with_info(reduced=True), state

    def unit(grads: Tensor | Pieces, index: int, ctx: Context) -> Tensor:
        return per_rank(whole(grads), index, ctx)

    return Transform(init, update, "reduce_scatter", unit, reduces=True, does=Does(shards=True), per_rank=False)

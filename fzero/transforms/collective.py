"""The transforms that communicate: `all_reduce`, `reduce_scatter` and `gather`.

- `all_reduce()`: full gradients -> their mean over ranks, on every rank (stage 0).
- `reduce_scatter()`: full gradients -> this rank's shard of their mean (stages 1-3); at init it turns the master
  parameters into this rank's shard, so what follows holds 1/world of the state.
- `gather()`: after the update, the new master shards -> full compute parameters on every rank (stages 0-2);
  `gather(lazy=True)` keeps them as this rank's shard, and the step all-gathers them before the next forward,
  unit by unit (stage 3: parameters sharded at rest).

Means are the rank-ordered sum divided by `world` (see `fzero.mesh`; over a power-of-two world the division comes
first, bitwise the same: `fzero.layout.pieces.exact_division`), so per element an all-reduce and a reduce-scatter
give the same value, bitwise, and so does reducing unit by unit (the reductions' `unit` form, which
stage 3 runs in the backward) or the whole buffer at once. Gradients travel in `dtype` (the policy's reduce dtype).

Where the division by `world` happens is DeepSpeed's choice too (`Average`): after the sum (the default), before
it (`prescale_gradients`: each rank's gradient times `1/world`, so the sum cannot overflow where the gradients do
not), or split by a factor `f` (`gradient_predivide_factor`: times `1/f` before, `f/world` after).

Example:
    >>> import torch, fzero
    >>> mesh = fzero.SimMesh(world=2)
    >>> state = fzero.init(torch.nn.Linear(4, 4), fzero.chain(fzero.reduce_scatter(), fzero.gather()), mesh)
    >>> state.params.shape                          # [world, this rank's shard]
    torch.Size([2, 16])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ..host import scratch
from ..layout import Layout, to_rank_major
from ..layout.int8 import dequantize, quantize
from ..layout.pieces import Pieces, exact_division, into, whole
from ..mesh import AllOf, Mesh, ReduceOp, Work, completed, progress
from ..sharding.gathered_unit import EXACT, GatherSpec
from ..state import pytree, register_torch_pytree, static_field
from .base import Context, Does, EmptyState, Flow, Transform

__all__ = [
    "Average",
    "GatherState",
    "all_reduce",
    "check_axes",
    "gather",
    "gather_params",
    "reduce_scatter",
    "shard_params",
    "sharding_world",
]


@dataclass(frozen=True)
class Average:
    """Where a reduction divides the sum of `world` ranks' gradients by `world` (DeepSpeed's `prescale_gradients`
    and `gradient_predivide_factor`, in the operations of its engine's `allreduce_bucket`):

        default (post):   mean = (sum_r g_r) / world                       (the mesh's "mean")
        prescale:         mean = sum_r (g_r * (1/world))
        predivide f:      mean = (sum_r (g_r * (1/f))) * (f/world)          (the last product skipped if f == world)

    All three are the mean; they round differently (each product is one more rounding of every element, at most
    2 units in the last place in all) and overflow differently: a sum of `world` half-precision gradients can
    overflow where the gradients themselves do not; prescaling cannot, predividing by `f` moves the threshold by
    `f` (docs/equivalence.md). The scalars `1/world`, `1/f`, `f/world` are computed in double and multiplied into
    the gradients in the dtype they travel in.

    Attributes:
      prescale: divide before the sum.
      predivide: the factor `f` (1.0: the default); ignored with `prescale`, as DeepSpeed ignores it.
    """

    prescale: bool = False
    predivide: float = 1.0

    def __post_init__(self) -> None:
        f = self.predivide
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (f > 0 and math.isfinite(f)):
            raise ValueError(f"Average: predivide must be a positive finite number, got {f!r}")

    @property
    def is_default(self) -> bool:
        return not self.prescale and self.predivide == 1.0

    def before(self, x: Tensor, world: int) -> Tensor:
        """The gradients as they enter the sum."""
        if self.prescale:
            return x * (1.0 / world)
        return x if self.predivide == 1.0 else x * (1.0 / self.predivide)

    def after(self, total: Tensor, world: int) -> Tensor:
        """The mean, from the sum of what `before` gave."""
        if self.prescale or self.predivide == world:
            return total
        return total * (self.predivide / world)


def _averaged(handle: Tensor | Work, average: Average, world: int) -> Tensor | Work:
    """A reduction's result (or handle) with `average.after` applied (on waiting, for a handle)."""
    if isinstance(handle, Tensor):
        return average.after(handle, world)
    return _After(handle, average, world)


class _After:
    """A reduction in flight whose `wait()` also finishes the average."""

    def __init__(self, work: Work, average: Average, world: int) -> None:
        self.work, self.average, self.world = work, average, world

    def wait(self) -> Tensor:
        return self.average.after(cast(Tensor, self.work.wait()), self.world)

    def progress(self) -> bool:
        """The reduction's `progress()` (`_Chained`), if it has one; True (nothing left to start) if not."""
        return progress(self.work)

    def is_completed(self) -> bool:
        return completed(self.work)


class _Chained:
    """Two collectives in flight one after the other as one handle (a hybrid reduction: the reduce-scatter over the
    sharding axis, then the all-reduce of its result over the replicate axis), so that both run while the backward
    goes on.

    The second starts only once the first has completed: at `progress()` (never blocks) or at `wait()`. A backend
    pairs the collectives of a group by the order they are issued in, so every rank must start the second
    collectives of its handles in the same (unit) order: whoever holds several advances them oldest first and stops
    at the first that cannot advance yet (`fzero.mesh.ranks._DistReduction`).

    Args:
      first: the first collective's handle; its `wait()` gives the second's input.
      then: starts the second collective on that input and returns its handle, whose `wait()` gives the result.
    """

    def __init__(self, first: Work, then: Callable[[Tensor], Work]) -> None:
        self._first: Work | None = first
        self._then = then
        self._second: Work | None = None

    def progress(self) -> bool:
        """Start the second collective if the first has completed (without blocking); whether it is started."""
        if self._second is None:
            if not completed(cast(Work, self._first)):
                return False
            self._start()
        return True

    def is_completed(self) -> bool:
        """Whether both collectives have completed (`wait()` would not block)."""
        return self._second is not None and completed(self._second)

    def wait(self) -> Tensor:
        """Wait for the first collective, start the second if `progress()` has not, and return its result."""
        if self._second is None:
            self._start()
        return cast(Tensor, cast(Work, self._second).wait())

    def _start(self) -> None:
        first, self._first = cast(Work, self._first), None  # (its buffers are freed once it has given its result)
        self._second = self._then(cast(Tensor, first.wait()))


def _require_full(flow: Flow, what: str) -> None:
    if flow.sharded:
        raise ValueError(f"{what}() needs full gradients but they are already sharded: it must come before "
                         "reduce_scatter() in the chain")  # fmt: skip


def _cast(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None else x.to(dtype)


def all_reduce(dtype: torch.dtype | None = None, average: Average | None = None) -> Transform:
    """Average full gradients over ranks (plain data parallelism), communicating in `dtype`; `average`: where
    the division by the world size happens (`Average`; default after the sum).

    Example:
        >>> import torch, fzero
        >>> tx = fzero.chain(fzero.all_reduce(), fzero.shard_update(fzero.sgd(0.1)), fzero.gather())
        >>> state = fzero.init(torch.nn.Linear(2, 1), tx, fzero.SimMesh(2))
        >>> state.params.shape                      # every rank holds everything (padded to 2 x 16)
        torch.Size([2, 32])
    """

    avg = average or Average()

    def reduce(grads: Tensor | Pieces, ctx: Context) -> Tensor | Work:
        run, world = (ctx.mesh.all_reduce_start if ctx.overlap else ctx.mesh.all_reduce), ctx.mesh.world
        out = None if ctx.place is None or not avg.is_default else ctx.place(tuple(grads.shape), dtype or grads.dtype)
        exact = avg.is_default and exact_division(world, dtype or grads.dtype)  # (the mean divided before the sum)
        if out is not None:  # (the cast `_cast` makes, into the result's place: reduced there)
            x = into(grads, out, world if exact else None)
        else:
            grads = whole(grads)
            x = _cast(grads, dtype)
            if exact:  # (a new tensor for a gradient handed in: the copy the collective would make otherwise)
                x = torch.div(x, world) if x is grads else x.div_(world)
        if not avg.is_default:
            x = avg.before(x, world)
        op: ReduceOp = "sum" if exact or not avg.is_default else "mean"
        # a cast or a prescale made `x` a tensor of this reduction's own: reduced in place (no copy); the gradient
        # handed in may be another's (autograd passes one tensor to several inputs): never written
        total = run(x, op, inplace=x is not grads)
        return total if avg.is_default else _averaged(total, avg, world)

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        _require_full(flow, "all_reduce")
        grads = cast(Tensor, reduce(flow.gradients("all_reduce"), ctx._replace(overlap=False)))
        return flow._replace(grads=grads).with_info(reduced=True), state

    def unit(grads: Tensor | Pieces, index: int, ctx: Context) -> Tensor | Work:
        return reduce(grads, ctx)

    unit.takes_pieces = True  # type: ignore[attr-defined]  # (written into their place in one pass: `fzero.layout.pieces`)
    return Transform(lambda flow, ctx: (flow, EmptyState()), update, "all_reduce", unit, reduces=True, per_rank=False)


def reduce_scatter(
    dtype: torch.dtype | None = None,
    axis: str | None = None,
    replicate: str | None = None,
    average: Average | None = None,
) -> Transform:
    """Average full gradients over ranks, keeping this rank's shard (communicating in `dtype`); shards the
    parameters at init.

    Args:
      dtype: the dtype gradients travel in (default: theirs).
      axis: the mesh axis to shard over (None: every rank). Named, it must be the mesh's last (innermost) axis:
        a group of ranks next to each other (one node's, on a real cluster).
      replicate: a further mesh axis to average the shard over (an all-reduce of 1/size(axis) of the gradient
        over the slow axis: hybrid sharding, FSDP's HSDP; docs/hybrid.md). Needs `axis`.
      average: where the division by the number of ranks averaged over happens (`Average`; default after each
        sum).

    Example:
        >>> import torch, fzero
        >>> mesh = fzero.SimMesh(world=2)
        >>> grads = torch.arange(4.).expand(2, 4)   # both ranks' full gradient (one unit, no padding here)
        >>> fzero.reduce_scatter().unit(grads, 0, fzero.Context(mesh, None))
        tensor([[0., 1.],
                [2., 3.]])
    """

    if replicate is not None and axis is None:
        raise ValueError(f"reduce_scatter(replicate={replicate!r}) needs the axis to shard over: axis=...")
    if replicate is not None and replicate == axis:
        raise ValueError(f"reduce_scatter: axis and replicate are both {axis!r}; they must be two mesh axes")

    def init(flow: Flow, ctx: Context) -> tuple[Flow, EmptyState]:
        if flow.sharded:
            raise ValueError("reduce_scatter() appears twice in the chain: the parameters are already sharded")
        check_axes(ctx.mesh, axis, replicate)
        if ctx.presharded or ctx.layout.world == 1:
            return flow._replace(sharded=True), EmptyState()
        return flow._replace(params=shard_params(ctx.mesh, ctx.layout, flow.params, axis), sharded=True), EmptyState()

    avg = average or Average()

    # The all-reduce over `replicate` reduces the reduce-scatter's result in place, which is its own buffer unless
    # the shard axis has one rank (then it is the input itself, the caller's: copied as any collective's input).

    def reduce(x: Tensor, ctx: Context) -> Tensor:
        if not avg.is_default:  # one sum over every rank averaged over, then the one division
            world = sharding_world(ctx.mesh, axis) * (1 if replicate is None else ctx.mesh.size(replicate))
            total = ctx.mesh.reduce_scatter(avg.before(x, world), "sum", axis=axis)
            if replicate is not None:
                total = ctx.mesh.all_reduce(total, "sum", axis=replicate, inplace=total is not x)
            return avg.after(total, world)
        if axis is None:
            return ctx.mesh.reduce_scatter(x, "mean")
        shard = ctx.mesh.reduce_scatter(x, "mean", axis=axis)
        return shard if replicate is None else ctx.mesh.all_reduce(shard, "mean", axis=replicate,
                                                                   inplace=shard is not x)  # fmt: skip

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        _require_full(flow, "reduce_scatter")
        grads = reduce(to_rank_major(ctx.layout, _cast(flow.gradients("reduce_scatter"), dtype)), ctx)
        return flow._replace(grads=grads, sharded=True).with_info(reduced=True), state

    def start(x: Tensor, ctx: Context) -> Work:
        """`reduce`'s collectives, started (`reduce`'s arithmetic in its order: bitwise its result); a hybrid
        reduction's all-reduce starts once its reduce-scatter has completed (`_Chained`)."""
        mesh, world = ctx.mesh, sharding_world(ctx.mesh, axis) * (1 if replicate is None else ctx.mesh.size(replicate))
        op: ReduceOp = "mean" if avg.is_default else "sum"
        y = x if avg.is_default else avg.before(x, world)
        # (axis= only for a named axis: a 1-D mesh's `*_start` need not take it)
        first = mesh.reduce_scatter_start(y, op) if axis is None else mesh.reduce_scatter_start(y, op, axis=axis)
        handle: Work = first
        if replicate is not None:
            handle = _Chained(first, lambda shard: mesh.all_reduce_start(shard, op, axis=replicate,
                                                                         inplace=shard is not x))  # fmt: skip
        return handle if avg.is_default else cast(Work, _averaged(handle, avg, world))

    def unit(grads: Tensor | Pieces, index: int, ctx: Context) -> Tensor | Work:
        world, out = ctx.mesh.world, None
        if ctx.place is not None and avg.is_default and axis is None and replicate is None and world > 1:
            out = ctx.place((*grads.shape[:-1], grads.shape[-1] // world), dtype or grads.dtype)
        if out is not None:  # a plain reduce-scatter puts the shard in its place in the step's gradient
            run = ctx.mesh.reduce_scatter_start if ctx.overlap else ctx.mesh.reduce_scatter
            if exact_division(world, out.dtype):  # (the concatenation, cast and mean's division: one pass)
                send = scratch.new_empty("reduce", out, grads.shape, passing=True)  # (reused within the step)
                return run(into(grads, send, world), "sum", out=out)
            return run(_cast(whole(grads), dtype), "mean", out=out)
        x = _cast(whole(grads), dtype)
        if ctx.overlap:  # started: the backward goes on while the collectives (both, for a hybrid one) run
            return start(x, ctx)
        return reduce(x, ctx)

    unit.takes_pieces = True  # type: ignore[attr-defined]  # (`fzero.layout.pieces`)
    return Transform(init, update, "reduce_scatter", unit, reduces=True, axis=axis, does=Does(shards=True),
                     per_rank=False)  # fmt: skip


def sharding_world(mesh: Mesh, axis: str | None) -> int:
    """The number of ranks a layout sharded over mesh axis `axis` (None: every rank) is split into; checks the
    axis first (`check_axes`)."""
    if axis is None:
        return mesh.world
    check_axes(mesh, axis)
    return mesh.size(axis)  # type: ignore[attr-defined]  # (check_axes: a mesh with named axes has `size`)


def check_axes(mesh: Mesh, axis: str | None, replicate: str | None = None) -> None:
    """Check that `mesh` has the named axes and that `axis` (the sharding axis) is its innermost one.

    Raises:
      ValueError: naming the missing axis, or the mesh's axes when `axis` is not the last.
    """
    if axis is None:
        return
    axes = tuple(getattr(mesh, "axes", ()))
    for name in (axis, replicate):
        if name is not None and name not in axes:
            raise ValueError(f"the chain shards over mesh axis {name!r}, but {mesh!r} has "
                             f"{'axes ' + str(list(axes)) if axes else 'no named axes'}: make it with "
                             f"shape={{'replicate': R, '{axis}': S}}")  # fmt: skip
    if axes[-1] != axis:
        raise ValueError(f"the chain shards over mesh axis {axis!r}, which must be the mesh's last (innermost) axis; "
                         f"{mesh!r} has axes {list(axes)}")  # fmt: skip


def shard_params(mesh: Mesh, layout: Layout, full: Tensor, axis: str | None = None) -> Tensor:
    """This rank's shard (rank-major) of a full, unit-major buffer: `mesh.local_shard(to_rank_major(layout, full))`,
    the inverse of `gather_params`, made unit by unit so that no rank-major copy of the whole buffer exists (at init
    of a large model that copy was a third one, beside the model's and the flat buffer).

    Args:
      mesh: the mesh.
      layout: the layout, sharded over `axis` (None: every rank).
      full: the full buffer (`[numel]`, or `[world, numel]` on a `SimMesh`).
      axis: the mesh axis the layout is sharded over.
    """
    out: Tensor | None = None
    for i in range(len(layout.units)):
        piece = mesh.local_shard(full[..., layout.unit_slice(i)], axis=axis)
        if out is None:
            out = piece.new_empty(*piece.shape[:-1], layout.shard_numel)
        out[..., layout.unit_shard_slice(i)].copy_(piece)
    assert out is not None  # (a layout has units)
    return out


def gather_params(
    mesh: Mesh,
    layout: Layout,
    params: Tensor,
    dtype: torch.dtype | None = None,
    block: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Full (unit-major) parameters from this rank's shard (or a full buffer, returned as is), cast to `dtype`
    before communicating; with `block`, every unit's piece of the shard as a quantized gather of it reads it
    (`gather(quantize=block)`: int8 per `block` elements of each unit's piece, read back in `dtype`). On a
    `DistMesh`, `out` (a full buffer of the dtype) is gathered into, in place, rather than a new one."""
    params = _cast(params, dtype)
    if layout.is_full(params):
        return params
    if block is not None:  # the values a unit-by-unit int8 gather gives (sent here as they are read back)
        pieces = [params[..., layout.unit_shard_slice(u)] for u in range(len(layout.units))]
        params = torch.cat([dequantize(*quantize(p, block), block, p.shape[-1]).to(p.dtype) for p in pieces], -1)
    # each unit's pieces gathered straight into its place in the full buffer (no rank-major copy to reorder), every
    # unit's gather in flight at once
    full = out if out is not None else params.new_empty(*params.shape[:-1], layout.numel)
    units = [u for u, unit in enumerate(layout.units) if unit.size]  # (a unit of frozen parameters: none here)
    works = [mesh.all_gather_into(full[..., layout.unit_slice(u)], params[..., layout.unit_shard_slice(u)], True,
                                  axis=layout.axis) for u in units]  # fmt: skip
    AllOf(works).wait()
    return full


@pytree.dataclasses.dataclass(frozen=True)
class GatherState:
    """`gather`'s state: what the step does with lazily gathered units (static; no tensor).

    Attributes:
      keep: keep every unit gathered from its forward to the end of its backward, and the gathered buffer through
        an accumulation window (ZeRO-1/2: FSDP's reshard-after-forward off); False: free each unit after its
        forward and gather it again for its backward (ZeRO-3).
      secondary_size: with a `secondary` axis (hpZ), its size `S`: each rank holds `1/S` of every unit between
        the unit's forward and its backward (`fzero.state_bytes`'s `secondary`); 1 without.
    """

    keep: bool = static_field(default=False)
    secondary_size: int = static_field(default=1)


register_torch_pytree(GatherState)


def gather(
    dtype: torch.dtype | None = None,
    lazy: bool = False,
    keep: bool = False,
    *,
    quantize: int | None = None,
    quantize_frozen: int | None = None,
    secondary: str | None = None,
) -> Transform:
    """Compute parameters (in `dtype`, default the master dtype) from the updated master parameters: gathered now,
    or with `lazy=True` kept as this rank's shard until the next step, which gathers them one unit at a time as
    the forward reaches them (prefetching ahead: the gathers overlap the forward), freeing each after its forward
    (ZeRO-3) or, with `keep=True`, keeping them through the backward (ZeRO-1/2: `GatherState`).

    ZeRO++'s two gather policies of stage 3 (lazy, not kept):

    - `quantize=block` (qwZ): each unit's gather sends int8 with one fp32 scale per `block` elements of the
      shard's piece (`fzero.transforms.quantize`): each gathered element differs from the shard's by at most
      `max|w_b| / 254` (its block's largest magnitude), plus the rounding to `dtype` when that is narrower than
      fp32 (`|w| 2^-8` for bf16); the shards themselves (and the master parameters) stay exact. With the layout's
      `align` (16) no block straddles two parameters. `quantize_frozen`: the same for the frozen parameters.
    - `secondary=axis` (hpZ): after a unit's forward gather (over the layout's ranks), each rank keeps its
      `1/S` of the gathered unit (`S = size(axis)`, the unit split into `S` chunks over the axis's group), and
      the unit's backward gathers it again from those within the group: nothing of it crosses the other axes.
      The values are the forward's, so the step is bitwise the same; the cost is `Psi / S` compute elements per
      rank from the first forward to the last backward (`fzero.state_bytes(state)["secondary"]`).

    Example:
        >>> import torch, fzero
        >>> tx = fzero.zero3(fzero.adamw(), precision="bf16")     # ends with gather(bfloat16, lazy=True)
        >>> state = fzero.init(torch.nn.Linear(4, 4), tx, fzero.SimMesh(2))
        >>> state.compute.dtype, state.sharded_at_rest
        (torch.bfloat16, True)
    """

    def apply(flow: Flow, ctx: Context) -> Flow:
        # shard_update may have written the compute copy already (fused low-precision copy, offload's copy)
        compute = flow.compute if flow.compute is not None else _cast(flow.params, dtype)
        if flow.sharded and not lazy:  # (at world 1 a shard is the full buffer: nothing to gather)
            compute = gather_params(ctx.mesh, ctx.layout, compute, dtype)
        return flow._replace(compute=compute)

    if keep and not lazy:
        raise ValueError("gather(keep=True) keeps lazily gathered units: it needs lazy=True")
    for name, block in (("quantize", quantize), ("quantize_frozen", quantize_frozen)):
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"gather({name}=...) needs None or an int >= 1 (elements per scale), got {block!r}")
    gather_spec = GatherSpec((quantize, quantize_frozen), secondary)
    if gather_spec != EXACT and (not lazy or keep):
        raise ValueError("gather(quantize=, quantize_frozen=, secondary=) act on units gathered in the forward and "
                         "again in the backward (stage 3): they need lazy=True and keep=False")  # fmt: skip
    state = GatherState(keep) if lazy else EmptyState()  # type: ignore[call-arg]  # (optree's field)

    def init(flow: Flow, ctx: Context) -> tuple[Flow, Any]:
        if secondary is None:
            return apply(flow, ctx), state
        return apply(flow, ctx), GatherState(keep, _secondary_size(ctx, secondary))  # type: ignore[call-arg]

    mode = ("keep" if keep else "lazy") if lazy else "now"
    return Transform(init, lambda flow, state, ctx: (apply(flow, ctx), state), "gather",
                     does=Does(gathers=mode, gather_spec=gather_spec), per_rank=False)  # fmt: skip


def _secondary_size(ctx: Context, axis: str) -> int:
    """The size of hpZ's secondary axis, checked: a mesh axis, and the layout sharded over every rank (a layout
    sharded over an axis already gathers within it)."""
    axes = tuple(getattr(ctx.mesh, "axes", ()))
    if axis not in axes:
        raise ValueError(f"gather(secondary={axis!r}) keeps a secondary copy sharded over mesh axis {axis!r}, but "
                         f"{ctx.mesh!r} has {'axes ' + str(list(axes)) if axes else 'no named axes'}: make it with "
                         f"shape={{'replicate': R, '{axis}': S}}")  # fmt: skip
    if ctx.layout.axis is not None:
        raise ValueError(f"gather(secondary={axis!r}) (hpZ) needs parameters sharded over every rank, but the chain "
                         f"shards them over axis {ctx.layout.axis!r} (hybrid): its gathers already stay within that "
                         "axis; drop one of the two")  # fmt: skip
    return ctx.mesh.size(axis)

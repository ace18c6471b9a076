"""The transform algebra's values: `Flow`, `StepInfo`, `Context`, `Transform` (`chain` composes them: `.chain`).

A step's gradient flows through a chain of transforms and changes form on the way: the full per-rank gradient
(`[numel]`) may be accumulated, reduced, scattered to this rank's shard (`[shard_numel]`), consumed by the optimizer
to produce new master parameters, which may be gathered back into full compute parameters. Each transform is a pair
of pure functions in the manner of optax:

    init(flow, ctx) -> (flow, state)            # at `fzero.init`: `flow.params` changes form as it will at update
    update(flow, state, ctx) -> (flow, state)   # at every micro-step

Three kinds of things travel, kept apart:

- `Flow`: what flows: `grads`, `params`, `compute`, and whether `grads` (at init: `params`) are this rank's shard;
- `StepInfo` (`flow.info`): what a step found out on the way: the factor the gradients still owe (1 / loss scale,
  times the clipping coefficient: paid in the optimizer's single read), their global statistics, whether they
  are averaged over ranks, whether the micro-step ends early, the metrics;
- `Context`: what is static: the mesh, the layout, donation, and (at init only) whether the parameters arrive
  already sharded.

A transform's state is its own: a chain's state is `{name: state}`, so no transform reads another's fields. A
transform is written for one rank (shard_map-style): its functions see this rank's values, and the chain runs them on
every rank (`Transform.per_rank`; `fzero.transforms.per_rank`).

**The reduction belongs to the chain at every stage.** A transform that averages gradients over ranks is marked
`reduces=True` and has a `unit` function: its work on one unit's full gradient. Stage 3 reduces each unit as soon
as its gradient is complete in the backward, with the chain's `unit` (the `unit` functions of the transforms up to
and including the reduction, composed), then runs the chain from after the reduction; stages 0-2 run the whole chain
on the whole buffer. A user's transform that wraps a reduction (to round, compress or sparsify gradients) is
therefore honoured identically at every stage. Example: docs/transforms.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from ..layout import Layout
from ..mesh import Mesh, Work
from ..sharding.gathered_unit import EXACT, GatherSpec

__all__ = [
    "Context",
    "Does",
    "EmptyState",
    "Flow",
    "GradStats",
    "InitFn",
    "StepInfo",
    "Transform",
    "UnitFn",
    "UpdateFn",
    "identity",
    "stateless",
]


class GradStats(NamedTuple):
    """Global statistics of the reduced gradients, computed once per step by whichever transform asks first.

    Attributes:
      sumsq: sum of squares over all ranks' shards (float64; padding is zero and adds nothing), of the gradients
        as they flow, before `StepInfo.grad_factor`.
      finite: whether every element on every rank is finite (the sum is inf or nan otherwise).
    """

    sumsq: float
    finite: bool


_NO_METRICS: Mapping[str, Any] = MappingProxyType({})


class StepInfo(NamedTuple):
    """What the step found out so far (see the module docstring).

    Attributes:
      grad_factor: a multiplier the gradients still owe (1 / loss scale, times the clipping coefficient), folded
        into the optimizer's read of them, so unscaling and clipping cost no pass of their own.
      stats: the step's `GradStats`, once computed.
      reduced: whether `grads` are averaged over ranks.
      deferred: the micro-step ends early (gradients held for accumulation, or a non-finite step skipped): the rest
        of the chain does nothing, and its state is unchanged.
      applied: the optimizer has applied the gradients.
      metrics: values to report (a fresh mapping per transform that adds to it).
      speculation: the update the backward computed ahead, unit by unit, before the step's checks were known
        (`fzero.transforms.speculate.Speculation`: SuperOffload), for the updating transform to validate and take;
        None without.
    """

    grad_factor: float = 1.0
    stats: GradStats | None = None
    reduced: bool = False
    deferred: bool = False
    applied: bool = False
    metrics: Mapping[str, Any] = _NO_METRICS
    speculation: Any = None


class Flow(NamedTuple):
    """The values a transform reads and returns.

    Attributes:
      grads: the gradient per rank in its current form; None at init only.
      params: the master parameters per rank (this rank's shard, or the full buffer at stage 0).
      compute: compute parameters for the next forward (full, or this rank's shard to be gathered at the next
        step's start), or None if stale.
      sharded: whether `grads` (at init: `params`) are this rank's shard rather than full buffers.
      info: the step's `StepInfo` so far.
    """

    grads: Tensor | None
    params: Tensor
    compute: Tensor | None
    sharded: bool = False
    info: StepInfo = StepInfo()

    def with_info(self, **changes: Any) -> Flow:
        return self._replace(info=self.info._replace(**changes))

    def with_metrics(self, **values: Any) -> Flow:
        return self.with_info(metrics={**self.info.metrics, **values})

    def gradients(self, what: str) -> Tensor:
        """`grads`, which an update always carries (None only at init: `what` names the transform asking)."""
        if self.grads is None:
            raise ValueError(f"{what}: the flow carries no gradients (an update called with an init-time flow?)")
        return self.grads

    def unscaled(self) -> Flow:
        """The flow with the factor the gradients owe paid now (for a transform that must see their true scale,
        e.g. one that adds noise); costs one pass over them."""
        factor = self.info.grad_factor
        if factor == 1.0 or self.grads is None:
            return self
        return self._replace(grads=self.grads * factor).with_info(grad_factor=1.0)


class Context(NamedTuple):
    """What a transform may read besides the flow.

    Attributes:
      mesh: the mesh. A per-rank transform (`Transform.per_rank`, the default) sees its rank's `RankMesh`: `rank`
        is an int and the collectives take and return this rank's own values.
      layout: the flat buffer's layout.
      donate: buffers may be overwritten in place.
      presharded: at init, `flow.params` arrive already sharded (sharded construction from a `meta` model).
      overlap: a `unit` reduction may return a handle rather than wait for its result (see `UnitFn`).
      place: where a `unit` reduction may put its result: `place(shape, dtype)` is the result's place in the step's
        gradient, or None where it has none of that shape and dtype (a reduction that puts it elsewhere returns its
        own buffer).
      step: the micro-step being taken (`TrainState.step`; 0 at init).
      seed: the state's random stream (`TrainState.seed`).
      key: a random seed for what this rank holds, for `torch.Generator().manual_seed(key)`: equal on every rank
        that holds the same values (the whole reduced gradient at stage 0; the same shard on the replicas of a
        hybrid mesh), different where they differ (each rank's own gradient before the reduction; each shard after
        it), different per step, per transform (its place in the chain) and per unit, so that noise drawn with it
        keeps replicas equal and is the same on every mesh (set per rank by the chain: `fzero.transforms.per_rank`).
      rank_key: a random seed different on every rank (draws that may make replicas differ).
      path: the names of the chains and the transform this context was made for, outermost first.
    """

    mesh: Mesh
    layout: Layout
    donate: bool = False
    presharded: bool = False
    overlap: bool = False
    place: Callable[[tuple[int, ...], torch.dtype], Tensor | None] | None = None
    step: int = 0
    seed: int = 0
    key: int = 0
    rank_key: int = 0
    path: tuple[str, ...] = ()


class InitFn(Protocol):
    def __call__(self, flow: Flow, ctx: Context) -> tuple[Flow, Any]: ...


class UpdateFn(Protocol):
    def __call__(self, flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]: ...


class UnitFn(Protocol):
    """A transform's work on one unit's full gradient (`[unit size]` per rank) before or as the reduction; the
    reduction returns this rank's part of the averaged unit (`[unit size / world]`), or, when `ctx.overlap`, may
    return a handle whose `wait()` returns it (`mesh.reduce_scatter_start`): the backward goes on meanwhile."""

    def __call__(self, grads: Tensor, unit: int, ctx: Context, /) -> Tensor | Work: ...


class EmptyState(NamedTuple):
    """The state of a transform that keeps none."""


class Does(NamedTuple):
    """What a transform does for the step, declared by the transform itself (`fzero.Plan` is derived from these
    and from `Transform.reduces`, never from names).

    Attributes:
      accumulates: micro-steps it averages before the rest of the chain runs (0: it does not accumulate).
      scales_loss: its state is the loss scale the step multiplies the loss by (it has `scale(loss)` and
        `loss_scale`).
      updates: it applies the optimizer (its state is the optimizer's: what the engine counts updates with).
      gathers: how it makes the compute parameters from the master ones: `"now"`, `"lazy"` or `"keep"` (see
        `fzero.gather`); None: it does not.
      gather_spec: how its lazily gathered units travel (`fzero.sharding.gathered_unit.GatherSpec`: quantized,
        re-gathered from a secondary copy).
      shards: its `init` shards the parameters and takes them already sharded (`Context.presharded`), so
        `fzero.init` may construct the shard unit by unit instead of cutting a full copy.
      spill: its `init` writes the master shard to disk (the NVMe tier: `Offload("nvme")`'s directory), reading it
        once, chunk by chunk: `fzero.init` may then construct the shard in a file under this directory rather than
        in memory (`fzero.storage.Spill`). None: it keeps the shard in memory.
    """

    accumulates: int = 0
    scales_loss: bool = False
    updates: bool = False
    gathers: str | None = None
    gather_spec: GatherSpec = EXACT
    shards: bool = False
    spill: str | os.PathLike[str] | None = None


class Transform(NamedTuple):
    """A transform (see the module docstring).

    Attributes:
      init, update: the pair of pure functions.
      name: what its state is found and saved under in a chain (a renamed class or an inserted transform changes
        no key).
      unit: its work on one unit's gradient, when it can run before or as the reduction at stage 3 (see
        `UnitFn`); None when it cannot.
      reduces: it averages gradients over ranks (`unit` then returns the reduced part).
      children: for a chain, its `(name, transform)` pairs.
      axis: the mesh axis its reduction shards over (`reduce_scatter(axis=...)`; a chain's is its first child's):
        `fzero.init` lays the parameters out over that axis's ranks; None: every rank.
      does: what it does for the step (`Does`); a chain's own is empty (its children declare).
      speculate: for the updating transform, its update's speculative form (SuperOffload): `speculate(params,
        state, ctx, factor)` starts a `fzero.transforms.speculate.Speculation` that updates unit by unit as the
        backward reduces each unit's gradient; None: it cannot.
      per_rank: its functions are written for one rank (the default): they see this rank's values (its gradient,
        its shard; its own state) and its `RankMesh` in `ctx.mesh`, and the chain runs them once per rank
        (`fzero.Mesh.run`), so they give the same result on every mesh. False: they see the mesh's per-rank values
        at once (a `[world, ...]` stack on a `SimMesh`) and must treat the leading axis as the mesh does: the
        library's own reductions, update, gather, accumulation and loss scale are written so, for speed.
    """

    init: InitFn
    update: UpdateFn
    name: str = "transform"
    unit: UnitFn | None = None
    reduces: bool = False
    children: tuple[tuple[str, Transform], ...] = ()
    axis: str | None = None
    does: Does = Does()
    speculate: Callable[..., Any] | None = None
    per_rank: bool = True


def stateless(fn: Callable[[Flow, Context], Flow], name: str, unit: UnitFn | None = None,
              per_rank: bool = True) -> Transform:  # fmt: skip
    """A transform without state from `fn(flow, ctx) -> flow` (and its per-unit form, if any), written for one rank
    unless `per_rank=False` (see `Transform.per_rank`).

    Example:
      >>> import torch
      >>> halve = stateless(lambda flow, ctx: flow._replace(grads=flow.grads / 2), "halve")
      >>> halve.init(Flow(None, torch.zeros(2), None), None)[1]
      EmptyState()
    """
    return Transform(lambda flow, ctx: (flow, EmptyState()), lambda flow, state, ctx: (fn(flow, ctx), state), name,
                     unit, per_rank=per_rank)  # fmt: skip


def identity() -> Transform:
    """The transform that changes nothing and holds no state (it can run per unit)."""

    def unit(grads: Tensor, index: int, ctx: Context) -> Tensor:
        return grads

    unit.takes_pieces = True  # type: ignore[attr-defined]  # (passed on as they came: `fzero.layout.pieces`)
    return stateless(lambda flow, ctx: flow, "identity", unit=unit, per_rank=False)

"""The transform algebra: `Flow`, `StepInfo`, `Context`, `Transform`, `chain`.

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

A transform's state is its own: a chain's state is `{name: state}`, so no transform reads another's fields.

**The reduction belongs to the chain at every stage.** A transform that averages gradients over ranks is marked
`reduces=True` and has a `unit` function: its work on one unit's full gradient. Stage 3 reduces each unit as soon
as its gradient is complete in the backward, with the chain's `unit` (the `unit` functions of the transforms up to
and including the reduction, composed), then runs the chain from after the reduction; stages 0-2 run the whole chain
on the whole buffer. A user's transform that wraps a reduction (to round, compress or sparsify gradients) is
therefore honoured identically at every stage. Example: docs/transforms.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor

from .. import native
from ..layout import Layout
from ..layout.pieces import takes_pieces
from ..mesh import Mesh, Work
from ..state.plan import EXACT, GatherSpec

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
    "chain",
    "find",
    "grad_stats",
    "identity",
    "lookup",
    "named_chain",
    "stateless",
    "unit_reducer",
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
    """Static facts every transform may read: the mesh, the layout, whether buffers may be donated, at init whether
    `flow.params` arrive already sharded (sharded construction from a `meta` model), whether a `unit` reduction
    may return a handle rather than wait for its result (`overlap`: see `UnitFn`), and where a `unit` reduction may
    put its result: `place(shape, dtype)` is the result's place in the step's gradient, or None where it has none
    of that shape and dtype (a reduction that puts it elsewhere returns its own buffer)."""

    mesh: Mesh
    layout: Layout
    donate: bool = False
    presharded: bool = False
    overlap: bool = False
    place: Callable[[tuple[int, ...], torch.dtype], Tensor | None] | None = None


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
      gather_spec: how its lazily gathered units travel (`fzero.state.plan.GatherSpec`: quantized, re-gathered
        from a secondary copy).
    """

    accumulates: int = 0
    scales_loss: bool = False
    updates: bool = False
    gathers: str | None = None
    gather_spec: GatherSpec = EXACT


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


def stateless(fn: Callable[[Flow, Context], Flow], name: str, unit: UnitFn | None = None) -> Transform:
    """A transform without state from `fn(flow, ctx) -> flow` (and its per-unit form, if any).

    Example:
      >>> import torch
      >>> halve = stateless(lambda flow, ctx: flow._replace(grads=flow.grads / 2), "halve")
      >>> halve.init(Flow(None, torch.zeros(2), None), None)[1]
      EmptyState()
    """
    return Transform(lambda flow, ctx: (flow, EmptyState()), lambda flow, state, ctx: (fn(flow, ctx), state), name,
                     unit)  # fmt: skip


def identity() -> Transform:
    """The transform that changes nothing and holds no state (it can run per unit)."""

    def unit(grads: Tensor, index: int, ctx: Context) -> Tensor:
        return grads

    unit.takes_pieces = True  # type: ignore[attr-defined]  # (passed on as they came: `fzero.layout.pieces`)
    return stateless(lambda flow, ctx: flow, "identity", unit=unit)


def _unique(names: list[str]) -> list[str]:
    """Names made unique in order: a repeated name gets `#1`, `#2`, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}#{n}")
    return out


def _compose_units(pairs: tuple[tuple[str, Transform], ...]) -> tuple[UnitFn | None, bool]:
    """The chain's `unit` (the per-unit forms up to and including the first reduction) and whether it reduces."""
    upto = next((i for i, (_, t) in enumerate(pairs) if t.reduces), None)
    if upto is None:
        return None, False
    maybe = [t.unit for _, t in pairs[: upto + 1]]
    prefix = [u for u in maybe if u is not None]
    if len(prefix) < len(maybe):
        return None, True

    def unit(grads: Tensor, index: int, ctx: Context) -> Tensor | Work:
        for fn in prefix[:-1]:  # before the reduction: no handle, a tensor
            grads = cast(Tensor, fn(grads, index, ctx))
        return prefix[-1](grads, index, ctx)

    unit.takes_pieces = all(takes_pieces(fn) for fn in prefix)  # type: ignore[attr-defined]  # (`fzero.layout.pieces`)
    return unit, True


def named_chain(*pairs: tuple[str, Transform], name: str = "chain") -> Transform:
    """Compose transforms left to right; the state is `{name: state}`, in order.

    A transform that defers the micro-step (`accumulate` before its boundary) stops the chain there: the
    transforms after it do no work and keep their state. Gradients that arrive reduced (stage 3 reduced them unit
    by unit with this chain's `unit`) skip the transforms up to and including the reduction.

    Example:
      >>> import fzero
      >>> tx = fzero.named_chain(("reduce", fzero.reduce_scatter()), ("adam", fzero.shard_update(fzero.adamw())))
      >>> tx.reduces, tx.unit is not None
      (True, True)
    """
    names = [n for n, _ in pairs]
    for i, (n, t) in enumerate(pairs):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} ({n!r}) is a {type(t).__name__}, not a Transform")
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    unit, reduces = _compose_units(pairs)
    # where gradients that arrive reduced resume: after the reducing transform, or at it when it is a chain itself
    # (it skips to after its own reduction, and runs what follows the reduction inside it)
    first_after = next((i + (not t.children) for i, (_, t) in enumerate(pairs) if t.reduces), 0)

    def init(flow: Flow, ctx: Context) -> tuple[Flow, dict[str, Any]]:
        states = {}
        for n, t in pairs:
            flow, states[n] = t.init(flow, ctx)
        return flow, states

    def update(flow: Flow, state: dict[str, Any], ctx: Context) -> tuple[Flow, dict[str, Any]]:
        if not isinstance(state, dict) or list(state) != names:
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"chain of transforms {names} got a state for {got}; was the chain changed after init?")
        new = dict(state)
        for n, t in pairs[first_after if flow.info.reduced else 0 :]:
            flow, new[n] = t.update(flow, state[n], ctx)
            if flow.info.deferred:
                break
        return flow, new

    axis = next((t.axis for _, t in pairs if t.axis is not None), None)
    return Transform(init, update, name, unit, reduces, tuple(pairs), axis)


def chain(*transforms: Transform) -> Transform:
    """Compose transforms left to right; the state is `{name: state}` under each transform's name (`#1`, `#2` for
    repeats), see `named_chain`.

    Example:
      >>> import fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.shard_update(fzero.adamw(1e-3)), fzero.gather())
      >>> [name for name, _ in tx.children]
      ['reduce_scatter', 'shard_update', 'gather']
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a Transform")
    return named_chain(*zip(_unique([t.name for t in transforms]), transforms, strict=True))


def unit_reducer(tx: Transform) -> UnitFn:
    """The per-unit reduction of a chain (what stage 3 calls for each unit as its gradient completes).

    Raises:
      ValueError: the chain does not reduce, or a transform before its reduction cannot run per unit (it names it).
    """
    if tx.unit is not None and tx.reduces:
        return tx.unit
    if not tx.reduces:
        raise ValueError(
            f"{tx.name}: stage 3 reduces each unit's gradient in the backward with the chain's reduction, but the "
            "chain has none: put reduce_scatter() (or a transform wrapping it) in it"
        )
    where, reduction = _blocker(tx)
    if reduction:
        raise ValueError(f"stage 3 reduces each unit's gradient in the backward, but {where} is the chain's "
                         "reduction and has no unit form: give it one (fzero.Transform(..., unit=...)), or use it at "
                         "stages 0-2, which reduce the whole gradient after the backward")  # fmt: skip
    raise ValueError(f"stage 3 reduces each unit's gradient in the backward, but {where} comes before the "
                     "reduction and cannot run per unit: put it after reduce_scatter(), or give it a unit function "
                     "(fzero.Transform(..., unit=...))")  # fmt: skip


def _blocker(tx: Transform) -> tuple[str, bool]:
    """The first transform up to the reduction without a per-unit form, named along its chains, and whether it is
    the reduction itself."""
    for name, t in tx.children:
        if t.children and t.reduces and t.unit is None:
            where, reduction = _blocker(t)
            return f"{name}/{where}", reduction
        if t.unit is None:
            return repr(name), t.reduces
        if t.reduces:
            break
    return repr(tx.name), tx.reduces and not tx.children


def lookup(tx_state: Any, name: str) -> Any:
    """The state of the first transform called `name` (searching nested chains in order), or None.

    Example:
      >>> import torch, fzero
      >>> state = fzero.init(torch.nn.Linear(2, 2), fzero.zero2(fzero.adamw()), fzero.SimMesh(1))
      >>> int(lookup(state.tx_state, "shard_update").count)
      0
    """
    if not isinstance(tx_state, dict):
        return None
    if name in tx_state:
        return tx_state[name]
    for sub in tx_state.values():
        found = lookup(sub, name)
        if found is not None:
            return found
    return None


def find(tx_state: Any, kind: type | tuple[type, ...]) -> Any:
    """The first state of type `kind` in a chain's state (searching nested chains in order), or None.

    What a transform *is* shows in the type of the state it keeps (`GatherState`, `AccumulateState`), which a
    user's name for it in `named_chain` does not change; use this, not `lookup`, to ask what a chain does.

    Example:
      >>> import torch, fzero
      >>> from fzero.transforms.collective import GatherState
      >>> tx = fzero.named_chain(("r", fzero.reduce_scatter()), ("u", fzero.shard_update(fzero.adamw())),
      ...                        ("g", fzero.gather(lazy=True, keep=True)))
      >>> find(fzero.init(torch.nn.Linear(2, 2), tx, fzero.SimMesh(2)).tx_state, GatherState).keep
      True
    """
    if isinstance(tx_state, kind):
        return tx_state
    if isinstance(tx_state, dict):
        for sub in tx_state.values():
            found = find(sub, kind)
            if found is not None:
                return found
    return None


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
        total = mesh.all_reduce(native.sumsq(_own_part(mesh, grads)), "sum")
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


def _own_part(mesh: Mesh, x: Tensor) -> Tensor:
    """Rank r's r-th part of the last dimension of `x`: `mesh.local_shard(x)`, but a view on a `DistMesh` (read
    once, so not worth `local_shard`'s copy)."""
    rank = mesh.rank
    if isinstance(rank, int):
        s = x.shape[-1] // mesh.world
        return x[..., rank * s : (rank + 1) * s]
    return mesh.local_shard(x)

"""The transform algebra: `Flow`, `Context`, `Transform` and `chain`.

A step's gradient flows through a chain of transforms and changes form on the way: the full per-rank gradient
(`[numel]`) may be accumulated, reduced, scattered to this rank's shard (`[shard_numel]`), consumed by the optimizer
to produce new master parameters, which may be gathered back into full compute parameters. A `Flow` carries all of
it, and each transform is a pair of pure functions in the manner of optax:

    init(flow, ctx) -> (flow, state)            # at `fzero.init`: `flow.params` changes form as it will at update
    update(flow, state, ctx) -> (flow, state)   # at every micro-step

`init` sees a flow whose `params` are the full initial parameters and `grads` is None; a transform that changes the
form of gradients at update (`reduce_scatter`) changes the form of `params` at init, so every transform sees, at
init, parameters in the form its gradients will have at update, and sizes its state from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import native
from ..layout import Layout
from ..mesh import Mesh

__all__ = ["Context", "Flow", "GradStats", "Transform", "chain", "grad_stats", "identity", "lookup", "named_chain"]


class GradStats(NamedTuple):
    """Global statistics of the reduced gradients, computed once per step by whichever transform asks first.

    Attributes:
      sumsq: sum of squares over all ranks' shards (float64; padding is zero and adds nothing), of the gradients
        as they flow, before `Flow.grad_factor`.
      finite: whether every element on every rank is finite (the sum is inf or nan otherwise).
    """

    sumsq: float
    finite: bool


class Flow(NamedTuple):
    """The values a transform reads and returns.

    Attributes:
      grads: the gradient per rank in its current form (full or shard); None once the optimizer consumed it.
      params: the master parameters per rank (this rank's shard, or the full buffer at stage 0).
      compute: compute parameters for the next forward (full, or this rank's shard to be gathered at the next
        step's start), or None if stale.
      metrics: values to report (a fresh mapping per transform that adds to it).
      deferred: True when this micro-step ends early (gradients held for accumulation, or a non-finite step
        skipped): the rest of the chain does nothing, and its state is unchanged.
      reduced: whether `grads` have been averaged over ranks.
      grad_factor: a multiplier the gradients still owe (1 / loss scale, times the clipping coefficient): folded
        into the optimizer's read of the gradients, so unscaling and clipping cost no pass of their own.
      loss_scale: the loss scale value (see `fzero.loss_scale`), or None.
      stats: the step's `GradStats`, once computed.
      reduce_dtype: at init, the dtype `reduce_scatter` communicates gradients in (recorded in the state, so a
        step that reduces gradients itself, unit by unit, does it in the same dtype).
      presharded: at init, `params` are already this rank's shard (sharded construction from a `meta` model), so
        `reduce_scatter` has nothing left to shard.
    """

    grads: Tensor | None
    params: Tensor
    compute: Tensor | None
    metrics: Mapping[str, Any]
    deferred: bool = False
    reduced: bool = False
    grad_factor: float = 1.0
    loss_scale: Any = None
    stats: GradStats | None = None
    reduce_dtype: torch.dtype | None = None
    presharded: bool = False

    def is_full(self, layout: Layout, x: Tensor | None = None) -> bool:
        """Whether `x` (default: `params`) is a full buffer rather than a shard (both, when world is 1)."""
        x = self.params if x is None else x
        return x.shape[-1] == layout.numel

    def with_metrics(self, **values: Any) -> Flow:
        return self._replace(metrics={**self.metrics, **values})


class Context(NamedTuple):
    """Static facts every transform may read: the mesh, the layout, and whether buffers may be donated."""

    mesh: Mesh
    layout: Layout
    donate: bool = False


class Transform(NamedTuple):
    """A pair of pure functions (see the module docstring) and a name: in a chain, a transform's state is found
    (and saved in checkpoints) under its name, which neither a renamed class nor an inserted transform changes."""

    init: Callable[[Flow, Context], tuple[Flow, Any]]
    update: Callable[[Flow, Any, Context], tuple[Flow, Any]]
    name: str = "transform"


def identity() -> Transform:
    """The transform that changes nothing and holds no state."""
    return Transform(lambda flow, ctx: (flow, ()), lambda flow, state, ctx: (flow, state), "identity")


def _unique(names: list[str]) -> list[str]:
    """Names made unique in order: a repeated name gets `#1`, `#2`, ... (as optax's `named_chain` needs them)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}#{n}")
    return out


def named_chain(*pairs: tuple[str, Transform], name: str = "chain") -> Transform:
    """Compose transforms left to right; the state is `{name: state}`, in order.

    A transform that defers the micro-step (`accumulate` before its boundary) stops the chain there: the
    transforms after it do no work and keep their state.

    Example:
      >>> import fzero
      >>> tx = fzero.named_chain(("reduce", fzero.reduce_scatter()), ("adam", fzero.shard_update(fzero.adamw())))
    """
    names = [n for n, _ in pairs]
    for i, (n, t) in enumerate(pairs):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} ({n!r}) is a {type(t).__name__}, not a Transform")
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")

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
        for n, t in pairs:
            flow, new[n] = t.update(flow, state[n], ctx)
            if flow.deferred:
                break
        return flow, new

    return Transform(init, update, name)


def chain(*transforms: Transform) -> Transform:
    """Compose transforms left to right; the state is `{name: state}` under each transform's name (`#1`, `#2` for
    repeats), see `named_chain`.

    Example:
      >>> import fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.shard_update(fzero.adamw(1e-3)), fzero.gather())
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a Transform")
    return named_chain(*zip(_unique([t.name for t in transforms]), transforms, strict=True))


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


def grad_stats(flow: Flow, ctx: Context, what: str) -> tuple[Flow, GradStats]:
    """The step's global gradient statistics: computed on first use (one pass over this rank's gradients and a
    one-element all-reduce when they are sharded), then carried in the flow for the transforms after."""
    if flow.stats is not None:
        return flow, flow.stats
    if not flow.reduced:
        raise ValueError(f"{what}() needs reduced gradients: put it after reduce_scatter() or all_reduce()")
    local = native.sumsq(flow.grads)  # float64; one pass, the native kernel on CPU (torch's vector norm elsewhere)
    total = local if flow.is_full(ctx.layout, flow.grads) else ctx.mesh.all_reduce(local, "sum")
    sumsq = float(ctx.mesh.unreplicate(total))
    stats = GradStats(sumsq, math.isfinite(sumsq))
    return flow._replace(stats=stats), stats

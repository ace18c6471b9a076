"""ZeRO-3's unit-at-a-time gathering inside the forward and the backward.

Stage 3 keeps each rank's compute parameters as a shard. Within a step a unit's full buffer exists only while the
unit computes:

    forward    pre-hook of the unit's module:  all-gather it (or wait for its prefetch); prefetch the next unit
               post-hook:                      free it; wrap its outputs so that their backward re-gathers it
    backward   its outputs' gradients arrive:  all-gather it again; prefetch the unit before it
               its gradient is complete:       reduce-scatter the gradient (mean over ranks) into this rank's
                                               gradient shard, free the unit

so full parameters and full gradients never exist for more than the live units (at most `1 + prefetch`, bounded by
`max_live_elements`). Units that are not modules (the root unit: parameters outside the `ModuleList` children) and
units at or below `persistence_threshold` elements are gathered once at the start and kept until their gradient is
reduced: the backward begins where the forward ended, so re-gathering them would only add traffic. Per step and
rank this moves `Psi` (forward gathers) `+ Psi - Psi_kept` (backward gathers) `+ Psi` (reduce-scatters) elements.

Why this mechanism: `torch.func` can neither differentiate through collectives nor accept saved-tensor hooks
(docs/design.md, "Stage 3: one unit at a time"), so this path runs plain autograd. A unit's full buffer is the
output of an autograd Function whose backward receives the unit's complete gradient exactly once, after its last
use; the buffer's storage is resized to zero after the forward and refilled before the backward (FSDP's technique),
so the tensors autograd saved stay valid, and writing through a separate alias keeps their version counters
untouched.

On a `SimMesh` the ranks run one after another, so a unit's gradient is reduced once every rank's backward is done;
the arithmetic (a rank-ordered sum divided by the world size) and the ledger are those of a real run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn

from .layout import ROOT_UNIT, Layout
from .mesh import Mesh, SimMesh, Work, done

__all__ = ["GatherPolicy", "UnitGathering", "sharded_backward"]


@dataclass(frozen=True)
class GatherPolicy:
    """How stage 3 gathers units (DeepSpeed's names in brackets).

    Attributes:
      prefetch: units gathered ahead of the one computing [`stage3_prefetch_bucket_size`, in units].
      max_live_elements: the most gathered elements alive at once; a prefetch that would exceed it waits
        [`stage3_max_live_parameters`]. None: no bound beyond `prefetch`.
      persistence_threshold: units with at most this many elements stay gathered for the whole step
        [`stage3_param_persistence_threshold`].
      timings: report each gathered-on-demand unit's forward and backward wall time (seconds, rank 0's on a
        SimMesh) in the step's metrics as `unit_times`: `{unit name: (forward, backward)}`.
    """

    prefetch: int = 1
    max_live_elements: int | None = None
    persistence_threshold: int = 0
    timings: bool = False

    def __post_init__(self) -> None:
        for name in ("prefetch", "persistence_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GatherPolicy.{name} must be an int >= 0, got {value!r}")
        if self.max_live_elements is not None and (
            isinstance(self.max_live_elements, bool)
            or not isinstance(self.max_live_elements, int)
            or self.max_live_elements < 1
        ):
            got = self.max_live_elements
            raise ValueError(f"GatherPolicy.max_live_elements must be None or an int >= 1, got {got!r}")


class _Unit(torch.autograd.Function):
    """shard slice -> the unit's full buffer (an alias of the gatherer's storage for the unit, which the gatherer
    fills and frees); backward: hand the unit's complete gradient to the gatherer."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, gatherer: _Gatherer, index: int) -> Tensor:
        ctx.gatherer, ctx.index = gatherer, index
        store = gatherer.store[index]
        return store.new_empty(0).set_(store.untyped_storage(), 0, store.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        ctx.gatherer.unit_backward(ctx.index, grad)
        return None, None, None


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward re-gathers the unit before autograd enters it."""

    @staticmethod
    def forward(ctx: Any, gatherer: _Gatherer, index: int, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.gatherer, ctx.index = gatherer, index
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.gatherer.before_backward(ctx.index)
        return (None, None, *grads)


class _Gatherer:
    """One rank's gathered units for one forward and backward."""

    def __init__(
        self,
        mesh: Mesh,
        layout: Layout,
        model: nn.Module,
        shard: Tensor,
        policy: GatherPolicy,
        reduce_dtype: torch.dtype | None,
        sim: tuple[Tensor, int] | None,
    ) -> None:
        self.mesh, self.layout, self.policy, self.reduce_dtype, self.sim = mesh, layout, policy, reduce_dtype, sim
        self.shard = shard
        modules = dict(model.named_modules())
        unit_of = {leaf.name: leaf.unit for leaf in layout.leaves}
        # a parameter tied across units must be reachable whenever either unit runs: keep such units gathered
        crossed = {
            unit_of[name]
            for alias, name in layout.aliases
            if not alias.startswith(f"{layout.units[unit_of[name]].name}.")
        }
        self.modules: dict[int, nn.Module] = {
            i: modules[u.name]
            for i, u in enumerate(layout.units)
            if u.name != ROOT_UNIT and u.name in modules and u.numel > policy.persistence_threshold and i not in crossed
        }
        self.sequence = sorted(self.modules)  # forward order of the gathered-on-demand units
        n = len(layout.units)
        self.store: list[Tensor | None] = [None] * n
        self.views: list[dict[str, Tensor] | None] = [None] * n
        self.swapped: dict[int, list[tuple[nn.Module, str, Tensor]]] = {}
        self.live = [False] * n
        self.pending: dict[int, Work] = {}
        self.done = [False] * n
        self.live_elements = self.peak = 0
        grad_dtype = reduce_dtype or shard.dtype
        # on a SimMesh the units' full gradients are kept (unit_grads) and reduced once every rank is done
        self.grad_shard = (
            torch.zeros(layout.shard_numel, dtype=grad_dtype, device=shard.device) if sim is None else None
        )
        self.unit_grads: dict[int, Tensor] = {}
        self.clock: dict[int, float] = {}  # when the unit's current forward or backward began
        self.times = {layout.units[i].name: [0.0, 0.0] for i in self.modules} if policy.timings else None

    # -- buffers -------------------------------------------------------------------------------------------------
    def _node(self, i: int) -> dict[str, Tensor]:
        """The unit's autograd node and named views of its full buffer, created just before the unit first runs:
        autograd orders its backward by creation, so the unit's gradient completes right after its backward."""
        if self.views[i] is None:
            self.materialize(i)
            unit = self.layout.units[i]
            full = _Unit.apply(self.shard[self.layout.unit_shard_slice(i)], self, i)
            views = {}
            for leaf in self.layout.leaves:
                if leaf.unit == i:
                    start = leaf.offset - unit.start
                    views[leaf.name] = full[start : start + leaf.numel].view(leaf.shape)
            self.views[i] = views
        return self.views[i]

    def params(self) -> dict[str, Tensor]:
        """Named views of the units kept gathered for the whole step; the others are swapped into their modules
        when they run."""
        out: dict[str, Tensor] = {}
        for i in range(len(self.layout.units)):
            if i not in self.modules:
                out.update(self._node(i))
        for alias, name in self.layout.aliases:
            if name in out:
                out[alias] = out[name]
        return out

    def _start(self, i: int, ahead: bool = False) -> None:
        """Gather unit `i` into its storage: asynchronously when prefetching `ahead` of its use, else at once (an
        async collective waited on immediately buys nothing and leaves one more handle in flight)."""
        unit, store = self.layout.units[i], self.store[i]
        if store is None:
            store = self.store[i] = self.shard.new_empty(unit.size)
        else:
            store.untyped_storage().resize_(unit.size * store.element_size())
        # an alias of the storage: writes through it leave the version counter autograd checks untouched
        alias = store.new_empty(0).set_(store.untyped_storage(), 0, (unit.size,))
        piece = self.layout.unit_shard_slice(i)
        if self.sim is None:
            self.pending[i] = self.mesh.all_gather_into(alias, self.shard[piece].detach(), async_op=ahead)
        else:
            shards, rank = self.sim
            alias.copy_(shards[:, piece].reshape(-1))
            if rank == 0:  # the simulated ranks gather together: count the collective once
                self.mesh.account("all_gather", unit.size)
        self.live[i] = True
        self.live_elements += unit.size
        self.peak = max(self.peak, self.live_elements)

    def materialize(self, i: int) -> None:
        if not self.live[i]:
            self._start(i)
        work = self.pending.pop(i, None)
        if work is not None:
            work.wait()

    def release(self, i: int) -> None:
        if self.live[i]:
            self.pending.pop(i, done).wait()
            self.store[i].untyped_storage().resize_(0)
            self.live[i] = False
            self.live_elements -= self.layout.units[i].size

    def _prefetch(self, i: int, step: int) -> None:
        """Start gathering the next `prefetch` units after `i` in forward (`step=1`) or backward (`-1`) order."""
        pos = self.sequence.index(i)
        for k in range(1, self.policy.prefetch + 1):
            j = pos + step * k
            if not 0 <= j < len(self.sequence):
                return
            nxt = self.sequence[j]
            if self.live[nxt] or self.done[nxt]:
                continue
            size = self.layout.units[nxt].size
            if self.policy.max_live_elements is not None and self.live_elements + size > self.policy.max_live_elements:
                return
            self._start(nxt, ahead=True)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def install(self) -> list[Any]:
        """Register the forward hooks on the gathered-on-demand units' modules; returns their handles."""
        handles = []
        for i, module in self.modules.items():
            handles.append(module.register_forward_pre_hook(lambda m, a, i=i: self.pre_forward(i)))
            handles.append(module.register_forward_hook(lambda m, a, o, i=i: self.post_forward(i, o)))
        return handles

    def _tick(self, i: int, phase: int | None) -> None:
        """Start (`phase=None`) or stop (0: forward, 1: backward) unit `i`'s clock."""
        if self.times is None:
            return
        now = time.perf_counter()
        if phase is None:
            self.clock[i] = now
        elif i in self.clock:
            self.times[self.layout.units[i].name][phase] += now - self.clock.pop(i)

    def pre_forward(self, i: int) -> None:
        self._tick(i, None)
        views = self._node(i)
        self.materialize(i)
        self._prefetch(i, 1)
        prefix = self.layout.units[i].name + "."
        module = self.modules[i]
        swapped = self.swapped.setdefault(i, [])
        for name, view in views.items():
            owner_path, _, pname = name[len(prefix) :].rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            swapped.append((owner, pname, owner._parameters[pname]))
            owner._parameters[pname] = view  # as functional_call does: the module computes with the views

    def restore(self, i: int) -> None:
        for owner, pname, original in reversed(self.swapped.pop(i, [])):
            owner._parameters[pname] = original

    def post_forward(self, i: int, output: Any) -> Any:
        self.restore(i)
        self._tick(i, 0)
        leaves, spec = optree.tree_flatten(output)
        grads = [k for k, x in enumerate(leaves) if isinstance(x, Tensor) and x.requires_grad]
        if not grads:  # no output to hook the re-gather on: keep the unit until its gradient is reduced
            return output
        self.release(i)
        wrapped = _PreBackward.apply(self, i, *(leaves[k] for k in grads))
        for k, x in zip(grads, wrapped, strict=True):
            leaves[k] = x
        return optree.tree_unflatten(spec, leaves)

    def before_backward(self, i: int) -> None:
        self._tick(i, None)
        self.materialize(i)  # also after the unit's gradient was reduced: a second backward through the graph
        if not self.done[i]:
            self._prefetch(i, -1)

    def unit_backward(self, i: int, grad: Tensor) -> None:
        """The unit's gradient is complete: reduce it (on a real mesh, now) and free the unit."""
        self._tick(i, 1)
        self.done[i] = True
        grad = grad if self.reduce_dtype is None else grad.to(self.reduce_dtype)
        if self.sim is None:  # added: a second backward (retain_graph) accumulates, as autograd would
            self.grad_shard[self.layout.unit_shard_slice(i)] += self.mesh.reduce_scatter(grad, "mean")
        else:
            self.unit_grads[i] = grad if i not in self.unit_grads else self.unit_grads[i] + grad
        self.release(i)

    def finish(self) -> None:
        """Reduce zeros for units no gradient reached (every rank issues the same collectives), free the rest."""
        for i, unit in enumerate(self.layout.units):
            if not self.done[i]:
                self.unit_backward(i, self.shard.new_zeros(unit.size))
            self.release(i)

    def close(self) -> None:
        for i in list(self.swapped):
            self.restore(i)
        for i in range(len(self.layout.units)):
            self.release(i)
        # the views' autograd nodes hold this gatherer (ctx.gatherer): a reference cycle through C++ that Python's
        # collector cannot see, so drop the views explicitly or every step would leak its gradient shard
        self.views = [None] * len(self.views)
        self.store = [None] * len(self.store)


class UnitGathering:
    """One rank's unit-at-a-time gathering across an imperative forward and backward (for the engine).

    Create it before the forward, run the forward with `params()` (the units kept gathered; the others are swapped
    into their modules by hooks), run `torch.autograd.grad(loss, [gathering.shard])` one or more times, then
    `finish()` returns this rank's reduced gradient shard and removes the hooks. Real meshes only: on a `SimMesh`
    the ranks run one after another (see `sharded_backward`).
    """

    def __init__(
        self,
        mesh: Mesh,
        layout: Layout,
        model: nn.Module,
        compute: Tensor,
        policy: GatherPolicy,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        if isinstance(mesh, SimMesh):
            raise TypeError("UnitGathering runs one rank; on a SimMesh use sharded_backward")
        self.shard = compute.detach().requires_grad_()
        self._g = _Gatherer(mesh, layout, model, self.shard, policy, reduce_dtype, None)
        self._handles = self._g.install()
        self._params = self._g.params()

    def params(self) -> dict[str, Tensor]:
        return self._params

    @property
    def peak(self) -> int:
        """The most gathered elements alive at once so far."""
        return self._g.peak

    @property
    def received(self) -> bool:
        """Whether a backward has reached any unit since the gathering began."""
        return any(self._g.done)

    @property
    def times(self) -> dict[str, list[float]] | None:
        """Per-unit forward and backward seconds, with `GatherPolicy(timings=True)`."""
        return self._g.times

    def finish(self) -> Tensor:
        """Reduce what no gradient reached, free everything, remove the hooks; this rank's gradient shard."""
        try:
            self._g.finish()
            grads, self._g.grad_shard = self._g.grad_shard, None
            return grads
        finally:
            self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._g.close()
        self._params = {}


def sharded_backward(
    mesh: Mesh,
    layout: Layout,
    model: nn.Module,
    compute: Tensor,
    policy: GatherPolicy,
    reduce_dtype: torch.dtype | None,
    run: Callable[[dict[str, Tensor], int], tuple[Tensor, Any]],
) -> tuple[Tensor, list[Any], dict[str, Any]]:
    """Forward and backward of every rank with unit-at-a-time gathering.

    Args:
      mesh, layout, model: the step's.
      compute: the compute parameters' shards, per rank (`[shard_numel]`, or `[world, shard_numel]` on a SimMesh).
      policy: prefetch and persistence.
      reduce_dtype: dtype the gradients are reduced in (None: the compute dtype).
      run: `run(params, rank) -> (scaled_loss, out)`: rank `rank`'s forward with the named parameters given; `out`
        is returned as is.

    Returns:
      This rank's reduced gradient shards (`[world, shard_numel]` on a SimMesh), each rank's `out`, and metrics:
      `gathered_peak` (the most gathered elements alive at once on a rank) and, with `policy.timings`,
      `unit_times`.
    """
    if not isinstance(mesh, SimMesh):
        gathering = UnitGathering(mesh, layout, model, compute, policy, reduce_dtype)
        try:
            with torch.enable_grad():
                scaled, out = run(gathering.params(), 0)
                torch.autograd.grad(scaled, [gathering.shard], allow_unused=True)
            info = {"gathered_peak": gathering.peak}
            if gathering.times is not None:
                info["unit_times"] = {k: tuple(v) for k, v in gathering.times.items()}
            return gathering.finish(), [out], info
        finally:
            gathering.close()
    outs, gatherers, peak = [], [], 0
    for rank in range(mesh.world):
        shard = compute[rank].detach().requires_grad_()
        g = _Gatherer(mesh, layout, model, shard, policy, reduce_dtype, (compute, rank))
        handles = g.install()
        try:
            with torch.enable_grad():
                scaled, out = run(g.params(), rank)
                torch.autograd.grad(scaled, [shard], allow_unused=True)
            g.finish()
        finally:
            for h in handles:
                h.remove()
            g.close()
        outs.append(out)
        gatherers.append(g)
        peak = max(peak, g.peak)
    pieces = []
    for i in range(len(layout.units)):
        per_rank = torch.stack([g.unit_grads[i] for g in gatherers])
        pieces.append(mesh.reduce_scatter(per_rank, "mean"))
    info = {"gathered_peak": peak}
    if gatherers[0].times is not None:
        info["unit_times"] = {k: tuple(v) for k, v in gatherers[0].times.items()}
    return torch.cat(pieces, dim=-1), outs, info

"""Unit-at-a-time gathering inside the forward and the backward, as a schedule: when each unit is gathered, freed
and reduced. The machinery every stage's per-unit path uses (stages 1-2 keep the gathered units to the end of the
backward, stage 3 frees each after its forward; stage 0 and a window's kept buffer are given whole). Each unit's
state and its own verbs (gather, free, swap into its modules) are `fzero.sharding.gathered_unit.GatheredUnit`.

(Over 500 lines: one rank's schedule (`Gatherer`: the forward and backward hooks, the prefetch order, the catch-up
that keeps every rank's collectives paired, the abandoned-step completion) is one set of invariants on the order of
the collectives, which split across modules would have to be read together; the policy it follows
(`GatherPolicy`) and its two entry points, the per-rank loops (`sharded_backward`) and the one-rank handle
(`UnitGathering`), sit beside it.)

Stage 3 keeps each rank's compute parameters, trainable and frozen, as shards. Within a step a unit's full buffers
exist only while the unit computes:

    forward    pre-hook of the unit's module:  all-gather it (or wait for its prefetch); prefetch the next unit;
                                               put views of its buffers into the module
               post-hook:                      put the module's tensors back; free the unit (not the last one:
                                               the backward begins with it); hook its outputs
    backward   an output's gradient arrives:   all-gather it again, views into the module until its backward is
                                               done; prefetch the unit before it
               its gradient is complete:       reduce-scatter the gradient (mean over ranks) into this rank's
                                               gradient shard, free the trainable buffer (the frozen one once the
                                               gradients of the unit's inputs exist)

so full parameters and full gradients never exist for more than the live units (at most `1 + prefetch`, bounded by
`max_live_elements`). Units that are not modules (the root unit: parameters outside the `ModuleList` children) and
units at or below `persistence_threshold` elements are gathered once at the start and kept until their gradient is
reduced: the backward begins where the forward ended, so re-gathering them would only add traffic, as it would for
the last on-demand unit, which stays gathered from its forward into its backward. Per step and rank this moves
`Psi` (forward gathers) `+ Psi - Psi_kept - Psi_last` (backward gathers) `+ Psi` (reduce-scatters) elements, plus
the frozen parameters' two gathers.

The everyday habits of real models hold: hooks firing inside a backward are an activation-checkpoint recompute
(they neither prefetch forward nor free the unit, whose backward comes next); a forward under `no_grad` frees each
unit right after it ran; the output hooks are tensor hooks, so in-place operations on a unit's outputs stay legal;
the views stay in the unit's modules through its backward, where a recompute of a layer's `forward` (not
`__call__`, as Hugging Face checkpoints it) reads them; a parameter read outside its unit's forward is an
`Unavailable` placeholder that raises an error naming it.

Why this mechanism: `torch.func` can neither differentiate through collectives nor accept saved-tensor hooks
(docs/design.md, "Stage 3: one unit at a time"), so this path runs plain autograd. A unit's full trainable buffer is
the output of an autograd Function whose backward receives the unit's complete gradient exactly once, after its
last use; its storage is freed and refilled under the tensors autograd saved (`fzero.sharding.gathered_unit`).

On a `SimMesh` the ranks run one after another, so a unit's gradient is reduced once every rank's backward is done;
the arithmetic (a rank-ordered sum divided by the world size) and the ledger are those of a real run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import optree
import torch
from torch import Tensor, nn

from ..layout import Layout
from ..layout.pieces import Pieces
from ..mesh import CollectiveError, Mesh, SimMesh
from ..mesh.ranks import OneRank, Ranks, Reduction, SimRanks, ranks_of
from ..state.plan import EXACT, GatherSpec
from ..storage import Offloaded, UnitReader
from .bind import Unavailable
from .gathered_unit import FROZEN, TRAIN, GatheredUnit, Phase, Spaces, build_units

__all__ = ["Abandoned", "GatherPolicy", "Gatherer", "Phase", "UnitGathering", "frozen_shard", "sharded_backward"]


@dataclass(frozen=True)
class GatherPolicy:
    """How a step schedules its per-unit collectives: stage 3's gathers, every stage's reductions (DeepSpeed's
    names in brackets).

    Attributes:
      prefetch: units gathered ahead of the one computing [`stage3_prefetch_bucket_size`, in units].
      max_live_elements: the most gathered elements alive at once; a prefetch that would exceed it waits
        [`stage3_max_live_parameters`]. None: no bound beyond `prefetch`.
      persistence_threshold: units with at most this many elements stay gathered for the whole step
        [`stage3_param_persistence_threshold`].
      timings: report each gathered-on-demand unit's forward and backward wall time (seconds, rank 0's on a
        SimMesh) in the step's metrics as `unit_times`: `{unit name: (forward, backward)}`.
      overlap_reduce: start each unit's reduction as soon as its gradient is complete and go on with the backward
        without waiting for it (a `DistMesh` backend's threads run it); all are waited on before the optimizer.
        The same arithmetic in the same order: results are bitwise those without overlap [`overlap_comm`]. None
        (the default): decided for the mesh by `on(mesh)` (`overlap_pays`: on for several processes).
      reduce_bucket_elements: with `overlap_reduce`, the most gradient elements whose reduction is in flight at
        once: before starting one that would exceed it, the oldest are waited on. In-flight gradients stay alive,
        so this bounds the memory overlap costs [`reduce_bucket_size`].
    """

    prefetch: int = 1
    max_live_elements: int | None = None
    persistence_threshold: int = 0
    timings: bool = False
    overlap_reduce: bool | None = None
    reduce_bucket_elements: int = 500_000_000

    @property
    def reduce_budget(self) -> int | None:
        """The in-flight bound the reduction gets: None without overlap (each unit's reduction is waited for; also
        while `overlap_reduce` is undecided: see `on`)."""
        return self.reduce_bucket_elements if self.overlap_reduce else None

    def on(self, mesh: Mesh) -> GatherPolicy:
        """This policy on `mesh`: an undecided `overlap_reduce` (None) decided by `overlap_pays(mesh)`."""
        if self.overlap_reduce is not None:
            return self
        return dataclasses.replace(self, overlap_reduce=overlap_pays(mesh))

    def __post_init__(self) -> None:
        for name in ("prefetch", "persistence_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GatherPolicy.{name} must be an int >= 0, got {value!r}")
        if self.overlap_reduce is not None and not isinstance(self.overlap_reduce, bool):
            raise ValueError(f"GatherPolicy.overlap_reduce must be a bool or None (decided per machine), got "
                             f"{self.overlap_reduce!r}")  # fmt: skip
        bucket = self.reduce_bucket_elements
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"GatherPolicy.reduce_bucket_elements must be an int >= 1, got {bucket!r}")
        if self.max_live_elements is not None and (
            isinstance(self.max_live_elements, bool)
            or not isinstance(self.max_live_elements, int)
            or self.max_live_elements < 1
        ):
            got = self.max_live_elements
            raise ValueError(f"GatherPolicy.max_live_elements must be None or an int >= 1, got {got!r}")


def overlap_pays(mesh: Mesh) -> bool:
    """Whether overlapping each unit's reduction with the backward can make a step faster here: the rule an
    undecided `GatherPolicy(overlap_reduce=None)` follows. On every mesh of several processes; off on a `SimMesh`
    (one process reduces every rank's part at once: nothing is in flight) or one rank.

    Measured where it was most in doubt, on 2 CPU cores shared by 2 gloo ranks of 1 thread
    (`benchmarks/compare.py`, docs/performance.md): whether the reduction's threads take the backward's cores or
    not, a rank that need not wait for each unit's reduction does not wait for the other rank either, and the
    overlapped step was as fast or faster at every stage in every paired run. (NCCL reduces on the accelerator's
    own engines: there it pays more.) The cost is memory: each unit's gradient stays alive while its reduction is
    in flight, at most `reduce_bucket_elements` of them.
    """
    return not mesh.stacked and mesh.world > 1


class Abandoned(Exception):
    """A rank's forward or backward raised `error`; the step's collectives were completed (zero gradients) so
    that the other ranks' pair with them (`fzero.mesh.agreement` then fails the step on every rank)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _in_backward() -> bool:
    """Whether autograd is executing a backward now (a hook firing inside it is an activation-checkpoint
    recompute)."""
    return torch._C._current_graph_task_id() != -1


def _hook_targets(outputs: list[Tensor]) -> list[Tensor]:
    """The tensors whose gradient hooks fire before the backward of the ops that made `outputs`, whatever the
    caller does to them in place afterwards: each output, and the base of each output that is a view.

    A hook on a tensor fires with the gradient of the value it had when the hook was registered, by sitting on the
    autograd node that made it, so an in-place op on a plain output keeps it. But an in-place op on a *view* (a
    `Linear` on a 3-D input returns a view of its 2-D product) replaces the view's node by one that differentiates
    through the base (`CopySlices`), and the view's hooks never fire; the base's node stays in the graph.
    """
    targets = list(outputs)
    for x in outputs:
        base = x._base
        if base is not None and base.requires_grad and not any(base is t for t in targets):
            targets.append(base)
    return targets


class Gatherer:
    """One rank's schedule of its gathered units for one forward and backward (or, without a `reduction`, for
    forwards only): the hooks that call each unit's verbs (`fzero.sharding.gathered_unit.GatheredUnit`), the prefetch
    order, the catch-up of units this rank did not run, the timings (FSDP2's `FSDPState` to the units'
    `FSDPParamGroup`).

    Each space (trainable, frozen) is `FULL`, `KEEP` or `RESHARD` (`fzero.sharding.gathered_unit.Spaces`).

    Args:
      ranks, rank: the mesh's strategy (`fzero.mesh.ranks`) and the rank this gatherer runs.
      layout, model, policy: the step's.
      shards: this rank's trainable and frozen (or None) buffers: shards, or full buffers (`FULL`); the trainable
        one is the autograd leaf.
      everyone: every rank's trainable and frozen shards as per-rank values (on a DistMesh: this rank's).
      reduction: where the units' gradients go (`Ranks.reduction`); None for forwards without gradients.
      keep: keep gathered units (`KEEP`) rather than free them (`RESHARD`).
      source: where the trainable pieces are read from when the shard is on disk (`Spaces.source`).
      gather_spec: how freed units travel when gathered again (`fzero.state.plan.GatherSpec`: qwZ, hpZ).
    """

    def __init__(
        self,
        ranks: Ranks,
        rank: int,
        layout: Layout,
        model: nn.Module,
        shards: tuple[Tensor, Tensor | None],
        everyone: tuple[Tensor, Tensor | None],
        policy: GatherPolicy,
        reduction: Reduction | None = None,
        keep: bool = False,
        source: Callable[[int], Tensor] | None = None,
        gather_spec: GatherSpec = EXACT,
    ) -> None:
        self.ranks, self.rank, self.layout, self.policy, self.reduction = ranks, rank, layout, policy, reduction
        self.spaces = Spaces.create(
            ranks, rank, layout, shards, everyone, reduction is not None, keep, source, gather_spec
        )
        self.units = build_units(layout, model, self.spaces, policy.persistence_threshold, self.post_backward)
        self.sequence = [u.index for u in self.units if u.module is not None]  # forward order of on-demand units
        # the backward begins where the forward ended: the last on-demand unit stays gathered into it, as DeepSpeed's
        # `stage3_max_reuse_distance` keeps it (re-gathering it there would be a collective nothing overlaps)
        self.last = self.sequence[-1] if self.sequence and reduction is not None else None
        self.clock: dict[int, float] = {}  # when the unit's current forward or backward began
        self.times = {u.name: [0.0, 0.0] for u in self.units if u.module is not None} if policy.timings else None

    @property
    def peak(self) -> int:
        """The most gathered elements alive at once so far."""
        return self.spaces.peak

    @property
    def kept_peak(self) -> int:
        """The most elements of hpZ secondary copies held at once so far."""
        return self.spaces.kept_peak

    def params(self) -> dict[str, Tensor]:
        """The named tensors to bind into the model for the step: views of the units kept gathered for the whole
        step; `Unavailable` placeholders for the others' parameters (swapped for views while their module runs)."""
        out: dict[str, Tensor] = {}
        for unit in self.units:
            if unit.module is None:
                out.update(unit.views())
                continue
            for space, lay in enumerate(self.spaces.layouts):
                for leaf in lay.leaves if lay is not None else ():
                    if leaf.unit == unit.index:
                        shard = self.spaces.shards[space]
                        assert shard is not None  # (a space with leaves has a buffer)
                        out[leaf.name] = Unavailable(leaf.name, unit.name, leaf.shape, shard.dtype, shard.device)
        for alias, name in self.layout.aliases:
            if name in out:
                out[alias] = out[name]
        return out

    def _prefetch(self, i: int, step: int) -> None:
        """Start gathering the next `prefetch` units after `i` in forward (`step=1`) or backward (`-1`) order."""
        pos = self.sequence.index(i)
        for k in range(1, self.policy.prefetch + 1):
            j = pos + step * k
            if not 0 <= j < len(self.sequence):
                return
            nxt = self.units[self.sequence[j]]
            if all(nxt.live[s] or not nxt.sizes[s] for s in (TRAIN, FROZEN)) or nxt.phase is Phase.DONE:
                continue
            if self.policy.max_live_elements is not None and (
                self.spaces.live_elements + sum(nxt.sizes) > self.policy.max_live_elements
            ):
                return
            nxt.start(ahead=True)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def install(self) -> list[Any]:
        """Register the forward hooks on the gathered-on-demand units' modules; returns their handles."""
        handles = []
        for unit in self.units:
            if unit.module is not None:
                i = unit.index
                handles.append(unit.module.register_forward_pre_hook(lambda m, a, i=i: self.pre_forward(i, a)))
                handles.append(unit.module.register_forward_hook(lambda m, a, o, i=i: self.post_forward(i, o)))
        return handles

    def _tick(self, i: int, phase: int | None) -> None:
        """Start (`phase=None`) or stop (0: forward, 1: backward) unit `i`'s clock."""
        if self.times is None:
            return
        now = time.perf_counter()
        if phase is None:
            self.clock[i] = now
        elif i in self.clock:
            self.times[self.units[i].name][phase] += now - self.clock.pop(i)

    def pre_forward(self, i: int, args: Any) -> None:
        """Before the unit's module runs: gather it, prefetch the next, put its views into the module. In a
        recompute (activation checkpointing, inside the backward) the unit's backward follows: no forward prefetch.
        """
        unit = self.units[i]
        recompute = _in_backward()
        if not recompute:
            self.catch_up_forward(upto=i)
        unit.views()
        unit.unshard()
        if not recompute:
            unit.ran = True
            self._tick(i, None)
            self._prefetch(i, 1)
            unit.phase = Phase.FORWARD
            if self.reduction is not None and unit.sizes[FROZEN] and torch.is_grad_enabled():
                # the frozen buffer is read by the backward of the unit's ops (gradients of their inputs), which
                # can run after the trainable gradient is complete: free it once the inputs' gradients exist
                for x in optree.tree_leaves(args):
                    if isinstance(x, Tensor) and x.requires_grad:
                        x.register_hook(lambda g, i=i: self._inputs_done(i))
        unit.swap()

    def post_forward(self, i: int, output: Any) -> Any:
        """After the unit's module ran: put the module's tensors back; free the unit unless the backward needs it
        next, and hook its outputs so that their backward gathers it again first."""
        unit = self.units[i]
        unit.unswap()
        if _in_backward():  # a recompute: the unit's backward runs next, with these buffers
            return output
        self._tick(i, 0)
        unit.phase = Phase.IDLE
        if not (self.reduction is not None and torch.is_grad_enabled()):  # nothing was saved for a backward
            unit.reshard()
            return output
        hooked = [x for x in optree.tree_leaves(output) if isinstance(x, Tensor) and x.requires_grad]
        if not hooked:  # no output to hook the re-gather on: keep the unit until its gradient is reduced
            return output
        if i != self.last:
            unit.reshard()
        for x in _hook_targets(hooked):  # tensor hooks, not an autograd Function: in-place ops stay legal
            x.register_hook(lambda g, i=i: self.pre_backward(i))
        return output

    def pre_backward(self, i: int) -> None:
        """The gradient of one of the unit's outputs exists: gather the unit for its backward (also after its
        gradient was reduced: a second backward through the graph) and put its views into its modules until the
        backward is done, where an activation-checkpoint recompute (of `forward`, not `__call__`, so without this
        gatherer's forward hooks, as Hugging Face layers do) reads them."""
        unit = self.units[i]
        if unit.phase is Phase.BACKWARD:
            return
        first = unit.phase is not Phase.DONE
        if first:
            self.catch_up_forward()
            self._catch_up_backward(after=i)
        unit.phase = Phase.BACKWARD
        self._tick(i, None)
        unit.unshard()
        unit.swap()
        if first:
            self._prefetch(i, -1)

    def post_backward(self, i: int, grad: Tensor | Pieces) -> None:
        """The unit's trainable gradient is complete (its `on_gradient`): hand it to the reduction (the chain's),
        free the trainable buffer (and the frozen one, unless the gradients of the unit's inputs are still
        pending) of a unit gathered on demand."""
        self._tick(i, 1)
        unit = self.units[i]
        unit.leave_backward()
        unit.phase = Phase.DONE
        assert self.reduction is not None  # (a gradient reaches a unit only with a reduction: `_Unit`)
        self.reduction.add(i, self.rank, grad)
        if unit.module is None:  # gathered for the whole step, with no hook to gather it again for a second
            return  # backward through the graph (its saved tensors are views of its buffers): freed by `finish`
        unit.reshard((TRAIN, FROZEN) if unit.inputs_done or not unit.sizes[FROZEN] else (TRAIN,))

    def _inputs_done(self, i: int) -> None:
        """The gradient of an input of the unit exists: its backward, frozen parameters included, is done."""
        unit = self.units[i]
        unit.inputs_done = True
        if unit.phase is Phase.DONE or not unit.sizes[TRAIN]:
            unit.leave_backward()
            if not unit.sizes[TRAIN]:
                unit.phase = Phase.DONE
            unit.reshard((FROZEN,))

    # -- every rank issues the same collectives ------------------------------------------------------------------
    # A rank may skip a unit another rank runs (layer drop, early exit, routing), or abandon its forward (an
    # exception): its collectives would then pair with the wrong ones of the others. So gathers follow the forward
    # order of on-demand units and reductions its reverse (autograd's order for a sequential model) on every rank:
    # a unit this rank did not run is still gathered when the forward passes it, and gathered again and reduced
    # with a zero gradient when the backward passes it, as the ranks that ran it do.

    def catch_up_forward(self, upto: int | None = None) -> None:
        """Pass every on-demand unit before `upto` in forward order (all of them: None) that has not run this
        step: gather it, prefetch as its forward would, free it."""
        for j in self.sequence[: None if upto is None else self.sequence.index(upto)]:
            unit = self.units[j]
            if not (unit.ran or unit.passed):
                unit.passed = True
                unit.unshard()
                self._prefetch(j, 1)
                if j != self.last:  # as its forward would (`post_forward`), so every rank's gathers pair
                    unit.reshard()

    def _catch_up_backward(self, after: int | None = None, abandoned: bool = False) -> None:
        """Pass every on-demand unit after `after` in forward order (all of them: None), last first, whose
        gradient is not reduced and whose forward did not run here (with `after`; all with None: the backward is
        over): reduce a zero gradient for it, first gathering it as the backward of the ranks that ran it does (a
        unit that ran here without a backward is not gathered, on any rank; after an `abandoned` forward, every
        unit is, as on the ranks whose backward runs)."""
        start = 0 if after is None else self.sequence.index(after) + 1
        for j in reversed(self.sequence[start:]):
            unit = self.units[j]
            if unit.phase is Phase.DONE or (after is not None and (unit.ran or unit.phase is Phase.BACKWARD)):
                continue
            if abandoned or not unit.ran:
                unit.unshard()
                self._prefetch(j, -1)
            self._reduce_zeros(unit)

    def _reduce_zeros(self, unit: GatheredUnit) -> None:
        unit.leave_backward()
        unit.phase = Phase.DONE
        if unit.sizes[TRAIN]:  # a unit without trainable elements has nothing to reduce
            assert self.reduction is not None  # (`finish` runs only with one)
            self.reduction.add(unit.index, self.rank, self.spaces.shards[TRAIN].new_zeros(unit.sizes[TRAIN]))
        unit.reshard()

    def finish(self, abandoned: bool = False) -> None:
        """The backward is over (or was abandoned): pass the units no forward or gradient reached, in the order
        the others' forward and backward took (on-demand units last first, then those gathered for the whole step,
        last first: autograd completes the latter last, in reverse order of creation), reducing zeros for them;
        free everything."""
        self.catch_up_forward()
        self._catch_up_backward(abandoned=abandoned)
        for unit in reversed(self.units):
            if unit.phase is not Phase.DONE:
                self._reduce_zeros(unit)
            unit.reshard()

    def complete(self, abandoned: bool = False) -> None:
        """The forward (and with a reduction, the backward) is over, or was `abandoned` (an exception): issue what
        this rank has not (`finish`)."""
        if self.reduction is not None:
            self.finish(abandoned)
        else:
            self.catch_up_forward()

    def gathered(self, space: int = TRAIN) -> Tensor | None:
        """The space's full buffer, when it was given whole or gathered and kept (None for `RESHARD`); complete
        once every unit ran (`finish`)."""
        return self.spaces.full[space]

    def close(self) -> None:
        """The step is over: every unit released (`GatheredUnit.release`), the full buffers dropped."""
        for unit in self.units:
            unit.release()
        self.spaces.full = [None, None]


def frozen_shard(frozen: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """The frozen shard in the dtype the forward computes in."""
    if frozen is None:
        return None
    return frozen.detach() if dtype is None or frozen.dtype == dtype else frozen.to(dtype)


def _kept_to_end(layout: Layout, compute: Tensor, reader: UnitReader | None, keep: bool) -> bool:
    """Whether the trainable units stay gathered to the end of the backward (`Spaces`: given whole, or `KEEP`), so
    the reduction's result may be a reused buffer (`_DistReduction`'s `reuse`); units read from disk are never
    given whole."""
    return keep or (reader is None and layout.is_full(compute))


def on_disk(compute: Any, depth: int, local: bool = False) -> tuple[Tensor, UnitReader | None]:
    """A compute shard offloaded to disk as an empty placeholder of its dtype (per rank, or with `local` this
    rank's alone: the autograd leaf the units hang from) and the reader its units come from, `depth` units ahead;
    any other shard as it is, and None."""
    if not isinstance(compute, Offloaded):
        return compute, None
    shape = (compute.shape[0], 0) if compute.ndim == 2 and not local else (0,)
    return torch.empty(shape, dtype=compute.dtype), UnitReader(compute, depth)


class UnitGathering:
    """One rank's unit-at-a-time gathering across an imperative forward and backward (for the engine).

    Create it before the forward, run the forward with `params()` bound (the units kept gathered; the others are
    swapped into their modules by hooks), run the backward of the loss one or more times, then `finish()` returns
    this rank's reduced gradient shard and removes the hooks. With `reducer=None` it serves forwards only
    (evaluation under `no_grad`): every unit is freed right after its module ran; `close()` ends it. Real meshes
    only: on a `SimMesh` the ranks run one after another (see `sharded_backward`).

    Args:
      mesh, layout, model: the engine's.
      compute, frozen: this rank's compute and frozen shards.
      policy: prefetch and persistence.
      reducer: the chain's per-unit reduction (`fzero.transforms.unit_reducer`), as `reducer(grads, unit)`.
      frozen_dtype: the dtype frozen parameters are computed in.
      keep: keep gathered units to the end (stages 1-2) rather than free them after their forward (stage 3).
      gather_spec: how freed units travel (`fzero.state.plan.GatherSpec`).
    """

    def __init__(
        self,
        mesh: Mesh,
        layout: Layout,
        model: nn.Module,
        compute: Tensor,
        frozen: Tensor | None,
        policy: GatherPolicy,
        reducer: Callable[[Tensor, int], Tensor] | None,
        frozen_dtype: torch.dtype | None = None,
        keep: bool = False,
        gather_spec: GatherSpec = EXACT,
    ) -> None:
        if mesh.stacked and mesh.world != 1:
            raise TypeError("UnitGathering runs one rank; on a SimMesh use sharded_backward")
        ranks = OneRank(cast(SimMesh, mesh)) if mesh.stacked else ranks_of(mesh)
        compute, self._reader = on_disk(compute, max(1, policy.prefetch), local=True)
        self.shard = compute.detach().requires_grad_(reducer is not None)
        shards = (self.shard, frozen_shard(frozen, frozen_dtype))
        reuse = _kept_to_end(layout, compute, self._reader, keep)
        self._reduction = None if reducer is None else ranks.reduction(reducer, layout, policy.reduce_budget, reuse)
        self._g = Gatherer(ranks, ranks.indices[0], layout, model, shards, shards, policy, self._reduction, keep,
                           self._reader, gather_spec)  # fmt: skip
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
        return any(r.phase is Phase.DONE for r in self._g.units)

    @property
    def times(self) -> dict[str, list[float]] | None:
        """Per-unit forward and backward seconds, with `GatherPolicy(timings=True)`."""
        return self._g.times

    def complete(self, abandoned: bool = False) -> None:
        """Issue the collectives this rank's forward (and backward) did not reach, in the others' order, so that
        theirs pair with them: the gathers of units an early exit skipped, and after an exception (`abandoned`)
        zero gradients for the units no backward reached (`Gatherer.complete`)."""
        self._g.complete(abandoned)

    def finish(self) -> Tensor:
        """Reduce what no gradient reached, free everything, remove the hooks; this rank's gradient shard."""
        try:
            self._g.finish()
            assert self._reduction is not None, "UnitGathering.finish needs a reducer (without one: close())"
            return self._reduction.result()
        finally:
            self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._g.close()
        self._params = {}
        if self._reader is not None:
            self._reader.close()


def _run_rank(g: Gatherer, run: Callable[[dict[str, Tensor], int], Any], rank: int) -> Any:
    """Rank `rank`'s `run` under the gatherer `g`, then the units it did not reach (`Gatherer.finish`). If `run`
    raises on a real mesh, the step's collectives are completed all the same (the others' pair with them), and
    `Abandoned` carries the exception."""
    try:
        out = run(g.params(), rank)
    except Exception as e:
        if isinstance(g.ranks, SimRanks) or isinstance(e, CollectiveError):
            raise  # one process runs every rank (nothing to complete) / the collectives themselves failed
        g.complete(abandoned=True)
        raise Abandoned(e) from e
    g.complete()
    return out


def sharded_backward(
    mesh: Mesh,
    layout: Layout,
    model: nn.Module,
    shards: tuple[Tensor, Tensor | None],
    policy: GatherPolicy,
    reducer: Callable[[Tensor, int], Tensor] | None,
    run: Callable[[dict[str, Tensor], int], Any],
    keep: bool = False,
    gather_spec: GatherSpec = EXACT,
) -> tuple[Tensor | None, list[Any], dict[str, Any]]:
    """Every rank's forward and backward (or, without a `reducer`, forward only) with unit-at-a-time gathering and
    each unit's gradient reduced as soon as it is complete (the chain's `reducer`).

    Args:
      mesh, layout, model: the step's.
      shards: the compute parameters and the frozen parameters (in the dtype the forward computes in; None without
        frozen parameters), per rank: shards (`[shard_numel]`, or `[world, shard_numel]` on a SimMesh) gathered
        unit by unit, or full buffers (`FULL`: stage 0, or kept from an earlier micro-step).
      policy: prefetch, persistence, overlap of the reductions.
      keep: keep gathered units to the end (`KEEP`, stages 1-2) rather than free them after their forward.
      gather_spec: how freed units travel (`fzero.state.plan.GatherSpec`).
      reducer: the chain's per-unit reduction, `reducer(grads, unit)` (`fzero.transforms.unit_reducer`); None to
        run forwards without gradients (evaluation).
      run: `run(params, rank) -> out`: rank `rank`'s forward and backward (of its scaled loss) with the named
        tensors given, bound into the model for both (an activation-checkpoint recompute reads them in the
        backward); `out` is returned as is.

    Returns:
      This process's reduced gradients per rank (shards, or full buffers for an all-reduce; None without a
      reducer), each rank's `out`, and metrics: `gathered_peak` (the most gathered elements alive at once on a
      rank), `gathered` (the full compute parameters per rank, where they were given whole or kept; else None),
      with hpZ `secondary_peak` (the most secondary-copy elements a rank held at once) and, with
      `policy.timings`, `unit_times`.
    """
    ranks = ranks_of(mesh)
    compute, reader = on_disk(shards[0], max(1, policy.prefetch))
    reuse = _kept_to_end(layout, compute, reader, keep)
    reduction = None if reducer is None else ranks.reduction(reducer, layout, policy.reduce_budget, reuse)
    outs, peak, kept, times, gathered = [], 0, 0, None, []
    shards = (compute, shards[1])
    try:
        for rank in ranks.indices:
            mine = ranks.pick(shards[0], rank).detach().requires_grad_(reducer is not None)
            mine_frozen = ranks.pick(shards[1], rank)
            g = Gatherer(ranks, rank, layout, model, (mine, mine_frozen), shards, policy, reduction, keep, reader,
                         gather_spec)  # fmt: skip
            handles = g.install()
            try:
                outs.append(_run_rank(g, run, rank))
                gathered.append(g.gathered())
            finally:
                for h in handles:
                    h.remove()
                g.close()
            peak, times = max(peak, g.peak), times if times is not None else g.times
            kept = max(kept, g.kept_peak)
    finally:
        if reader is not None:
            reader.close()
    info: dict[str, Any] = {"gathered_peak": peak, "gathered": ranks.stack(gathered)}
    if gather_spec.secondary is not None:
        info["secondary_peak"] = kept
    if reduction is not None:
        result = reduction.result()
        info["reduce_in_flight_peak"] = reduction.peak
    if times is not None:
        info["unit_times"] = {k: tuple(v) for k, v in times.items()}
    return (None if reduction is None else result), outs, info

"""Unit-at-a-time gathering inside the forward and the backward, as a schedule: when each unit is gathered, freed
and reduced. The machinery every stage's per-unit path uses (stages 1-2 keep the gathered units to the end of the
backward, stage 3 frees each after its forward; stage 0 and a window's kept buffer are given whole). Each unit's
state and its own verbs (gather, free, swap into its modules) are `fzero.sharding.gathered_unit.GatheredUnit`.

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
`Unavailable` placeholder, which gives the gathered tensor where the unit can (`read`: stages 0-2; stage 3 after the
unit's forward, gathering it again) and raises an error naming it where not.

Why this mechanism: `torch.func` can neither differentiate through collectives nor accept saved-tensor hooks
(docs/design.md, "Stage 3: one unit at a time"), so this path runs plain autograd. A unit's full trainable buffer is
the output of an autograd Function whose backward receives the unit's complete gradient exactly once, after its
last use; its storage is freed and refilled under the tensors autograd saved (`fzero.sharding.gathered_unit`).

On a `SimMesh` the ranks run one after another, so a unit's gradient is reduced once every rank's backward is done;
the arithmetic (a rank-ordered sum divided by the world size) and the ledger are those of a real run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor, nn

from ..host import scratch
from ..layout import Layout
from ..layout.pieces import Pieces
from ..mesh.ranks import Ranks, Reduction
from .bind import Unavailable
from .gathered_unit import EXACT, FROZEN, RESHARD, TRAIN, GatheredUnit, GatherSpec, Phase, Spaces, build_units
from .policy import GatherPolicy

__all__ = ["Abandoned", "Gatherer"]


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
      gather_spec: how freed units travel when gathered again (`fzero.sharding.gathered_unit.GatherSpec`: qwZ, hpZ).
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
        self.kept = self._kept() if reduction is not None else frozenset()
        self.held: set[int] = set()  # units gathered again for a read after their forward (`read`), to their backward
        self.clock: dict[int, float] = {}  # when the unit's current forward or backward began
        self.times = {u.name: [0.0, 0.0] for u in self.units if u.module is not None} if policy.timings else None

    def _kept(self) -> frozenset[int]:
        """The on-demand units that stay gathered from their forward into their backward (`GatherPolicy.reuse_distance`,
        DeepSpeed's rule: kept when the elements gathered between the two uses, each later unit's forward and
        backward, are fewer than the distance). The last unit always stays: the backward begins with it, and
        gathering it again there would be a collective nothing overlaps. With the compute shard on disk only the
        last does: a tier for models bigger than memory reads each unit again rather than hold the model."""
        kept: set[int] = set()
        between = 0
        distance = 0 if self.spaces.source is not None else self.policy.reuse_distance
        for i in reversed(self.sequence):
            if not kept or between < distance:
                kept.add(i)
            between += 2 * sum(self.units[i].sizes)
        return frozenset(kept)

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
                        read = functools.partial(self.read, unit.index, leaf.name)
                        out[leaf.name] = Unavailable(leaf.name, unit.name, leaf.shape, shard.dtype, shard.device, read)
        for alias, name in self.layout.aliases:
            if name in out:
                out[alias] = out[name]
        return out

    def read(self, i: int, name: str) -> Tensor | None:
        """Parameter `name` of unit `i`, read outside the unit's module (its `Unavailable` placeholder's data: the
        logits of x-transformers' tied embedding are `h @ emb.weight.T`): the view its module computes with, through
        the same autograd node (the read's gradient joins the module's), or None (the placeholder then raises).

        Where the unit, once gathered, stays so to the step's end (each of its spaces `FULL` or `KEEP`: stages 0-2),
        it is gathered first if the forward has not reached it, with the units before it, in forward order, as
        every rank's gathers go (`catch_up_forward`). Where it is freed after its forward (`RESHARD`: stage 3), a
        read after its forward and before its backward gathers it again, as every rank's same read does, and holds
        it until its backward frees it (`post_backward`; a later call of its module frees nothing): the read's saved
        tensors are used before then, since autograd completes the unit's gradient after every use. None at stage 3
        before the unit's forward (its gather would break the forward order of the ranks' gathers), while its module
        computes (its forward would free it under the read), after its backward, and for units read from disk (the
        reader's order)."""
        unit = self.units[i]
        if not any(size and mode == RESHARD for size, mode in zip(unit.sizes, self.spaces.modes, strict=True)):
            if not (unit.ran or unit.passed):
                self.catch_up_forward(upto=i)
        elif unit.phase is Phase.IDLE and unit.ran and self.spaces.source is None:
            unit.unshard()
            self.held.add(i)  # (a second call of its module must not free it under the read's saved tensors)
        elif unit.phase is not Phase.BACKWARD:
            return None
        return unit.views()[name]

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
            if i not in self.held:  # (by this forward: a read's saved tensors may still need it)
                unit.reshard()
            return output
        hooked = [x for x in optree.tree_leaves(output) if isinstance(x, Tensor) and x.requires_grad]
        if not hooked:  # no output to hook the re-gather on: keep the unit until its gradient is reduced
            return output
        if i not in self.kept and i not in self.held:
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
                if j not in self.kept:  # as its forward would (`post_forward`), so every rank's gathers pair
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
        scratch.drop_spares(scratch.KEPT_BELOW)  # (the large ones: the update's peak need not hold them)

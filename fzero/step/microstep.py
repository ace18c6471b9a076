"""One micro-step, the same code whether `fzero.train_step` or the engine's `backward` / `step` drives it.

A micro-step is two halves around the forwards and backwards, and `MicroStep` is both:

    open    MicroStep(state, tx, mesh)        start counting the step's collectives; decide, from the plan, whether
                                              gradients are reduced unit by unit in the backward (`per_unit`)
    (the core: every rank's forward and backward, `fzero.step`; the engine: `open_engine` for this rank, then the
     user's `engine(...)` and `engine.backward(loss)`, each backward's loss times `scaled`)
    close   micro.close(grads, loss, ...)     the ranks agree they ran the same step (`fzero.mesh.agreement`: else
                                              `DesyncError` on every rank, before any update), then the chain runs
                                              on the gradients (`apply_gradients`), and, where the plan keeps the
                                              gathered compute parameters through an accumulation window, the
                                              state keeps them

so the desync check, the loss scale, the per-unit path and the window's gathered parameters are written once. The
phases show in a profile as `fzero.gather`, `fzero.forward_backward`, `fzero.reduce`, `fzero.update` and
`fzero.agree` (`torch.profiler.record_function`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from torch import Tensor, nn
from torch.profiler import record_function

from ..layout import Layout, unflatten
from ..layout.pieces import Pieces, takes_pieces
from ..mesh import CollectiveError, Mesh
from ..mesh.agreement import agree
from ..mesh.ranks import rank_view
from ..sharding.bind import bound
from ..sharding.units import GatherPolicy, UnitGathering
from ..state import TrainState
from ..storage import Offloaded, in_memory
from ..transforms import Context, Flow, StepInfo, Transform, apply_update, gather_params, unit_reducer
from ..transforms.planning import transform_at
from ..transforms.scaling import current_loss_scale
from ..transforms.speculate import Speculation

__all__ = [
    "MicroStep",
    "apply_gradients",
    "compute_params",
    "frozen_params",
    "loss_scale",
    "named_tensors",
    "scaled",
]


def loss_scale(state: TrainState) -> float:
    """The loss scale the state's next backward multiplies the loss by (1 without `scale_loss`)."""
    scale = current_loss_scale(state)
    return 1.0 if scale is None else float(scale.loss_scale)


def scaled(state: TrainState, loss: Tensor) -> Tensor:
    """The loss the backward differentiates: times the loss scale (unscaled later: `StepInfo.grad_factor`)."""
    scale = current_loss_scale(state)
    return loss if scale is None else scale.scale(loss)


def named_tensors(layout: Layout, compute: Tensor, frozen: Tensor | None, buffers: dict[str, Tensor]) -> dict:
    """Every name `loss_fn` (or `functional_call`) expects: views of the full compute and frozen buffers, tied
    names included, and the buffers."""
    out = unflatten(layout, compute)
    if frozen is not None:
        assert layout.frozen_layout is not None  # (frozen parameters have one)
        out.update(unflatten(layout.frozen_layout, frozen))
    for alias, name in layout.aliases:
        out[alias] = out[name]
    out.update(buffers)
    return out


def reduce_per_unit(state: TrainState, mesh: Mesh) -> bool:
    """Whether reducing unit by unit in the backward buys anything over one reduction after it: on several ranks
    (each unit's reduction overlaps the backward, stage 3's units are gathered and freed), or on one where the update
    is speculative (SuperOffload updates each unit as it lands) or the compute copy is on disk (read unit by unit).
    On one rank otherwise a unit's reduction is the identity, and the unit's swaps and hooks are host time a step
    spends for nothing (on a GPU, time the device may wait for); both paths give the same gradients bitwise."""
    return mesh.world > 1 or state.plan.speculative or isinstance(state.compute, Offloaded)


def compute_params(state: TrainState, mesh: Mesh, out: Tensor | None = None) -> Tensor:
    """The full compute parameters per rank for the next forward: `state.compute`, all-gathered where the plan
    keeps them sharded at rest (the first half of a step; `apply_gradients` is the second); on a `DistMesh` into
    `out` if given (a full buffer of the compute dtype, refilled in place)."""
    compute = in_memory(state.compute)  # (a shard offloaded to disk: read whole, for the paths that need it so)
    if compute is None:  # a chain without gather(): the master parameters are the compute parameters
        compute = state.params
    if state.plan.sharded_at_rest:
        with record_function("fzero.gather"):
            compute = gather_params(mesh, state.layout, compute, block=state.plan.gather_spec.blocks[0], out=out)
    return compute


def frozen_params(state: TrainState, mesh: Mesh) -> Tensor | None:
    """The full frozen parameters per rank, in the dtype the forward computes in (None without any)."""
    frozen = state.frozen
    if frozen is None:
        return None
    dtype, frozen_layout = state.frozen_dtype, state.layout.frozen_layout
    assert frozen_layout is not None  # (frozen parameters have one)
    if state.plan.sharded_at_rest:
        with record_function("fzero.gather"):
            return gather_params(mesh, frozen_layout, frozen, dtype, block=state.plan.gather_spec.blocks[1])
    return frozen.to(dtype or frozen.dtype)


def apply_gradients(
    state: TrainState,
    grads: Tensor,
    loss: Tensor,
    tx: Transform,
    mesh: Mesh,
    *,
    donate: bool = False,
    reduced: bool = False,
    speculation: Any = None,
) -> tuple[TrainState, dict[str, Any]]:
    """The chain on per-rank gradients: the second half of a step, without the ranks' agreement (`MicroStep.close`
    adds it).

    Args:
      state: the state the gradients were computed from (its `buffers` already the forward's updated ones).
      grads: per rank, the gradient of `loss` times the loss scale with respect to `compute_params(state, mesh)`.
      loss: per rank, the unscaled loss (reported as its mean over ranks).
      tx, mesh, donate: as for `train_step`.
      reduced: the gradients are already this rank's part of the mean over ranks (reduced unit by unit in the
        backward).
      speculation: the update computed during the backward (`fzero.transforms.speculate`), or None.

    Returns:
      The new state and the metrics (all of `train_step`'s but `comm` and `aux`).
    """
    layout = state.layout
    scale = loss_scale(state)
    info = StepInfo(grad_factor=1.0 / scale, reduced=reduced, speculation=speculation)
    # gradients reduced in the backward are this rank's shard where the chain shards
    sharded = reduced and state.plan.sharded and layout.world > 1
    flow = Flow(grads, state.params, state.compute, sharded=sharded, info=info)
    with record_function("fzero.update"):
        ctx = Context(mesh, layout, donate, step=int(state.step), seed=int(state.seed))
        flow, tx_state = apply_update(tx, flow, state.tx_state, ctx)
    loss = mesh.all_reduce(loss.detach().float(), "mean")
    new = state.replace(step=state.step + 1, params=flow.params, compute=flow.compute, tx_state=tx_state)
    metrics: dict[str, Any] = {
        "loss": mesh.unreplicate(loss),
        "applied": not flow.info.deferred,
        "skipped": False,
        "loss_scale": scale,
    }
    if flow.info.stats is not None:
        metrics["grad_norm"] = math.sqrt(flow.info.stats.sumsq) / scale
    if speculation is not None:
        speculation.rollback()  # (a step the chain ended early: never taken)
        metrics["speculation"] = {"hit": speculation.outcome == "hit", "units": speculation.units}
    metrics.update(flow.info.metrics)
    return new, metrics


class MicroStep:
    """One micro-step of `state` under `tx` on `mesh` (see the module docstring): open at construction, `close`d
    once with the step's gradients; `abandon` ends it without an update.

    Args:
      state: the state the micro-step starts from.
      tx, mesh: the chain and mesh the state belongs to.
      policy: prefetch, persistence and overlap of the unit-by-unit gathering and reduction.
      autodiff: `"autograd"` (unit-by-unit reduction possible) or `"func"` (every unit gathered at the start).

    Attributes:
      per_unit: the backward reduces each unit's gradient as soon as it is complete, with the chain's own reduction
        (the plan's `per_unit`, under autograd, where it buys something: `reduce_per_unit`).
      speculation: where the plan speculates (SuperOffload) and this micro-step ends an accumulation window on the
        per-unit path, the update computed unit by unit as the backward reduces (`fzero.transforms.speculate`);
        opened by `reducer`.
      ledger: the collectives issued since the micro-step opened.
    """

    def __init__(self, state: TrainState, tx: Transform, mesh: Mesh, policy: GatherPolicy | None = None,
                 autodiff: str = "autograd") -> None:  # fmt: skip
        self.state, self.tx, self.mesh = state, tx, mesh
        self.policy = (policy or GatherPolicy()).on(mesh)
        self.per_unit = autodiff == "autograd" and state.plan.per_unit and reduce_per_unit(state, mesh)
        self._stack = contextlib.ExitStack()
        self.ledger = self._stack.enter_context(mesh.record())
        self._gathering: UnitGathering | None = None
        self.gathered_peak: int | None = None  # (the engine's unit-by-unit path: as the core reports it)
        self.speculation: Speculation | None = None  # (opened with the per-unit reduction: `reducer`)

    def _speculate(self) -> Speculation | None:
        state, plan = self.state, self.state.plan
        if not plan.speculative:
            return None
        acc = None
        if plan.accumulate > 1:
            window = plan.state_of(state.tx_state, "accumulate")
            if int(window.count) + 1 < plan.accumulate:  # the update comes at the window's last micro-step
                return None
            acc = window.acc
        update = transform_at(self.tx, plan.path_of("update"))
        assert update.speculate is not None  # (the plan says it speculates)
        return update.speculate(state.params, plan.state_of(state.tx_state, "update"), Context(self.mesh, state.layout),
                                1.0 / loss_scale(state), plan.sharded, acc, plan.accumulate)  # fmt: skip

    def reducer(self) -> Any:
        """The chain's per-unit reduction as `reducer(grads, unit)`, for the gathering; where the plan speculates,
        this opens the micro-step's speculation, which it tells as each unit lands (`reducer.landed`)."""
        if self.speculation is None:
            self.speculation = self._speculate()
        state = self.state
        ctx = Context(self.mesh, state.layout, overlap=bool(self.policy.overlap_reduce),  # (decided: `on`)
                      step=int(state.step), seed=int(state.seed))  # fmt: skip
        return _Reducer(unit_reducer(self.tx), ctx, self.speculation)

    # ------------------------------------------------------------------------------ the engine's half (one rank)
    def open_engine(self, module: nn.Module, compute: Tensor | None) -> None:
        """Prepare this rank's forwards (the engine's, on its rank's view of the mesh: values unstacked): `leaf`
        (what gradients are taken at: the full compute parameters, or the gathering's shard), `buffers` (copies the
        forwards may update in place) and `named` (the tensors the forwards compute with), bound into `module` until
        `close` or `abandon`.

        Args:
          module: the user's model.
          compute: this rank's full compute parameters where the engine has them (kept through an accumulation
            window), else None (gathered here: at once, or unit by unit).
        """
        state = self.state
        self.buffers = {k: v.clone() for k, v in state.buffers.items()}
        if self.per_unit:  # unit by unit, each unit's gradient reduced when complete
            shard = compute if compute is not None else state.compute if state.compute is not None else state.params
            self._gathering = UnitGathering(
                rank_view(self.mesh), state.layout, module, shard, state.frozen, self.policy, self.reducer(),
                state.frozen_dtype, state.plan.keep_gathered, state.plan.gather_spec,
            )  # fmt: skip
            leaf, named = self._gathering.shard, self._gathering.params()
        else:
            leaf = (compute if compute is not None else compute_params(state, self.mesh)).detach()
            leaf.requires_grad_()
            named = named_tensors(state.layout, leaf, frozen_params(state, self.mesh), {})
        self.leaf, self.named = leaf, {**named, **self.buffers}
        # bound until the micro-step ends: an activation-checkpoint recompute in the backward computes with them
        self._stack.enter_context(bound(module, self.named))

    @property
    def received(self) -> bool:
        """Whether a backward reached the gathering (the engine's per-unit path)."""
        return self._gathering is not None and self._gathering.received

    def reduced_gradients(self) -> Tensor:
        """The engine's per-unit path: this rank's reduced gradients (units no backward reached reduced as zeros)."""
        assert self._gathering is not None
        self.gathered_peak = self._gathering.peak
        with record_function("fzero.reduce"):
            grads = self._gathering.finish()
        self._gathering = None
        return grads

    # ------------------------------------------------------------------------------------------- the close half
    def close(self, grads: Tensor | None, loss: Tensor | None, *, reduced: bool, buffers: dict | None = None,
              gathered: Tensor | None = None, donate: bool = False,
              failure: BaseException | None = None) -> tuple[TrainState, dict[str, Any]]:  # fmt: skip
        """End the micro-step: agree with the other ranks, then update.

        Args:
          grads, loss: per rank, the step's gradients (reduced unit by unit when `reduced`) and unscaled loss; None
            with a `failure`.
          buffers: the module buffers as the forward left them (default: the state's).
          gathered: the full compute parameters the forward used, kept through an accumulation window where the
            plan keeps them.
          donate: the chain may overwrite the state's buffers.
          failure: what this rank's forward or backward raised (the step's collectives completed).

        Raises:
          DesyncError: on every rank, when the ranks did not run the same step or one failed.
        """
        try:
            with record_function("fzero.agree"):
                agree(self.mesh, int(self.state.step), self.ledger.total("calls"), failure)
            assert grads is not None and loss is not None
            state = self.state if buffers is None else self.state.replace(buffers=buffers)
            if self.speculation is not None:
                self.speculation.drain()  # (its work done before the chain may overwrite donated buffers)
            new, metrics = apply_gradients(state, grads, loss, self.tx, self.mesh, donate=donate, reduced=reduced,
                                           speculation=self.speculation)  # fmt: skip
        finally:
            self.abandon()
        if not (metrics["applied"] or metrics["skipped"]) and self.state.plan.keep_gathered and gathered is not None:
            # an accumulation window: the parameters did not change (detached: at world 1 it is the backward's leaf)
            new = new.replace(compute=gathered.detach())
        metrics["comm"] = self.ledger.as_dict()
        if self.gathered_peak is not None:
            metrics.setdefault("gathered_peak", self.gathered_peak)
        return new, metrics

    def fail(self, error: BaseException) -> None:
        """This rank's forward or backward raised `error` (the engine's): complete the step's collectives (zero
        gradients for what it did not reach), then agree with the others, which raises `DesyncError` on every rank,
        in this step, before any update. On a mesh that needs no agreement (one process) nothing is issued and
        `error` propagates as it is (the caller re-raises it), as after a failed collective."""
        try:
            if len(self.mesh.local_ranks) == self.mesh.world or isinstance(error, CollectiveError):
                return  # one process: nothing to pair; a collective failed: issuing more cannot help
            if self._gathering is not None:
                self._gathering.complete(abandoned=True)
            with record_function("fzero.agree"):
                agree(self.mesh, int(self.state.step), self.ledger.total("calls"), error)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """End the micro-step without an update: unbind, stop counting, free what is gathered, end a speculation."""
        if self._gathering is not None:
            self._gathering.close()
            self._gathering = None
        self._end_speculation()
        self._stack.close()

    def _end_speculation(self) -> None:
        if self.speculation is not None:
            self.speculation.close()
            self.speculation = None


class _Reducer:
    """A chain's per-unit reduction for the gathering (`fzero.mesh.ranks.ReduceFn`), telling a speculation as each unit
    lands."""

    def __init__(self, unit: Any, ctx: Context, speculation: Speculation | None) -> None:
        self.unit, self.ctx = unit, ctx
        self.landed = None if speculation is None else speculation.landed
        self.takes_pieces = takes_pieces(unit)

    def __call__(self, grads: Tensor | Pieces, index: int, place: Any = None) -> Any:
        with record_function("fzero.reduce"):
            return self.unit(grads, index, self.ctx if place is None else self.ctx._replace(place=place))

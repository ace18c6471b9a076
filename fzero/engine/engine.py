"""`Engine`: DeepSpeed's `engine(batch)`, `engine.backward(loss)`, `engine.step()` over fzero's functional core.

(Over 500 lines: about half of it is DeepSpeed's public surface, each method a name its users call, with its
docstring; the training itself is `fzero.step.microstep.MicroStep`'s, the counters `EngineCounters`, the configuration
accessors `ConfigAccessors`, the checkpoints `fzero.engine.checkpointing`.)

The engine holds a `TrainState` and rebinds it; a micro-step is the core's own `fzero.step.microstep.MicroStep`, driven
in two halves:

    engine(*args)          the first forward opens the micro-step (MicroStep.open_shell): functional_call(model,
                           views of leaf, ...), leaf = the full compute parameters, or the unit gathering's shard
                           (each unit's gradient reduced in the backward, where the plan says so)
    engine.backward(loss)  g += gradient of loss * S at leaf        S: the state's loss scale (1 unless fp16)
    engine.step()          state, metrics = micro.close(g, loss)    the ranks' agreement, then the chain

so `initialize` + this loop computes exactly what `fzero.train_step` computes with the same preset, through the
same code: the desync check (`fzero.DesyncError`; a rank whose forward or backward raises completes the step's
collectives and fails it on every rank, `MicroStep.fail`), the loss scale and the per-unit path included. From the first
forward of a micro-step to its `step()` the views stay bound into the model (`fzero.sharding.bind`), so that an
activation-checkpoint recompute in the backward computes with them. A forward under `torch.no_grad()` (or
`inference_mode`), e.g. an evaluation between steps, starts no micro-step: it computes with the current parameters
(stage 3 gathering one unit at a time and freeing each after its module ran, then gathering the units an early
exit skipped, as the other ranks do) and leaves training untouched, except
for the buffers a train-mode forward updates, as in plain PyTorch.

Gradient accumulation: DeepSpeed divides each micro-batch's gradients by `gradient_accumulation_steps` (GAS) in a
hook and sums them; the chain's `accumulate(GAS)` sums and then divides: the same mean, so `backward` does not
divide. `backward(loss, scale_wrt_gas=False)` in DeepSpeed skips the division, leaving the *sum* of the micro-batch
gradients; here the micro-step's gradient is multiplied by GAS in the accumulation dtype instead (exact when GAS is
a power of two), so the chain's mean is that sum. Two `backward` calls before a `step` add their gradients (the
second needs the graph: `retain_graph=True` on the first, as in torch).

Counters follow DeepSpeed 0.19: `micro_steps` counts `step()` calls; on the boundary (`(micro_steps + 1) % GAS ==
0`) `global_steps` and `global_samples` advance even when a non-finite step is skipped (`skipped_steps`), while the
optimizer's update count and hence the LR schedule advance only on applied updates.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from ..config import Config
from ..config.build import build_gather_policy, build_policy
from ..layout import unflatten
from ..mesh import CollectiveError, Mesh
from ..metrics import Monitor, transformer_flops
from ..metrics.monitors import MonitorMaster, boundary_events
from ..optim import Hyper, hyper_value
from ..sharding.bind import bound
from ..sharding.units import UnitGathering
from ..state import TrainState
from ..step import init
from ..step import state_dict as consolidated
from ..step.microstep import (
    MicroStep,
    compute_params,
    frozen_params,
    loss_scale,
    named_tensors,
    read_unit_by_unit,
    scaled,
)
from ..storage import in_memory
from ..transforms import Transform
from ..transforms.scaling import current_loss_scale
from . import checkpointing
from .accessors import ConfigAccessors
from .client import OptimizerView
from .counters import EngineCounters

__all__ = ["Engine"]


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v))


class Engine(ConfigAccessors, nn.Module):
    """The DeepSpeed-compatible training engine (built by `fzero.initialize`).

    Attributes:
      state: the current `TrainState` (rebound by every `step()`).
      mesh, tx: the mesh and transform chain the state belongs to.
      config: the validated `fzero.config.Config`.
      optimizer: the `OptimizerView` (hyper-parameters of the next update), or the client optimizer.
      global_steps, global_samples, micro_steps, skipped_steps: DeepSpeed's counters.
      step_metrics: the last `step()`'s metrics, as the functional step reports them (`fzero.train_step`: `loss`,
        `applied`, `skipped`, `grad_norm`, `comm`, `io`, `speculation`, ...); None before the first.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config,
        mesh: Mesh,
        tx: Transform,
        optimizer: OptimizerView | torch.optim.Optimizer,
        *,
        lr: Hyper | Sequence[Hyper],
        betas: tuple[Hyper, Hyper] | Sequence[tuple[Hyper, Hyper]] | None = None,
        param_groups: Sequence[dict[str, Any]] | None = None,
        momentum: str = "betas",
        client_scheduler: Any = None,
        device: torch.device | None = None,
        printer: Any = print,
    ) -> None:
        super().__init__()
        self._modules["module"] = model  # a submodule, as in DeepSpeed: train()/eval() and "module." keys
        self.config = config
        self.mesh = mesh
        self.tx = tx
        self.optimizer = optimizer
        self.client_scheduler = client_scheduler
        self._lrs: list[Hyper] = list(lr) if isinstance(lr, (list, tuple)) else [cast(Hyper, lr)]  # (else: one)
        self._betas: list[tuple[Hyper, Hyper]] | None = None
        if betas is not None:  # one pair per group, or one for every group
            pairs = cast("Sequence[Sequence[Hyper]]", betas if isinstance(betas[0], (list, tuple)) else [betas])
            self._betas = [cast("tuple[Hyper, Hyper]", tuple(b)) for b in pairs]
        self._groups = list(param_groups) if param_groups is not None else list(optimizer.param_groups)
        if len(self._groups) != len(self._lrs) or (self._betas is not None and len(self._betas) != len(self._lrs)):
            raise ValueError(
                f"Engine: {len(self._groups)} param groups but {len(self._lrs)} learning rates"
                + ("" if self._betas is None else f" and {len(self._betas)} betas")
            )
        self._momentum = momentum
        self._device = device or next(model.parameters()).device
        self._policy = build_policy(config)
        self._gather_policy = build_gather_policy(config).on(mesh)
        self._sim = mesh.stacked
        if self._sim and mesh.world != 1:
            raise ValueError(f"the engine runs one rank per process: SimMesh(world={mesh.world}) is not one")
        self.state: TrainState = init(model, tx, mesh)
        self.counters = EngineCounters()
        self._micro: MicroStep | None = None
        # stages 1-2: (the state's compute shard, its all-gather), valid until the next update (a donated update
        # changes the shard in place: then the shard is None, and the buffer is refilled in place)
        self._gathered: tuple[Tensor | None, Tensor] | None = None
        self._gas_factor = 1.0
        self._grad: Tensor | None = None
        self._loss: Tensor | None = None
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._t_step: float | None = None
        self._last_record: dict[str, Any] | None = None
        self.step_metrics: dict[str, Any] | None = None
        self._step_applied = False
        self.monitor = self._make_monitor(printer)
        self._sync_module()
        self._sync_view()

    # ------------------------------------------------------------------------------------------ DeepSpeed accessors
    # DeepSpeed's counters, read and set as attributes (they live in `self.counters`)
    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")

    @property
    def module(self) -> nn.Module:
        """The user's model. Its parameters are views of the engine's current compute parameters (stages 0-2,
        in the compute dtype); at stage 3 they are empty, as DeepSpeed leaves them (use `module_state_dict()`)."""
        module = self._modules["module"]
        assert module is not None  # (set in __init__, never removed)
        return module

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The monitor's record of the last optimizer step (`fzero.metrics.Monitor.record`), None before one. Its
        loss is read from the device now if it was not yet (on a GPU, a wait for the work queued so far)."""
        if self._last_record is not None:
            self.monitor.read_losses()
        return self._last_record

    @property
    def world_size(self) -> int:
        return self.mesh.world

    dp_world_size = world_size

    @property
    def global_rank(self) -> int:
        return 0 if self._sim else int(self.mesh.rank)

    def applied_updates(self) -> int:
        """Updates the optimizer applied (skipped steps excluded): what the LR schedule is a function of."""
        opt = self.state.plan.state_of(self.state.tx_state, "update")
        return int(opt.count) if opt is not None and hasattr(opt, "count") else self.counters.applied

    def get_lr(self) -> list[float]:
        """The learning rate of the next update, one per param group (DeepSpeed's `engine.get_lr()`: its groups
        with parameters, in order)."""
        return self._lrs_at(self.applied_updates())

    def _lrs_at(self, n: int) -> list[float]:
        return [float(hyper_value(lr, n)) for lr in self._lrs]

    def get_mom(self) -> list[Any]:
        """The momentum of the next update, one per param group, as DeepSpeed's `engine.get_mom()` reads it: the
        groups' `momentum` for a config SGD, their `betas` otherwise (a client `torch.optim.SGD` has none: 0.0)."""
        return [group.get(self._momentum, 0.0) for group in self._groups]

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the parameters (a boundary step that was not skipped)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (unscaled, before clipping) of the last boundary step; None before the first."""
        return self.counters.global_grad_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 unless fp16)."""
        return loss_scale(self.state)

    # ------------------------------------------------------------------------------------- forward, backward, step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward with the current compute parameters (see the module docstring for `no_grad`)."""
        t0 = time.perf_counter()
        if self.config["fp16"]["auto_cast"]:
            args, kwargs = self._policy.cast_to_compute((args, kwargs))
        if not torch.is_grad_enabled() and self._micro is None:
            return self._forward_without_grad(args, kwargs)
        if self._t_step is None:
            self._t_step = t0
        if self._micro is None:
            self._micro = MicroStep(self.state, self.tx, self.mesh, self._gather_policy)
            self._micro.open_shell(self.module, self._compute(), self._local)
        with record_function("fzero.forward"):
            try:  # (the micro-step's tensors are bound into the module: `MicroStep.open_shell`)
                out = self.module(*args, **kwargs)
            except Exception as e:
                self._fail(self._micro, e)
                raise
        self._times["forward"] += time.perf_counter() - t0
        return out

    def _fail(self, micro: MicroStep, error: Exception) -> None:
        """This rank's forward, backward or step raised: the micro-step is abandoned on every rank, as the core
        abandons it (`MicroStep.fail`: the step's collectives completed, then `DesyncError` on every rank, nothing
        updated); on one process `error` propagates."""
        self._micro = None
        self._grad = self._loss = None
        micro.fail(error)

    def _compute(self) -> Tensor | None:
        """This rank's full compute parameters for the next forward, or None at stage 3 (gathered unit by unit).
        At stages 1-2 the state keeps them sharded: they are all-gathered once per update (what DeepSpeed does after
        its step), so that `engine.module` holds them, and kept for the micro-steps of the accumulation window."""
        state = self.state
        compute = state.compute if state.compute is not None else state.params
        if read_unit_by_unit(state, self.mesh):  # one rank, the copy on disk: read unit by unit
            return None
        if not state.plan.sharded_at_rest:
            return self._local(in_memory(compute))
        if not state.plan.keep_gathered:
            return None
        if self._gathered is None or self._gathered[0] is not compute:  # stale after every update (see step)
            # refilled in place: the module's parameters are views of it, so a new buffer would hold the model
            # twice while they still point at the old one
            old = None if self._gathered is None else self._gathered[1]
            self._gathered = (compute, self._local(compute_params(state, self.mesh, out=old)))
        return self._gathered[1]

    def _forward_without_grad(self, args: Any, kwargs: Any) -> Any:
        """A forward outside any micro-step (evaluation): the state's parameters, buffers updated as the forward
        updates them (a train-mode BatchNorm), nothing else changed."""
        state, module = self.state, self.module
        buffers = {k: self._local(v).clone() for k, v in state.buffers.items()}
        gathering, compute = None, self._compute()
        if compute is None:
            assert state.compute is not None  # (stage 3 keeps a compute shard; a chain without gather() is not handled)
            frozen = None if state.frozen is None else self._local(state.frozen)
            gathering = UnitGathering(
                self.mesh, state.layout, module, state.compute, frozen, self._gather_policy, None,
                state.frozen_dtype, gather_spec=state.plan.gather_spec,
            )  # fmt: skip
            named = {**gathering.params(), **buffers}
        else:
            frozen = frozen_params(state, self.mesh)
            named = named_tensors(state.layout, compute, None if frozen is None else self._local(frozen), buffers)
        try:
            try:
                with bound(module, named):  # (the parameters' own attributes too: `carry_attributes`)
                    out = module(*args, **kwargs)  # (bound just above: no functional_call to swap them in again)
            except Exception as e:
                if gathering is not None and not isinstance(e, CollectiveError):  # the others' gathers pair with them
                    gathering.complete(abandoned=True)
                raise
            if gathering is not None:  # the units an early exit skipped: the other ranks gather them
                gathering.complete()
        finally:
            if gathering is not None:
                gathering.close()
        if buffers:
            self.state = state.replace(buffers={k: self._per_rank(v) for k, v in buffers.items()})
        return out

    def _local(self, x: Tensor) -> Tensor:
        """This rank's value of a per-rank tensor (the single row of a one-rank SimMesh)."""
        return x[0] if self._sim else x

    def _per_rank(self, x: Tensor) -> Tensor:
        return x.unsqueeze(0) if self._sim else x

    def scale(self, loss: Tensor) -> Tensor:
        """`loss` times the current loss scale, for a manual `scale(loss).backward()` (fp16); `step()` then uses
        the gradients the backward left."""
        return scaled(self.state, loss)

    def backward(self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Tensor:
        """Gradients of `loss` (times the loss scale) for this micro-step, added to any from an earlier `backward`
        since the last `step()`.

        Args:
          loss: the scalar loss computed from `engine(...)`'s outputs.
          retain_graph: keep the graph for another backward through it.
          scale_wrt_gas: DeepSpeed's: average the micro-batches' gradients (True) or sum them (False).

        Returns:
          The loss divided by the accumulation steps (or the loss, with `scale_wrt_gas=False`), for logging.
        """
        t0 = time.perf_counter()
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {shape}")
        micro = self._micro
        if micro is None:
            raise RuntimeError(
                "engine.backward(loss): no engine(...) forward with gradients since the last engine.step() (a "
                "forward under torch.no_grad() computes no gradients)"
            )
        if not loss.requires_grad:
            raise RuntimeError(
                "engine.backward(loss): the loss does not depend on the engine's parameters "
                "(computed under torch.no_grad(), or not from engine(...)'s outputs?)"
            )
        earlier, micro.leaf.grad = micro.leaf.grad, None  # a manual loss.backward() before this one
        with record_function("fzero.backward"):  # not autograd.grad: reentrant checkpointing refuses it
            try:
                self.scale(loss).backward(retain_graph=retain_graph)
            except Exception as e:
                micro.leaf.grad = earlier
                self._fail(micro, e)
                raise
        grad, micro.leaf.grad = micro.leaf.grad, earlier
        gas = self.config.gas
        if micro.per_unit:  # the units' gradients were reduced into the gathering during the backward
            self._gas_factor = gas if not scale_wrt_gas and gas > 1 else 1.0
        else:
            if grad is None:
                grad = torch.zeros_like(micro.leaf)
            if not scale_wrt_gas and gas > 1:
                grad = grad.to(self._policy.accum_dtype or grad.dtype) * gas
            self._grad = grad if self._grad is None else self._grad + grad
        self._loss = loss.detach()
        self._times["backward"] += time.perf_counter() - t0
        out = loss.detach()
        return out / gas if scale_wrt_gas else out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the current micro-step's gradients and forwards (DeepSpeed's `engine.zero_grad()`)."""
        self._discard_micro_step()
        self._grad = self._loss = None

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End the micro-step: the chain accumulates its gradients and, on the boundary, updates the parameters."""
        t0 = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        micro = self._micro
        if micro is None:
            raise RuntimeError("engine.step(): no gradients since the last step; call engine.backward(loss) first")
        self._micro = None
        try:
            grads = self._take_grads(micro)
        except Exception as e:  # e.g. no backward on this rank: the others must not wait for it
            self._fail(micro, e)
            raise
        except BaseException:
            micro.abandon()
            raise
        loss = self._loss if self._loss is not None else torch.tensor(math.nan)
        self._grad = self._loss = None
        new, metrics = micro.close(  # the engine owns its state: donated, updated in place
            self._per_rank(grads), self._per_rank(loss), reduced=micro.per_unit, donate=True,
            buffers={k: self._per_rank(v) for k, v in micro.buffers.items()},
        )  # fmt: skip
        self.state, self.step_metrics = new, metrics
        self.counters.step_losses.append(metrics["loss"])
        applied, skipped = bool(metrics["applied"]), bool(metrics["skipped"])
        self._step_applied = applied
        if applied and self._gathered is not None:  # the parameters changed (in place, donated): stale
            self._gathered = (None, self._gathered[1])
        if boundary != (applied or skipped):
            raise RuntimeError(
                f"the transform chain and the engine disagree on the accumulation boundary at micro-step "
                f"{self.micro_steps}: was the state changed outside the engine?"
            )
        self._times["step"] += time.perf_counter() - t0
        if boundary:
            self._end_global_step(metrics, applied, skipped, lr_kwargs)
        self._sync_module()
        self.micro_steps += 1

    def _take_grads(self, micro: MicroStep) -> Tensor:
        grads: Tensor | None
        if micro.per_unit:
            if not micro.received:
                raise RuntimeError("engine.step(): no gradients since the last step; call engine.backward(loss) first")
            grads = micro.reduced_gradients()
            return grads * self._gas_factor if self._gas_factor != 1.0 else grads
        grads = self._grad
        direct = micro.leaf.grad
        if direct is not None:  # a manual loss.backward() (or engine.scale(loss).backward())
            grads = direct if grads is None else grads + direct
        if grads is None:
            raise RuntimeError("engine.step(): no gradients since the last step; call engine.backward(loss) first")
        return grads

    def _end_global_step(self, metrics: dict[str, Any], applied: bool, skipped: bool, lr_kwargs: Any) -> None:
        lr_used = self._lrs_at(self.applied_updates() - applied)
        self.counters.global_grad_norm = metrics.get("grad_norm")
        self.optimizer.overflow = skipped  # type: ignore[union-attr]  # (a client optimizer gets it too, as in DeepSpeed)
        if skipped:
            self.skipped_steps += 1
            if self.global_rank == 0:
                self.monitor.printer(self._overflow_message(float(metrics["loss_scale"])))
        else:
            self.counters.applied += 1
            if self.client_scheduler is not None:
                self._step_scheduler(lr_kwargs)
            elif lr_kwargs:
                raise ValueError(
                    "engine.step(lr_kwargs=...): the configured schedule is a function of the applied updates and "
                    "takes no arguments (lr_kwargs go to a client lr_scheduler)"
                )
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        self._sync_view()
        self._report(lr_used, metrics)

    def _overflow_message(self, attempted: float) -> str:
        """DeepSpeed's overflow line, so that logs read the same."""
        head = f"fzero: OVERFLOW! Skipping step {self.global_steps + 1} (inf/nan gradients)."
        ls = current_loss_scale(self.state)
        if self.loss_scale != attempted:
            return f"{head} Attempted loss scale: {attempted:g}, reducing to {self.loss_scale:g}"
        if hasattr(ls, "cur_hysteresis"):
            h = int(ls.cur_hysteresis)
            return f"{head} Attempted loss scale: {attempted:g}, but hysteresis is {h + 1}. Reducing hysteresis to {h}"
        return head

    def _step_scheduler(self, lr_kwargs: dict[str, Any] | None) -> None:
        # torch's schedulers warn unless the optimizer stepped first: the engine's update was that step
        self.optimizer._opt_called = True  # type: ignore[union-attr]  # (torch's schedulers' private flag)
        try:
            self.client_scheduler.step(**(lr_kwargs or {}))
        except TypeError:
            if lr_kwargs:
                raise
            self.client_scheduler.step(self.config.train_batch_size)  # DeepSpeed's fallback

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        overwrite: bool = True,
    ) -> bool:
        """DeepSpeed's `save_checkpoint`: the training state, the counters, the config and `client_state`, written
        with `fzero.save` to ``save_dir/tag`` (every rank calls it; see ``docs/checkpoints.md``).

        Allowed after any `step()`, inside an accumulation window too (the window's partial sums are part of the
        state); not between a `backward` and its `step` (those gradients are not).

        Args:
          save_dir: the root of tagged checkpoints.
          tag: the checkpoint's name (`str(tag)`); default ``global_step{global_steps}``, as DeepSpeed's.
          client_state: a JSON-serialisable dict, returned by `load_checkpoint` (rank 0's is kept; tuples come
            back as lists).
          save_latest: point ``save_dir/latest`` at this checkpoint.
          exclude_frozen_parameters: not supported (must be False).
          overwrite: fzero only: replace an existing checkpoint of the same tag (atomically), as DeepSpeed writes
            over it; False makes that an error.

        Returns:
          True, as DeepSpeed's (the checkpoint is ``save_dir/tag``; errors raise).
        """
        checkpointing.save_checkpoint(
            self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, overwrite=overwrite
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
        *,
        restore_rng: bool | None = None,
        verify: bool = True,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's `load_checkpoint`, from any world size and stage (the format reshards).

        Args:
          load_dir: the root of tagged checkpoints (or one checkpoint directory).
          tag: which checkpoint; None: the one ``load_dir/latest`` names.
          load_module_strict: must be True (the checkpoint must be of the same model).
          load_optimizer_states: False keeps the engine's optimizer state (moments and applied-update count, so a
            config LR schedule restarts with it; a warning says so) and loads the rest.
          load_lr_scheduler_states: a client scheduler's `state_dict` is loaded with it. The config's schedules are
            functions of the optimizer's applied-update count: False with the optimizer state loaded raises (the two
            cannot be separated).
          load_module_only: load the parameters, frozen parameters and buffers only; the optimizer state, loss
            scale, accumulation window, counters and schedule stay the engine's.
          custom_load_fn: not supported (must be None).
          restore_rng: fzero only: restore this process's random generators (default: unless `load_module_only`),
            so that a resumed run draws what the uninterrupted one would.
          verify: fzero only: check every file's sha256 first.

        Returns:
          `(path, client_state)`: the checkpoint's directory and the saved `client_state`; `(None, None)` with a
          warning when there is no checkpoint (no ``latest``, or no such tag), as DeepSpeed does.
        """
        return checkpointing.load_checkpoint(
            self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
            load_module_only, custom_load_fn, restore_rng=restore_rng, verify=verify,
        )  # fmt: skip

    def check_between_steps(self, what: str) -> None:
        """Checkpoints hold the state between micro-steps: gradients of a micro-step not yet stepped are not in it."""
        pending = self._loss is not None or self._grad is not None
        if self._micro is not None and self._micro.leaf.grad is not None:
            pending = True
        if pending:
            raise RuntimeError(
                f"engine.{what}: called between engine.backward(loss) and engine.step(); that micro-step's gradients "
                "are not part of the training state and a checkpoint cannot hold them. Call it after engine.step() "
                "(inside a gradient accumulation window is fine)"
            )

    def restore(self, state: TrainState, counters: EngineCounters | None) -> None:
        """Take `state` (and `counters`, unless None) as the engine's, from a checkpoint: any micro-step in flight
        is dropped and the module and optimizer view show the new state."""
        self._discard_micro_step()
        self.state = state
        self._gathered = None  # a gathered copy of the old state's compute parameters
        if counters is not None:
            self.counters = counters
        self._t_step = None
        self._sync_module()
        self._sync_view()

    def _discard_micro_step(self) -> None:
        """Drop a forward in flight (no gradients yet): its parameters are the old state's."""
        if self._micro is not None:
            self._micro.abandon()
            self._micro = None

    # --------------------------------------------------------------------------------------------------- reporting
    def _make_monitor(self, printer: Any) -> Monitor:
        m = self.config["fzero_metrics"]
        flops = None
        if m["seq_length"] and m["num_layers"] and m["hidden_size"]:
            flops = transformer_flops(
                self.state.layout.real_numel, m["num_layers"], m["hidden_size"], m["seq_length"], 1,
                m["activation_checkpointing"],
            )  # fmt: skip
        return Monitor(
            self.config.train_batch_size,
            self.mesh.world,
            steps_per_print=self.config.steps_per_print,
            jsonl=m["jsonl"],
            warmup_steps=m["warmup_steps"],
            seq_length=m["seq_length"],
            flops_per_sample=flops,
            enabled=self.global_rank == 0,
            printer=printer,
            # DeepSpeed's tensorboard / wandb / csv_monitor / comet blocks: written on global rank 0 only
            writers=MonitorMaster(self.config.values, write=self.global_rank == 0),
        )

    def _report(self, lr: list[float], metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        step_time = now - (self._t_step or now)
        self._t_step = now
        losses = self.counters.step_losses
        self.counters.step_losses = []
        device = losses[-1].device  # (a resumed window's first losses come from the checkpoint, on the CPU)
        values: dict[str, Any] = {
            # the micro-steps' losses as they are: the monitor reads them when it needs them (`Monitor.record`)
            "loss": torch.stack([x.to(device) for x in losses]),
            "lr": lr[0],  # DeepSpeed's monitors log get_lr()[0]
            "loss_scale": float(metrics["loss_scale"]),
            "skipped": bool(metrics["skipped"]),
            "grad_norm": metrics.get("grad_norm"),
        }
        if len(lr) > 1:
            values["lr_groups"] = lr  # DeepSpeed's progress line prints get_lr(): every group's
        times_ms = {k: v * 1e3 for k, v in self._times.items()} if self.config.wall_clock_breakdown else None
        if times_ms is not None:
            values.update({f"{k}_ms": v for k, v in times_ms.items()})
        self._times = dict.fromkeys(self._times, 0.0)
        record = self._last_record = self.monitor.record(self.global_steps, step_time, **values)
        writers = self.monitor.writers
        if writers is not None and writers.writers:  # every boundary, whatever steps_per_print, as DeepSpeed
            # DeepSpeed logs get_lr()[0] and the loss scale as they are after the step (the next update's)
            fp16 = self.config.precision == "fp16"
            self.monitor.read_losses()
            self.monitor.write_events(
                boundary_events(
                    self.global_samples, self.get_lr()[0], record["loss"],
                    loss_scale=self.loss_scale if fp16 else None, times_ms=times_ms,
                )
            )  # fmt: skip

    # ------------------------------------------------------------------------------------------- the user's model
    def _sync_module(self) -> None:
        """Point the module's parameters at the state's compute parameters (stages 0-2; no copy), empty them at
        stage 3 (they are sharded), and its buffers at the state's."""
        state = self.state
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            # the frozen parameters show where they are whole (not sharded at rest)
            frozen = None if state.frozen is None or state.plan.sharded_at_rest else self._local(state.frozen)
            for lay, flat in ((state.layout, self._compute()), (state.layout.frozen_layout, frozen)):
                if lay is None:
                    continue
                full = flat is not None
                views = unflatten(lay, flat) if flat is not None else {}
                for leaf in lay.leaves:
                    p = named[leaf.name]
                    p.data = views[leaf.name] if full else torch.empty(0, dtype=p.dtype, device=p.device)
            module_buffers = dict(self.module.named_buffers())
            for name, value in self.state.buffers.items():
                if name in module_buffers:
                    module_buffers[name].data = self._local(value)

    def _sync_view(self) -> None:
        """Show the next update's hyper-parameters in the optimizer view (unless a client scheduler drives them)."""
        self.optimizer.cur_scale = self.loss_scale  # type: ignore[union-attr]  # (a client optimizer's too, as in DeepSpeed)
        if self.client_scheduler is not None:
            return
        n = self.applied_updates()
        for i, group in enumerate(self._groups):
            group["lr"] = float(hyper_value(self._lrs[i], n))
            if self._betas is not None:
                group["betas"] = tuple(float(hyper_value(b, n)) for b in self._betas[i])

    def module_state_dict(self) -> dict[str, Tensor]:
        """The consolidated parameters (fp32 master), frozen parameters and buffers: what the model's
        `load_state_dict` accepts. At stage 3 on several processes this all-gathers: call it on every rank."""
        return consolidated(self.state, None if self._sim else self.mesh)

    def summary(self) -> dict[str, Any]:
        """The run's totals so far (see `fzero.metrics.Monitor.summary`)."""
        return self.monitor.summary()

    def close(self) -> None:
        """Close the metrics file; flush and close the monitors (TensorBoard, W&B, CSV, Comet)."""
        self.monitor.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"fzero.Engine(ZeRO-{c.stage}, {c.precision}, {self.mesh!r}, micro batch {c.micro_batch}, "
            f"accumulate {c.gas}, {self.state.layout.real_numel:,} parameters)"
        )

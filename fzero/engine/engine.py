"""`Engine`: DeepSpeed's `engine(batch)`, `engine.backward(loss)`, `engine.step()` over fzero's functional core.

This module is the training loop; the engine's other parts are mixins of one concern each: the configuration
accessors (`ConfigAccessors`), the next update's hyper-parameters as the optimizer object shows them (`HyperParams`),
the monitor (`Reporting`), the model's parameters as views of the state (`ModuleSync`), the checkpoints
(`CheckpointMethods`), the accumulation boundary and `no_sync` (`Accumulation`), the 16-bit model file
(`ModelSave`) and the engine's life (`Lifecycle`: `compile`, `destroy`); the counters are `EngineCounters`, the
training itself `fzero.step.microstep.MicroStep`'s.

The engine holds a `TrainState` and rebinds it; a micro-step is the core's own `fzero.step.microstep.MicroStep`, driven
in two halves:

    engine(*args)          the first forward opens the micro-step (MicroStep.open_engine): functional_call(model,
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

Counters follow DeepSpeed 0.19: `micro_steps` counts `step()` calls (the micro-batches, where the script sets the
boundary: `fzero.engine.accumulation`); on the boundary (`(micro_steps + 1) % GAS == 0`) `global_steps` and
`global_samples` advance even when a non-finite step is skipped (`skipped_steps`), while the optimizer's update count
and hence the LR schedule advance only on applied updates.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from ..config import Config
from ..config.build import build_gather_policy, build_policy
from ..layout import Auto
from ..mesh import CollectiveError, Mesh
from ..mesh.ranks import rank_view
from ..optim import Hyper
from ..sharding.bind import bound
from ..sharding.units import UnitGathering
from ..state import TrainState
from ..state.precision import Policy
from ..step import init
from ..step.microstep import MicroStep, frozen_params, named_tensors, scaled
from ..transforms import Transform
from .accessors import ConfigAccessors
from .accumulation import Accumulation
from .autocast import AutocastAccessors
from .checkpointing import CheckpointMethods
from .client import OptimizerView
from .counters import EngineCounters
from .curriculum import CurriculumMethods
from .hyperparams import HyperParams
from .lifecycle import Lifecycle
from .model_save import ModelSave
from .module_calls import ModuleCalls
from .module_sync import ModuleSync
from .parameters import ParameterAccess
from .random_ltd import RandomLTD
from .reporting import Reporting
from .throughput import ThroughputTimer

__all__ = ["Engine"]


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), lambda self, v: setattr(self.counters, name, v))


class Engine(
    ConfigAccessors,
    AutocastAccessors,
    HyperParams,
    Reporting,
    ParameterAccess,
    ModuleSync,
    CurriculumMethods,  # (before CheckpointMethods: its checkpoints add the curriculum's state)
    RandomLTD,  # (before CheckpointMethods: its checkpoints add the random-LTD scheduler's state)
    CheckpointMethods,
    Accumulation,
    ModelSave,
    Lifecycle,
    ModuleCalls,
    nn.Module,
):
    """The DeepSpeed-compatible training engine (built by `fzero.initialize`).

    Attributes:
      state: the current `TrainState` (rebound by every `step()`).
      mesh, tx: the mesh and transform chain the state belongs to.
      config: the validated `fzero.config.Config`.
      optimizer: the `OptimizerView` (hyper-parameters of the next update), or the client optimizer.
      global_steps, global_samples, micro_steps, skipped_steps: DeepSpeed's counters.
      step_metrics: the last `step()`'s metrics, as the functional step reports them (`fzero.train_step`: `loss`,
        `applied`, `skipped`, `grad_norm`, `comm`, `io`, `speculation`, ...); None before the first.
      lr_scheduler, training_dataloader: the scheduler and data loader `initialize` returned (None without).
      tput_timer: DeepSpeed's throughput timer (`fzero.engine.throughput`).
      forward_only: built without an optimizer: forwards only (`fzero.engine.build`).

    A name the engine does not have is looked up on the module, and the module's methods run as the engine's
    forward (`fzero.engine.module_calls`).
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
        policy: Policy | None = None,
        printer: Any = print,
    ) -> None:
        super().__init__()
        self._modules["module"] = model  # a submodule, as in DeepSpeed: train()/eval() and "module." keys
        self.config = config
        self.mesh = mesh = rank_view(mesh)  # (its per-rank values are this rank's own, whatever mesh it was given)
        self.tx = tx
        self.optimizer = optimizer
        self.client_scheduler = client_scheduler
        groups = param_groups if param_groups is not None else optimizer.param_groups
        self._set_hypers(lr, betas, groups, momentum)
        self._device = device or next(model.parameters()).device
        self._policy = policy if policy is not None else build_policy(config)
        self._gather_policy = build_gather_policy(config).on(mesh)
        # DeepSpeed's granularity where the ModuleList rule would leave one unit most of the model: each module of
        # at least the persistence threshold (DeepSpeed keeps smaller parameters gathered) a unit
        units = Auto(max(1, int(config["zero_optimization"]["stage3_param_persistence_threshold"])))
        # at stage 3 the module's parameters (and zero.Init's partitions) are emptied as their units go into the
        # state, as DeepSpeed's stage 3 and fully_shard release them: the model and the state are never both whole
        stage3 = config["zero_optimization"]["stage"] == 3
        self.state: TrainState = init(model, tx, mesh, units=units, release=stage3)
        self.counters = EngineCounters()
        self._micro: MicroStep | None = None
        self._gathered = None
        self._gas_factor = 1.0
        self._grad: Tensor | None = None
        self._loss: Tensor | None = None
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._t_step: float | None = None
        self._last_record: dict[str, Any] | None = None
        self.step_metrics: dict[str, Any] | None = None
        self._step_applied = False
        self._boundary: bool | None = None
        self.inside_no_sync_ctxt = False
        self.lr_scheduler: Any = None
        self.training_dataloader: Any = None
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self._calls = 0  # engine calls running: the module's own calls inside them are the engine's
        self.forward_only = False  # (fzero.engine.build sets it where no optimizer was given)
        self.monitor = self._make_monitor(printer)
        self._sync_module()
        self._sync_view()
        if self.state.plan.stage == 3:
            self._watch_outside_calls(model)

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
    def world_size(self) -> int:
        return self.mesh.world

    dp_world_size = world_size

    @property
    def global_rank(self) -> int:
        return self.mesh.rank

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the parameters (a boundary step that was not skipped)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (unscaled, before clipping) of the last boundary step; None before the first."""
        return self.counters.global_grad_norm

    # ------------------------------------------------------------------------------------- forward, backward, step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward with the current compute parameters (see the module docstring for `no_grad`)."""
        kwargs = self._curriculum_kwargs(kwargs)  # the legacy curriculum_learning block (fzero.engine.curriculum)
        self._random_ltd_forward()  # the random-LTD schedule at a training forward (fzero.engine.random_ltd)
        return self._call(self.module, args, kwargs)

    def _call(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` (the module, or one of its methods: `__getattr__`) as the engine runs a forward:
        with gradients, in the open micro-step (opened if none); without, on the state's parameters."""
        t0 = time.perf_counter()
        if self.config["fp16"]["auto_cast"]:
            args, kwargs = self._policy.cast_to_compute((args, kwargs))
        fn = self._under_autocast(fn)  # DeepSpeed's torch_autocast around every forward (fzero.engine.autocast)
        self._calls += 1
        try:
            if (self.forward_only or not torch.is_grad_enabled()) and self._micro is None:
                # (an engine that cannot step keeps no micro-step: its outputs are not differentiable in its
                # parameters, as its backward is refused)
                return self._forward_without_grad(fn, args, kwargs)
            if self._t_step is None:
                self._t_step = t0
            if self._micro is None:
                self._micro = MicroStep(self.state, self.tx, self.mesh, self._gather_policy)
                if self.inside_no_sync_ctxt:  # its backwards add their gradients locally; the chain reduces them once
                    self._micro.per_unit = False
                self._micro.open_engine(self.module, self._compute())
                self.tput_timer.start()
            with record_function("fzero.forward"):
                try:  # (the micro-step's tensors are bound into the module: `MicroStep.open_engine`)
                    out = fn(*args, **kwargs)
                except Exception as e:
                    self._fail(self._micro, e)
                    raise
        finally:
            self._calls -= 1
        self._times["forward"] += time.perf_counter() - t0
        return out

    def _fail(self, micro: MicroStep, error: Exception) -> None:
        """This rank's forward, backward or step raised: the micro-step is abandoned on every rank, as the core
        abandons it (`MicroStep.fail`: the step's collectives completed, then `DesyncError` on every rank, nothing
        updated); on one process `error` propagates."""
        self._micro = None
        self._grad = self._loss = None
        micro.fail(error)

    def _forward_without_grad(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A forward outside any micro-step (evaluation): the state's parameters, buffers updated as the forward
        updates them (a train-mode BatchNorm), nothing else changed."""
        with self._evaluation_binding():
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def _evaluation_binding(self) -> Iterator[None]:
        """Inside, the module holds the state's parameters (at stage 3 gathered unit by unit as its submodules
        run) and copies of its buffers, which the state takes at the end."""
        state, module = self.state, self.module
        buffers = {k: v.clone() for k, v in state.buffers.items()}
        gathering, compute = None, self._compute()
        if compute is None:
            assert state.compute is not None  # (stage 3 keeps a compute shard; a chain without gather() is not handled)
            frozen = state.frozen
            gathering = UnitGathering(
                self.mesh, state.layout, module, state.compute, frozen, self._gather_policy, None,
                state.frozen_dtype, gather_spec=state.plan.gather_spec,
            )  # fmt: skip
            named = {**gathering.params(), **buffers}
        else:
            frozen = frozen_params(state, self.mesh)
            named = named_tensors(state.layout, compute, frozen, buffers)
        try:
            try:
                with bound(module, named):  # (the parameters' own attributes too: `carry_attributes`)
                    yield  # (bound: the forward runs the module itself, no functional_call to swap them in again)
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
            self.state = state.replace(buffers=buffers)

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

        Raises:
          RuntimeError: the engine was built without an optimizer (DeepSpeed asserts "must provide optimizer during
            init in order to use backward").
        """
        # (DeepSpeed's bf16 stage-0 engine accepts this backward and keeps gradients that no step can apply;
        # refused here, as DeepSpeed's other engines refuse it)
        self._check_trainable("engine.backward(loss)")
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
        self._check_boundary("engine.backward")
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
        if self._boundary is False:  # the script said: not the window's end; this micro-batch is a micro-step
            self._close(None)
        out = loss.detach()
        return out / gas if scale_wrt_gas else out

    def _check_trainable(self, what: str) -> None:
        if self.forward_only:  # (set by fzero.engine.build)
            raise RuntimeError(
                f'{what}: this engine was built without an optimizer (no "optimizer" block in the config and none '
                'passed to initialize): it runs forwards only; add an "optimizer" block or pass optimizer= to '
                "initialize to train it"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the current micro-step's gradients and forwards (DeepSpeed's `engine.zero_grad()`)."""
        self._discard_micro_step()
        self._grad = self._loss = None

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End the micro-step: the chain accumulates its gradients and, on the boundary, updates the parameters.
        Where the script set the boundary False, its backward ended the micro-step already: nothing to do.

        Raises:
          RuntimeError: the engine was built without an optimizer (DeepSpeed asserts "must provide optimizer during
            init in order to use step").
        """
        self._check_trainable("engine.step()")
        if self.inside_no_sync_ctxt:
            raise RuntimeError(
                "It is illegal to call Engine.step() inside no_sync context manager (as in DeepSpeed): leave it, "
                "then engine.backward(loss) and engine.step() reduce the gradients added in it once"
            )
        if self._boundary is False and self._micro is None:
            return
        self._check_boundary("engine.step")
        self._close(lr_kwargs)

    def _close(self, lr_kwargs: dict[str, Any] | None) -> None:
        """End the open micro-step (`step()`'s work)."""
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
            grads, loss, reduced=micro.per_unit, donate=True, buffers=micro.buffers,
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
        self.tput_timer.stop(global_step=boundary)

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
        self.optimizer.overflow = skipped  # (a client optimizer gets it too, as in DeepSpeed)
        if skipped:
            self.skipped_steps += 1
            if self.global_rank == 0:
                self.monitor.printer(self._overflow_message(float(metrics["loss_scale"])))
        else:
            self.counters.applied += 1
            # torch's schedulers (the engine's, or one the script steps itself: Accelerate's loop) warn unless the
            # optimizer stepped first: the engine's update was that step
            self.optimizer._opt_called = True  # (torch's schedulers' private flag)
            # (a framework that steps the scheduler itself sets `engine.lr_scheduler = None`, as for DeepSpeed's)
            if self.client_scheduler is not None and self.lr_scheduler is not None:
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

    # ------------------------------------------------------------------------------------------------ checkpoints
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

    def __repr__(self) -> str:
        c = self.config
        return (
            f"fzero.Engine(ZeRO-{c.stage}, {c.precision}, {self.mesh!r}, micro batch {c.micro_batch}, "
            f"accumulate {c.gas}, {self.state.layout.real_numel:,} parameters)"
        )

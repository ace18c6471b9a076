"""The pure training step: `state, metrics = step(state, batch)`.

One step, on every rank:

1. compute parameters: `state.compute`, or (stage 3) the all-gather of the master shards, one unit at a time;
2. `loss, grads` of `loss_fn` on this rank's batch, the parameters presented to `loss_fn` as named views of one
   flat buffer, so the gradient arrives as one flat buffer too. The step's tensors stay bound into the model for
   the forward *and* the backward (`fzero.sharding.bind`), so an activation-checkpoint recompute sees them, and the
   forward draws its randomness (dropout) from the state's stream (`fzero.state.rng`). Collectives stay outside the
   differentiation (`torch.func` cannot differentiate through them). Two interchangeable engines compute it,
   bitwise equal: `autodiff="autograd"` (default: a backward on a fresh leaf, still pure) and `autodiff="func"`
   (`torch.func.grad`, 5-10% slower per step on the small GPT of `benchmarks/step_overhead.py`, and without
   activation checkpointing, which torch.func rejects);
3. the transform chain: accumulate, reduce, update, gather, as the preset or the user composed it.

Example:
    >>> import torch, fzero
    >>> model = torch.nn.Linear(4, 2)
    >>> def loss_fn(params, batch):
    ...     out = fzero.call(model, params, batch["x"])  # torch.func.functional_call, without its swaps in a step
    ...     return torch.nn.functional.mse_loss(out, batch["y"])
    >>> mesh = fzero.SimMesh(world=2)
    >>> tx = fzero.zero2(fzero.adamw(1e-2))
    >>> state = fzero.init(model, tx, mesh)
    >>> step = fzero.train_step(model, loss_fn, tx, mesh)
    >>> batch = {"x": torch.randn(2, 8, 4), "y": torch.randn(2, 8, 2)}   # [world, per-rank batch, ...]
    >>> state, metrics = step(state, batch)
    >>> sorted(model.load_state_dict(fzero.state_dict(state)).missing_keys)
    []
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from ..layout import ROOT_UNIT, Layout, from_module, unflatten, unshard
from ..layout.units import concentrated
from ..mesh import Mesh
from ..mesh.ranks import check_batch, ranks_of, stacks
from ..sharding.bind import bound
from ..sharding.compile import compile_units
from ..sharding.construct import (
    external_parameters,
    partitioned,
    partitioned_parameters,
    replicated_parameters,
    shapes_shown,
    sharded_parameters,
)
from ..sharding.units import Abandoned, GatherPolicy, frozen_shard, sharded_backward
from ..state import TrainState, count, rng
from ..storage import in_memory
from ..transforms import Context, Flow, Transform, apply_init, gather_params, plan_of, shard_params, unit_reducer
from ..transforms.collective import sharding_world
from ..transforms.planning import shards, spill_of
from .microstep import MicroStep, compute_params, frozen_params, named_tensors, scaled

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a mesh (fzero.SimMesh or fzero.DistMesh), got {type(mesh).__name__}")


def init(
    model: nn.Module,
    tx: Transform,
    mesh: Mesh,
    *,
    units: Any = None,
    align: int = 16,
    initializer: Callable[[nn.Module], None] | None = None,
    seed: int | None = None,
    release: bool = False,
) -> TrainState:
    """The initial `TrainState` of `model` under `tx` on `mesh`.

    The state holds copies: the model's own tensors are never referenced, and training never changes the model
    (load `fzero.state_dict(state)` into it when you want its parameters). So the model's own parameters are a
    second copy the steps never read: `model.to("meta")` after `init` frees them (the steps, `eval_step` and
    `fzero.state_dict` work from the state's), or build the model on `meta` to begin with. On `DistMesh`, rank 0's
    values are broadcast so all ranks start equal (parameters and buffers). On the way, besides the model, `init`
    holds this rank's shard and one unit's flat buffer under a chain that shards (stages 1-3: the shard is made unit
    by unit, `fzero.sharding.construct.partitioned_parameters`), one full flat copy under one that does not (stage
    0), or the state itself where that is larger. Under the NVMe tier (`Offload("nvme")`: `Does.spill`) the shard is
    built in a file under its directory, each unit's pages dropped once written (`fzero.storage.Spill`), and the
    store takes it from there chunk by chunk: init holds one unit and the store's staging buffers, not the shard.

    Args:
      model: the module; its trainable parameters must share one floating dtype (and so must its frozen ones). On
        the `meta` device (e.g. built under `with torch.device("meta"):`) it is constructed sharded, unit by unit,
        with `initializer`: the full model never exists on a rank (stages 1-3). Built under DeepSpeed's
        `zero.Init` (`fzero.deepspeed.zero.Init`: each parameter's values in a per-parameter partition), it is
        constructed from the partitions one unit at a time, likewise (`fzero.sharding.construct`); the model is
        left as it is. A parameter registered with `register_external_parameter` for a module outside its unit
        goes to the root unit (gathered through the step).
      tx: the transform (e.g. `fzero.zero2(fzero.adamw(3e-4))`).
      mesh: `SimMesh(world=W)` or `DistMesh()`.
      units: how parameters group into units (`fzero.layout.units`). Default `fzero.layout.Auto()`: each child of
        an `nn.ModuleList` and each untied module outside it of 100,000 elements or more (an embedding, a head), or,
        where that would leave one unit holding most of the model, module by module (every module of 100,000
        elements or more). E.g. `fzero.layout.BySize(n)`, `"module_list"`, a callable.
      align: padding quantum per rank, in elements.
      initializer: for a `meta` model: run on every module, children first, as `model.apply(initializer)` would
        (e.g. a Hugging Face model's `_init_weights`); see `fzero.sharding.construct.sharded_parameters`.
      seed: the step's random stream (`fzero.state.rng`); default `torch.initial_seed()` (rank 0's).
      release: under a chain that shards, empty each of the model's parameters (and drop its `zero.Init`
        partition) once its unit is in the state, as `fully_shard` and DeepSpeed's stage 3 release them (what
        `fzero.initialize` does): the model and the state are never both whole in memory. The model is unusable
        for its own forward afterwards (its buffers stay); read the parameters back with `fzero.state_dict`.
    """
    _check_mesh(mesh)
    if not isinstance(tx, Transform):
        raise TypeError(f"tx must be an fzero Transform (e.g. fzero.zero2(...)), got {type(tx).__name__}")
    axis = tx.axis  # the chain's sharding axis (hybrid sharding; docs/hybrid.md), None: every rank
    built = partitioned(model)  # built under zero.Init: the values are in per-parameter partitions
    layout = _layout(model, sharding_world(mesh, axis), align, units, built)
    layout = layout if axis is None else layout.on_axis(axis)
    frozen_layout = layout.frozen_layout
    meta = any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers())
    # a model in memory under a sharding chain: its shard made unit by unit too (no full flat copy at init's peak)
    in_units = built or (not meta and shards(tx))
    spill = spill_of(tx)  # the NVMe tier writes the shard to disk at init: built in a file there, not in memory
    if in_units:
        params, frozen, buffers = partitioned_parameters(model, layout, mesh, spill=spill, release=release)
    elif meta:
        params, frozen, buffers = sharded_parameters(model, layout, mesh, initializer, spill=spill)
    else:
        params, frozen, buffers = replicated_parameters(model, layout, mesh)
    presharded = meta or in_units
    start = [Flow(None, params, None)]
    del params  # the chain holds the only reference: a sharding chain frees the full buffer before its state is made
    stream = _seed(mesh, seed)
    with torch.no_grad():
        flow, tx_state = apply_init(tx, start.pop(), Context(mesh, layout, presharded=presharded, seed=int(stream)))
    if presharded and not flow.sharded:
        what = "a model built under zero.Init" if built else "a meta-device model"
        raise ValueError(f"init: {what} can only be constructed sharded under a chain with reduce_scatter() "
                         "(zero1, zero2, zero3; DeepSpeed's zero.Init is for ZeRO stage 3)")  # fmt: skip
    compute_dtype = flow.compute.dtype if flow.compute is not None else flow.params.dtype
    plan = plan_of(tx, sharded=flow.sharded, world=layout.world, stacked=stacks(mesh), compute_dtype=compute_dtype)
    if frozen is not None:
        assert frozen_layout is not None  # (frozen parameters have one)
        frozen = _frozen_at_rest(mesh, frozen_layout, frozen, plan.sharded_at_rest, presharded)
    if plan.sharded_at_rest and plan.gather == "lazy":  # stage 3
        unit_reducer(tx)  # it reduces unit by unit with the chain's reduction: say now if it cannot
        _warn_single_unit(layout)
    cdtype = flow.compute.dtype if flow.compute is not None else None
    cast = cdtype is not None and cdtype != layout.torch_dtype
    frozen_dtype = cdtype if cast and frozen_layout is not None and frozen_layout.torch_dtype != cdtype else None
    return TrainState(
        count(0), flow.params, flow.compute, tx_state, frozen, buffers, stream, layout, frozen_dtype, plan
    )


def _layout(model: nn.Module, world: int, align: int, units: Any, built: bool) -> Layout:
    """The model's layout; a parameter registered as used in the forward of a module outside its unit
    (`register_external_parameter`) goes to the root unit, which stays gathered through the step."""
    external = external_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}  # (the parameters themselves, not shapes_shown's twins)
    with shapes_shown(model) if built else contextlib.nullcontext():
        layout = from_module(model, world=world, align=align, units=units)
        unit_of = {leaf.name: lay.units[leaf.unit].name for lay in (layout, layout.frozen_layout) if lay is not None
                   for leaf in lay.leaves}  # fmt: skip
        moved = set()
        for path, p in external:
            name = names.get(id(p))
            unit = unit_of.get(name or "", ROOT_UNIT)
            if name is not None and unit != ROOT_UNIT and path != unit and not path.startswith(unit + "."):
                moved.add(name)
        if not moved:
            return layout
        return from_module(model, world=world, align=align,
                           units=lambda n: ROOT_UNIT if n in moved else unit_of[n])  # fmt: skip


def _seed(mesh: Mesh, seed: int | None) -> Tensor:
    """The state's random stream: `seed` (default `torch.initial_seed()`), folded, rank 0's on every rank."""
    start = torch.initial_seed() if seed is None else seed
    if not isinstance(start, int) or isinstance(start, bool):
        raise TypeError(f"init: seed must be an int, got {type(start).__name__}")
    return mesh.unreplicate(mesh.broadcast(mesh.replicate(torch.tensor(rng.fold(start), dtype=torch.int64)), 0))


def _frozen_at_rest(mesh: Mesh, frozen_layout: Layout, frozen: Tensor, sharded: bool, presharded: bool) -> Tensor:
    """The frozen buffer as the stage keeps it: this rank's shard where compute parameters are sharded at rest,
    else full (`frozen` is full, or a shard when constructed sharded from `meta`)."""
    full = not presharded or frozen_layout.world == 1
    if sharded and full and frozen_layout.world > 1:
        return shard_params(mesh, frozen_layout, frozen, frozen_layout.axis)
    if not sharded and not full:
        return gather_params(mesh, frozen_layout, frozen)
    return frozen


def _warn_single_unit(layout: Layout) -> None:
    """Stage 3 saves memory only when no unit holds most of the model: say so when one does (the rule
    `fzero.layout.Auto` splits by: models of 2**20 elements or more)."""
    sizes = {u.name: u.numel for u in layout.units}
    if layout.frozen_layout is not None:
        sizes = {name: n + u.numel for (name, n), u in zip(sizes.items(), layout.frozen_layout.units, strict=True)}
    biggest = concentrated(sizes)
    if biggest is not None:
        share = sizes[biggest] / sum(sizes.values())
        warnings.warn(
            f"stage 3: unit {biggest!r} holds {share:.0%} of the parameters, so "
            "gathering one unit at a time saves little memory; split the model into more units, e.g. "
            "fzero.init(..., units=fzero.layout.BySize(n)) with n under that unit's largest module, or a callable "
            "naming each parameter's unit",
            stacklevel=3,
        )


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.ndim != 0:
        raise ValueError(
            f"loss_fn must return a scalar (0-d) tensor, got shape {tuple(loss.shape)}: reduce it, e.g. .mean()"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point scalar, got dtype {loss.dtype}")


def _check_state(state: Any, mesh: Mesh) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"step expects a TrainState (from fzero.init), got {type(state).__name__}")
    axis = state.layout.axis
    if axis is None and state.layout.world != mesh.world:
        raise ValueError(f"the state was built for world {state.layout.world}, but the mesh has world {mesh.world}")
    if axis is not None and (axis not in getattr(mesh, "axes", ()) or state.layout.world != mesh.size(axis)):
        raise ValueError(f"the state was sharded over {state.layout.world} ranks of mesh axis {axis!r}, but the mesh "
                         f"is {mesh!r}")  # fmt: skip


def rank_seeds(state: TrainState, mesh: Mesh, *tags: int) -> Tensor:
    """Each rank's seed for the state's current micro-step (`fzero.state.rng`), per rank (int64)."""
    base, step, ranks = int(state.seed), int(state.step), ranks_of(mesh)
    return ranks.stack([torch.tensor(rng.fold(base, step, r, *tags), dtype=torch.int64) for r in ranks.indices])


def train_step(
    model: nn.Module,
    loss_fn: Callable[..., Any],
    tx: Transform,
    mesh: Mesh,
    *,
    has_aux: bool = False,
    donate: bool = False,
    autodiff: str = "autograd",
    gather: GatherPolicy | None = None,
    compile: bool | dict[str, Any] = False,
) -> StepFn:
    """Build the pure step `step(state, batch) -> (state, metrics)`.

    Args:
      model: the module whose `init` state is trained (used by `loss_fn` through `fzero.call` or
        `functional_call`).
      loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`); `params` maps every parameter
        and buffer name to a tensor, ready for `fzero.call(model, params, ...)` or `torch.func.functional_call(model,
        params, ...)` (the same result; `fzero.call` skips swapping in the tensors the step has already bound into
        the model). It must return the mean loss of this rank's batch: ranks' gradients are averaged.
      tx: the transform `init` was called with.
      mesh: the mesh `init` was called with.
      has_aux: `loss_fn` returns `(loss, aux)`; `aux` (a pytree of tensors) appears in the metrics.
      donate: let the step overwrite the input state's buffers in place (faster, less memory); the input state
        must not be used afterwards.
      autodiff: `"autograd"` or `"func"`: how gradients are computed (same values, bitwise; see above).
      gather: for states whose compute parameters are sharded at rest (stage 3): prefetch and persistence of the
        unit-at-a-time gathering (`fzero.GatherPolicy`); the default prefetches one unit. With
        `autodiff="func"` stage 3 gathers all units at the step's start instead (torch.func cannot differentiate
        through the per-unit collectives).
      compile: compile the model unit by unit at the first step (`fzero.sharding.compile`: each unit module's
        forward and its backward, the gathers and reductions outside the graphs), with `torch.compile`'s default
        options (True) or these keyword arguments (a dict: `backend`, `mode`, `fullgraph`, `dynamic`, `options`).
        With `autodiff="autograd"` only.

    Returns:
      `step(state, batch)`. On a `SimMesh` every batch leaf has a leading world axis. The metrics hold `loss` (mean
      over ranks), `applied` (whether the optimizer ran: False on micro-steps that accumulate and on skipped
      steps), `skipped` (a non-finite step skipped on every rank), `loss_scale` (the scale this step used),
      `grad_norm` (unscaled global norm, where the chain computed it), `gathered_peak` (the most parameter
      elements gathered at once on a rank), `comm` (the ledger: elements per collective) and `aux`.
    """
    _check_step_args(mesh, loss_fn, tx, autodiff)
    run = _Forward(model, loss_fn, has_aux)
    policy = (gather or GatherPolicy()).on(mesh)
    options = _compile_options(compile, autodiff)
    compiled: list[bool] = []  # (once: the layout is the model's)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        _check_state(state, mesh)
        check_batch(mesh, batch)
        if options is not None and not compiled:
            compile_units(model, state.layout, options)
            compiled.append(True)
        micro = MicroStep(state, tx, mesh, policy, autodiff)
        out: tuple[Any, ...]  # (grads, loss, aux, buffers, info)
        failure, out = None, (None, None, None, None, {})
        try:
            with record_function("fzero.forward_backward"):
                if micro.per_unit:  # reduce each unit as it completes
                    out = _unit_gradients(run, state, batch, mesh, policy, micro)
                else:
                    out = _whole_gradients(run, state, batch, mesh, autodiff)
        except Abandoned as e:  # this rank failed; the step's collectives were completed: the ranks still agree
            failure = e.error
        except BaseException:
            micro.abandon()
            raise
        grads, loss, aux, buffers, info = out
        new, metrics = micro.close(grads, loss, reduced=info.pop("reduced", False), buffers=buffers,
                                   gathered=info.pop("gathered", None), donate=donate, failure=failure)  # fmt: skip
        metrics.update(info)
        if has_aux:
            metrics["aux"] = aux
        return new, metrics

    return step


def keeps_gathered(state: TrainState) -> bool:
    """Whether the chain keeps lazily gathered units through the backward and an accumulation window (stages 1-2:
    `gather(lazy=True, keep=True)`): `state.plan.keep_gathered`."""
    return state.plan.keep_gathered


def _compile_options(compile: Any, autodiff: str) -> dict[str, Any] | None:
    """`train_step`'s `compile` argument as `torch.compile` keyword arguments, or None (eager)."""
    if compile is False or compile is None:
        return None
    if autodiff != "autograd":
        raise ValueError("train_step(compile=...) needs autodiff='autograd' (torch.func.grad over compiled units is "
                         "not supported)")  # fmt: skip
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise TypeError(f"compile must be a bool or a dict of torch.compile keyword arguments, got {compile!r}")
    return dict(compile)


def _check_step_args(mesh: Any, loss_fn: Any, tx: Any, autodiff: Any) -> None:
    _check_mesh(mesh)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(tx, Transform):
        raise TypeError(f"tx must be an fzero Transform, got {type(tx).__name__}")
    if autodiff not in ("autograd", "func"):
        raise ValueError(f"autodiff must be 'autograd' or 'func', got {autodiff!r}")


class _Forward:
    """`loss_fn` on named tensors bound into the model, with its checks and the loss scale."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any], has_aux: bool) -> None:
        self.model, self.loss_fn, self.has_aux = model, loss_fn, has_aux

    def loss(self, state: TrainState, named: dict[str, Tensor], batch: Any) -> tuple[Tensor, Tensor, Any]:
        """The scaled loss to differentiate, the detached loss, and `aux`."""
        out = self.loss_fn(named, batch)
        loss, aux = out if self.has_aux else (out, None)
        _check_loss(loss)
        return scaled(state, loss), loss.detach(), aux

    def backward(self, state: TrainState, named: dict[str, Tensor], batch: Any, seed: Tensor) -> tuple[Tensor, Any]:
        """Forward and backward with `named` bound into the model and the rank's random stream; the loss and aux.

        `backward()` rather than `autograd.grad`: reentrant activation checkpointing refuses the latter."""
        with rng.stream(int(seed)), bound(self.model, named), torch.enable_grad():
            scaled, loss, aux = self.loss(state, named, batch)
            if not scaled.requires_grad:
                raise ValueError(
                    "loss_fn's loss does not depend on the parameters it was given (computed under torch.no_grad(), "
                    "detached, or not from the params argument?)"
                )
            scaled.backward()
        return loss, aux


def _whole_gradients(run: _Forward, state: TrainState, batch: Any, mesh: Mesh, autodiff: str) -> tuple:
    """Gradients with every parameter gathered at once (stages 0-2, and stage 3 under `autodiff="func"`)."""
    layout = state.layout

    def local(compute: Tensor, frozen: Tensor | None, buffers: dict, batch: Any, seed: Tensor):
        buffers = {k: v.clone() for k, v in buffers.items()}  # the forward may update them in place
        if autodiff == "func":
            grads, (loss, aux) = _func_grads(run, state, compute, frozen, buffers, batch, seed)
        else:
            leaf = compute.detach().requires_grad_()
            loss, aux = run.backward(state, named_tensors(layout, leaf, frozen, buffers), batch, seed)
            grads = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        return grads, loss, aux, buffers

    compute, frozen = compute_params(state, mesh), frozen_params(state, mesh)
    try:
        grads, loss, aux, buffers = mesh.map(local, compute, frozen, state.buffers, batch, rank_seeds(state, mesh))
    except Exception as e:
        if len(mesh.local_ranks) == mesh.world:  # one process runs every rank: nothing to complete
            raise
        raise Abandoned(e) from e  # a local forward and backward: no collective of the step is left to pair
    frozen_layout = layout.frozen_layout
    peak = layout.numel + (frozen_layout.numel if frozen is not None and frozen_layout is not None else 0)
    return grads, loss, aux, buffers, {"reduced": False, "gathered_peak": peak, "gathered": compute}


def _func_grads(run: _Forward, state, compute, frozen, buffers, batch, seed) -> tuple[Tensor, Any]:
    def f(flat: Tensor, buffers: dict):  # buffers are an input: torch.func forbids mutating captured tensors
        named = named_tensors(state.layout, flat, frozen, buffers)
        with bound(run.model, named):
            scaled, loss, aux = run.loss(state, named, batch)
        return scaled, (loss, aux) if run.has_aux else (loss,)  # torch.func's aux: tensors only, no None

    try:
        with rng.stream(int(seed)):
            grads, out = torch.func.grad(f, has_aux=True)(compute, buffers)
    except RuntimeError as e:
        hf_checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in run.model.modules())
        if "saved tensor hooks" in str(e) or hf_checkpointing:
            raise ValueError(
                "autodiff='func' cannot differentiate a model with activation checkpointing (torch.func rejects "
                "saved-tensor hooks): use autodiff='autograd', the default"
            ) from e
        raise
    return grads, (out if run.has_aux else (out[0], None))


def _unit_gradients(run: _Forward, state: TrainState, batch: Any, mesh: Mesh, policy: GatherPolicy,
                    micro: MicroStep) -> tuple:  # fmt: skip
    """Gradients with one unit gathered at a time (stage 3), reduced unit by unit during the backward by the
    chain's own reduction (`MicroStep.reducer`)."""
    ranks, seeds = ranks_of(mesh), rank_seeds(state, mesh)

    def rank_run(params: dict[str, Tensor], rank: int):
        buffers = {k: v.clone() for k, v in ranks.pick(state.buffers, rank).items()}
        loss, aux = run.backward(state, {**params, **buffers}, ranks.pick(batch, rank), ranks.pick(seeds, rank))
        return loss, aux, buffers

    frozen = frozen_shard(state.frozen, state.frozen_dtype)  # cast once: gathers then move the compute dtype
    compute = state.compute if state.compute is not None else state.params
    grads, outs, info = sharded_backward(
        mesh, state.layout, run.model, (compute, frozen), policy, micro.reducer(), rank_run,
        state.plan.keep_gathered, state.plan.gather_spec,
    )  # fmt: skip
    loss, aux, buffers = (ranks.stack([o[k] for o in outs]) for k in range(3))
    return grads, loss, aux, buffers, {"reduced": True, **info}


def eval_step(model: nn.Module, fn: Callable[..., Any], mesh: Mesh, *, gather: GatherPolicy | None = None):
    """Build `evaluate(state, batch) -> outputs`: `fn(params, batch)` under `torch.no_grad()` with the state's
    compute parameters, on every rank; nothing is updated (buffers a train-mode forward changes are discarded).

    Stage 3 gathers one unit at a time and frees each right after its module ran. On a `SimMesh` each batch leaf
    has a leading world axis and so does every output (stacked ranks); `fn` returns a pytree of tensors.

    Example:
        >>> import torch, fzero
        >>> model = torch.nn.Linear(4, 2)
        >>> mesh = fzero.SimMesh(world=2)
        >>> state = fzero.init(model, fzero.zero3(fzero.adamw()), mesh)
        >>> evaluate = fzero.eval_step(model, lambda p, b: fzero.call(model, p, b), mesh)
        >>> evaluate(state, torch.randn(2, 3, 4)).shape
        torch.Size([2, 3, 2])
    """
    _check_mesh(mesh)
    policy = gather or GatherPolicy()
    ranks = ranks_of(mesh)

    def evaluate(state: TrainState, batch: Any) -> Any:
        _check_state(state, mesh)
        check_batch(mesh, batch)
        seeds = rank_seeds(state, mesh, 1)

        def rank_run(params: dict[str, Tensor], rank: int) -> Any:
            named = {**params, **{k: v.clone() for k, v in ranks.pick(state.buffers, rank).items()}}
            with torch.no_grad(), rng.stream(int(ranks.pick(seeds, rank))), bound(model, named):
                return fn(named, ranks.pick(batch, rank))

        if state.sharded_at_rest:
            compute = state.compute if state.compute is not None else state.params
            shards = (compute, frozen_shard(state.frozen, state.frozen_dtype))
            outs = sharded_backward(
                mesh, state.layout, model, shards, policy, None, rank_run, gather_spec=state.plan.gather_spec
            )[1]
            return ranks.stack(outs)
        compute, frozen = compute_params(state, mesh), frozen_params(state, mesh)
        outs = []
        for rank in ranks.indices:
            named = named_tensors(state.layout, ranks.pick(compute, rank), ranks.pick(frozen, rank), {})
            outs.append(rank_run(named, rank))
        return ranks.stack(outs)

    return evaluate


def state_dict(state: TrainState, mesh: Mesh | None = None) -> dict[str, Tensor]:
    """The consolidated parameters (master dtype), frozen parameters (their own dtype) and persistent buffers, by
    name: exactly the keys of the model's `state_dict()` (tied parameters under every name), what
    `model.load_state_dict(..., strict=True)` and `save_pretrained` expect.

    Args:
      state: a `TrainState`.
      mesh: needed for a `DistMesh` state with sharded parameters (it all-gathers them: call it on every rank).
    """
    layout, plan = state.layout, state.plan
    first = (lambda t: t[0]) if state.simulated else (lambda t: t)
    tensors = {}
    params = in_memory(state.params)
    spaces = ((layout, params, plan.sharded and layout.world > 1), (layout.frozen_layout, state.frozen,
              plan.sharded_at_rest))  # fmt: skip
    for lay, flat, sharded in spaces:
        if flat is None:
            continue
        assert lay is not None  # (a buffer has its layout)
        if not sharded:
            full = first(flat)
        elif state.simulated:  # (hybrid: the first shard group's rows, the sharding axis being innermost)
            full = unshard(lay, flat if lay.axis is None else flat[: lay.world])
        elif mesh is None:
            raise ValueError("state_dict of a sharded DistMesh state needs the mesh: fzero.state_dict(state, mesh)")
        else:
            full = gather_params(mesh, lay, flat)
        tensors.update({k: v.clone() for k, v in unflatten(lay, full).items()})
    for alias, name in layout.aliases:
        tensors[alias] = tensors[name]
    persistent = {s.name for s in layout.buffers if s.persistent}
    tensors.update({k: first(v).clone() for k, v in state.buffers.items() if k in persistent})
    return tensors

"""The pure training step: `state, metrics = step(state, batch)`.

One step, on every rank:

1. compute parameters: `state.compute`, or (stage 3) the all-gather of the master shards;
2. `loss, grads` of `loss_fn` on this rank's batch, the parameters presented to `loss_fn` as named views of one
   flat buffer, so the gradient arrives as one flat buffer too. Collectives stay outside the differentiation
   (`torch.func` cannot differentiate through them). Two interchangeable engines compute it, bitwise equal:
   `autodiff="autograd"` (default: `torch.autograd.grad` on a fresh leaf, still pure) and `autodiff="func"`
   (`torch.func.grad`, 5-10% slower per step on the small GPT of `benchmarks/step_overhead.py`);
3. the transform chain: accumulate, reduce, update, gather, as the preset or the user composed it.

Example:
    >>> import torch, fzero
    >>> model = torch.nn.Linear(4, 2)
    >>> def loss_fn(params, batch):
    ...     out = torch.func.functional_call(model, params, (batch["x"],))
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

import math
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor, nn

from .construct import sharded_parameters
from .layout import flatten, from_module, unflatten, unshard
from .mesh import Mesh, SimMesh
from .stage3 import GatherPolicy, sharded_backward
from .state import TrainState, count
from .transforms import Context, Flow, Transform, gather_params

__all__ = ["StepFn", "apply_gradients", "compute_params", "init", "state_dict", "train_step"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a mesh (fzero.SimMesh or fzero.DistMesh), got {type(mesh).__name__}")


def init(
    model: nn.Module,
    tx: Transform,
    mesh: Mesh,
    *,
    units: str | Callable[[str], str] | None = None,
    align: int = 16,
    initializer: Callable[[nn.Module], None] | None = None,
) -> TrainState:
    """The initial `TrainState` of `model` under `tx` on `mesh`.

    The state holds copies: the model's own tensors are never referenced, and training never changes the model
    (load `fzero.state_dict(state)` into it when you want its parameters). On `DistMesh`, rank 0's values are
    broadcast so all ranks start equal.

    Args:
      model: the module; its trainable parameters must share one floating dtype. On the `meta` device (e.g. built
        under `with torch.device("meta"):`) it is constructed sharded, unit by unit, with `initializer`: the full
        model never exists on a rank (stages 1-3).
      tx: the transform (e.g. `fzero.zero2(fzero.adamw(3e-4))`).
      mesh: `SimMesh(world=W)` or `DistMesh()`.
      units: how parameters group into units (see `fzero.layout.from_module`).
      align: padding quantum per rank, in elements.
      initializer: for a `meta` model: `initializer(module)` initialises, in place, the parameters and buffers a
        module owns directly (see `fzero.construct.sharded_parameters`).
    """
    _check_mesh(mesh)
    if not isinstance(tx, Transform):
        raise TypeError(f"tx must be an fzero Transform (e.g. fzero.zero2(...)), got {type(tx).__name__}")
    layout = from_module(model, world=mesh.world, align=align, units=units)
    named = dict(model.named_parameters())
    meta = any(p.is_meta for p in named.values()) or any(b.is_meta for b in model.buffers())
    if meta:
        if initializer is None:
            raise ValueError(
                "init: the model is on the meta device; pass initializer=fn, where fn(module) initialises the "
                "parameters a module owns (e.g. lambda m: m.reset_parameters() if hasattr(m, 'reset_parameters') "
                "else None), to construct it sharded"
            )
        shard, frozen, buffers = sharded_parameters(model, layout, mesh, initializer)
        flow = Flow(None, shard, None, {}, presharded=True)
    else:
        with torch.no_grad():
            trainable = {leaf.name: named[leaf.name] for leaf in layout.leaves}
            flat = mesh.broadcast(mesh.replicate(flatten(layout, trainable)), src=0)
            frozen = {s.name: mesh.replicate(named[s.name].detach().clone()) for s in layout.frozen}
            module_buffers = dict(model.named_buffers())
            buffers = {s.name: mesh.replicate(module_buffers[s.name].detach().clone()) for s in layout.buffers}
        flow = Flow(None, flat, flat, {})
    with torch.no_grad():
        flow, tx_state = tx.init(flow, Context(mesh, layout))
    if flow.presharded:
        raise ValueError("init: a meta-device model can only be constructed sharded under a chain with "
                         "reduce_scatter() (zero1, zero2, zero3)")  # fmt: skip
    return TrainState(
        count(0), flow.params, flow.compute, tx_state, flow.loss_scale, frozen, buffers, layout, flow.reduce_dtype
    )


def _check_batch(batch: Any, mesh: Mesh) -> None:
    if not isinstance(mesh, SimMesh):
        return
    for path, leaf in zip(*optree.tree_flatten_with_path(batch)[:2], strict=False):
        where = "batch" + "".join(f"[{p!r}]" for p in path)
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{where} is a {type(leaf).__name__}; on a SimMesh every batch leaf must be a tensor")
        if leaf.ndim == 0 or leaf.shape[0] != mesh.world:
            raise ValueError(
                f"{where} has shape {tuple(leaf.shape)}, but {mesh!r} needs a leading world axis of "
                f"{mesh.world}: shape [{mesh.world}, per-rank batch, ...]"
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
) -> StepFn:
    """Build the pure step `step(state, batch) -> (state, metrics)`.

    Args:
      model: the module whose `init` state is trained (used by `loss_fn` through `functional_call`).
      loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux`); `params` maps every parameter
        and buffer name to a tensor, ready for `torch.func.functional_call(model, params, ...)`. It must return the
        mean loss of this rank's batch: ranks' gradients are averaged.
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

    Returns:
      `step(state, batch)`. On a `SimMesh` every batch leaf has a leading world axis. The metrics hold `loss` (mean
      over ranks), `applied` (whether the optimizer ran: False on micro-steps that accumulate and on skipped
      steps), `skipped` (a non-finite step skipped on every rank), `loss_scale` (the scale this step used),
      `grad_norm` (unscaled global norm, where the chain computed it), `comm` (the ledger: elements per
      collective) and `aux`.
    """
    _check_mesh(mesh)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(tx, Transform):
        raise TypeError(f"tx must be an fzero Transform, got {type(tx).__name__}")
    if autodiff not in ("autograd", "func"):
        raise ValueError(f"autodiff must be 'autograd' or 'func', got {autodiff!r}")

    policy = gather or GatherPolicy()

    def evaluate(state: TrainState, params: dict[str, Tensor], batch: Any) -> tuple[Tensor, Tensor, Any]:
        """`loss_fn` on named tensors: the scaled loss to differentiate, the detached loss, and `aux`."""
        out = loss_fn(params, batch)
        loss, aux = out if has_aux else (out, None)
        _check_loss(loss)
        return _scaled(state, loss), loss.detach(), aux

    def _per_unit(state: TrainState, batch: Any):
        simulated = isinstance(mesh, SimMesh)

        def run(params: dict[str, Tensor], rank: int):
            pick = (lambda t: t[rank]) if simulated else (lambda t: t)
            frozen = {k: pick(v) for k, v in state.frozen.items()}
            buffers = {k: pick(v).clone() for k, v in state.buffers.items()}
            local_batch = optree.tree_map(pick, batch) if simulated else batch
            scaled, loss, aux = evaluate(state, {**params, **frozen, **buffers}, local_batch)
            return scaled, (loss, aux, buffers)

        return sharded_backward(mesh, state.layout, model, state.compute, policy, state.reduce_dtype, run)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise TypeError(f"step expects a TrainState (from fzero.init), got {type(state).__name__}")
        layout = state.layout
        if layout.world != mesh.world:
            raise ValueError(f"the state was built for world {layout.world}, but the mesh has world {mesh.world}")
        _check_batch(batch, mesh)

        def local(compute: Tensor, frozen: dict, buffers: dict, batch: Any):
            buffers = {k: v.clone() for k, v in buffers.items()}  # the forward may update them in place

            def f(flat: Tensor, buffers: dict):  # buffers are an input: torch.func forbids mutating captured tensors
                scaled, loss, aux = evaluate(state, {**unflatten(layout, flat), **frozen, **buffers}, batch)
                return scaled, ((loss, aux) if has_aux else loss)  # torch.func's aux: tensors only, no None

            if autodiff == "func":
                grads, out = torch.func.grad(f, has_aux=True)(compute, buffers)
            else:
                leaf = compute.detach().requires_grad_()
                with torch.enable_grad():
                    scaled, out = f(leaf, buffers)
                    (grads,) = torch.autograd.grad(scaled, leaf)
            loss, aux = out if has_aux else (out, None)
            return grads, loss, aux, buffers

        with mesh.record() as ledger:
            sharded = state.compute is not None and state.compute.shape[-1] != layout.numel
            if sharded and autodiff == "autograd":
                grads, outs, info = _per_unit(state, batch)
                loss = torch.stack([o[0] for o in outs]) if isinstance(mesh, SimMesh) else outs[0][0]
                aux = _stack(mesh, [o[1] for o in outs])
                buffers = _stack(mesh, [o[2] for o in outs])
                new, metrics = apply_gradients(
                    state.replace(buffers=buffers), grads, loss, tx, mesh, donate=donate, reduced=True
                )
                metrics.update(info)
            else:
                compute = compute_params(state, mesh)
                grads, loss, aux, buffers = mesh.map(local, compute, state.frozen, state.buffers, batch)
                new, metrics = apply_gradients(state.replace(buffers=buffers), grads, loss, tx, mesh, donate=donate)
                metrics["gathered_peak"] = layout.numel
        metrics["comm"] = ledger.as_dict()
        if has_aux:
            metrics["aux"] = aux
        return new, metrics

    return step


def _scale_of(state: TrainState) -> float:
    return 1.0 if state.loss_scale is None else state.loss_scale.loss_scale


def _scaled(state: TrainState, loss: Tensor) -> Tensor:
    """The loss the backward differentiates: times the loss scale (unscaled later, in `Flow.grad_factor`)."""
    return loss if state.loss_scale is None else state.loss_scale.scale(loss)


def _stack(mesh: Mesh, values: list[Any]) -> Any:
    """Per-rank values from each rank's value (a SimMesh stacks them on the world axis)."""
    if not isinstance(mesh, SimMesh):
        return values[0]
    return optree.tree_map(lambda *xs: torch.stack(xs), *values) if values[0] is not None else None


def compute_params(state: TrainState, mesh: Mesh) -> Tensor:
    """The full compute parameters per rank for the next forward: `state.compute`, all-gathered where the stage
    keeps them sharded at rest (the first half of a step; `apply_gradients` is the second)."""
    compute = state.compute
    if compute is None:  # a chain without gather(): the master parameters are the compute parameters
        compute = state.params
    if compute.shape[-1] != state.layout.numel:  # sharded at rest (stage 3)
        compute = gather_params(mesh, state.layout, compute)
    return compute


def apply_gradients(
    state: TrainState,
    grads: Tensor,
    loss: Tensor,
    tx: Transform,
    mesh: Mesh,
    *,
    donate: bool = False,
    reduced: bool = False,
) -> tuple[TrainState, dict[str, Any]]:
    """The second half of a step: run per-rank gradients through the transform chain.

    Args:
      state: the state the gradients were computed from (its `buffers` already the forward's updated ones).
      grads: per rank, the gradient of `loss * state.loss_scale` with respect to `compute_params(state, mesh)`.
      loss: per rank, the unscaled loss (reported as its mean over ranks).
      tx, mesh, donate: as for `train_step`.
      reduced: the gradients are already this rank's shard of the mean over ranks (stage 3's unit-by-unit
        reduction during the backward).

    Returns:
      The new state and the metrics (all of `train_step`'s but `comm` and `aux`).
    """
    layout = state.layout
    scale = _scale_of(state)
    flow = Flow(
        grads, state.params, state.compute, {}, reduced=reduced, grad_factor=1.0 / scale, loss_scale=state.loss_scale
    )
    flow, tx_state = tx.update(flow, state.tx_state, Context(mesh, layout, donate))
    loss = mesh.all_reduce(loss.detach().float(), "mean")
    new = state.replace(
        step=state.step + 1, params=flow.params, compute=flow.compute, tx_state=tx_state, loss_scale=flow.loss_scale
    )
    metrics: dict[str, Any] = {
        "loss": mesh.unreplicate(loss),
        "applied": not flow.deferred,
        "skipped": False,
        "loss_scale": scale,
    }
    if flow.stats is not None:
        metrics["grad_norm"] = math.sqrt(flow.stats.sumsq) / scale
    metrics.update(flow.metrics)
    return new, metrics


def state_dict(state: TrainState, mesh: Mesh | None = None) -> dict[str, Tensor]:
    """The consolidated parameters (master dtype), frozen parameters and buffers, by name: what
    `model.load_state_dict` accepts. Tied parameters appear under every name.

    Args:
      state: a `TrainState`.
      mesh: needed for a `DistMesh` state with sharded parameters (it all-gathers them: call it on every rank).
    """
    layout = state.layout
    params = state.params
    full_form = params.shape[-1] == layout.numel
    if state.simulated:
        full = params[0] if full_form else unshard(layout, params)
        first = lambda t: t[0]  # noqa: E731
    else:
        if not full_form and layout.world > 1:
            if mesh is None:
                raise ValueError("state_dict of a sharded DistMesh state needs the mesh: fzero.state_dict(state, mesh)")
            full = gather_params(mesh, layout, params)
        else:
            full = params
        first = lambda t: t  # noqa: E731
    out: dict[str, Tensor] = {k: v.clone() for k, v in unflatten(layout, full).items()}
    out.update({k: first(v).clone() for k, v in state.frozen.items()})
    out.update({k: first(v).clone() for k, v in state.buffers.items()})
    return out

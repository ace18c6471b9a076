"""`fzero.initialize`'s arguments and config resolved, once, into a `Setup`, which `fzero.engine.build` builds.

Resolving validates the config for the mesh's world, checks the param groups against the model and the optimizer,
and creates only what the arguments ask to be created (the mesh, a client optimizer or scheduler given as a callable,
MuP's optimizer); it leaves the model as it is. Building then does what the `Setup` says, and asks nothing more of
the arguments.

The mesh: under `torchrun` (or with a process group already initialised) a `DistMesh` over the world group, created
from the environment if needed (of shape `{"replicate": W // n, "shard": n}` where the config's ZeRO++ hpZ or MiCS
asks for groups of `n` ranks, or qgZ runs on several nodes of `n` ranks, the launcher's `LOCAL_WORLD_SIZE`:
`config_mesh`); in a plain single process a one-rank `SimMesh`: no process group, no
port, no global `torch.distributed` state left behind, and at world 1 every collective is the identity, so the
arithmetic is that of a `DistMesh` of one.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .. import optim
from ..config import Config, ConfigError, ConfigWarning, parse_config
from ..config.autocast import autocast_policy
from ..config.build import OptimizerSpec, build_policy, optimizer_kind, optimizer_spec, scheduled
from ..config.optimizers import OPTIMIZERS
from ..config.zeropp import zero_mesh_key, zero_mesh_shape
from ..host import accelerator
from ..mesh import DistMesh, Mesh, SimMesh
from ..mesh.ranks import regroup
from ..state.precision import Policy
from .client import WHAT, OptimizerView, client_spec, client_type, live, trainable_params
from .groups import parse_groups, split_options

__all__ = ["Setup", "config_mesh", "default_mesh", "resolve"]


@dataclass(frozen=True)
class Setup:
    """What `fzero.initialize` was asked for, resolved: everything `fzero.engine.build.build` needs.

    Attributes:
      model: the module to train (the engine owns its parameters once built).
      config: the validated config.
      mesh: the mesh to train on (of the shape the config asks for; its timeout set).
      device: the accelerator the model and the state go to.
      spec: the fzero optimizer to build, one entry per param group; its learning rates (and betas) are the
        config's schedules, or read from `param_groups` at every update where a client scheduler sets them there.
      optimizer: what `initialize` returns as the optimizer: an `OptimizerView`, or the client's optimizer.
      param_groups: the param-group dicts of `optimizer` that map to `spec`'s groups, in order.
      momentum: the param-group key `engine.get_mom()` reads ("momentum" or "betas").
      policy: the precision policy.
      round_to: the dtype the initial master weights are rounded through (DeepSpeed's master starts from the
        module cast to the compute dtype), or None.
      offload: whether the optimizer's state and master weights live on the CPU (its native kernel runs them).
      client_scheduler: the client's lr scheduler (the engine steps it after every applied update), or None.
      training_data, collate_fn: the data loader's dataset (None: no loader) and its `collate_fn`.
      printer: where the engine's console lines go.
      forward_only: no optimizer was configured or passed (`spec` is then `FORWARD_ONLY`, `optimizer` a view of
        it that `initialize` does not return): the engine runs forwards only (`forward_only_spec`).
    """

    model: nn.Module
    config: Config
    mesh: Mesh
    device: torch.device
    spec: OptimizerSpec
    optimizer: OptimizerView | torch.optim.Optimizer
    param_groups: tuple[dict[str, Any], ...]
    momentum: str
    policy: Policy
    round_to: torch.dtype | None
    offload: bool
    client_scheduler: Any
    training_data: Any
    collate_fn: Any
    printer: Any
    forward_only: bool = False


def resolve(
    model: nn.Module,
    config: Any,
    *,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    mesh: Mesh | None = None,
    training_data: Any = None,
    collate_fn: Any = None,
    printer: Any = print,
) -> Setup:
    """`fzero.initialize`'s arguments (see there for each) as a `Setup`.

    Args:
      model: the module to train.
      config: the DeepSpeed config: a dict or the path of a JSON file.

    Raises:
      ValueError, TypeError: a malformed argument.
      ConfigError: the config is invalid, or does not fit the arguments.
    """
    device = accelerator.device()
    cfg, mesh = _config_and_mesh(config, mesh)
    forward_only = optimizer is None and cfg["optimizer"] is None
    opt: OptimizerView | torch.optim.Optimizer
    if forward_only:
        spec, opt, groups, momentum = _forward_only(model, cfg, lr_scheduler)
        client_scheduler = None
    else:
        spec, opt, groups, momentum = _optimizer(model, cfg, optimizer, model_parameters)
        spec, client_scheduler = _schedule(cfg, spec, opt, groups, lr_scheduler)
    policy = autocast_policy(cfg, model, build_policy(cfg))  # (torch_autocast's reduce dtypes: fzero.config.autocast)
    round_to = None
    if cfg["fzero_precision"]["round_initial_master"] and cfg.precision != "fp32":
        round_to = cast(torch.dtype, policy.compute_dtype)  # (bf16 / fp16: set)
    return Setup(
        model, cfg, mesh, device, spec, opt, tuple(groups), momentum, policy, round_to, cfg.offload,
        client_scheduler, training_data, collate_fn, printer, forward_only,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------ mesh
def default_mesh() -> Mesh:
    """`DistMesh()` under torchrun or an initialised process group, else a one-rank `SimMesh`."""
    if dist.is_available() and (dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)):
        return DistMesh()
    return SimMesh(1)


def config_mesh(cfg: Config, mesh: Mesh, given: bool) -> Mesh:
    """The mesh the config trains on: `mesh`, or, where ZeRO++ hpZ, MiCS or qgZ on several nodes asks for a 2-D mesh
    (`fzero.config.zeropp.zero_mesh_shape`), a `DistMesh` of that shape over `mesh`'s group (its sub-groups made
    with `new_group`, on every rank alike).

    Args:
      cfg: the validated config, for `mesh.world` ranks.
      mesh: the default mesh, or the caller's.
      given: whether the caller passed `mesh` (`initialize(mesh=...)`): it is used as it is, and must then have the
        shape the config asks for.

    Raises:
      ConfigError: a given mesh's shape is not the config's, naming the key and both shapes.
    """
    shape = zero_mesh_shape(cfg)
    if shape is None:
        return mesh
    have = dict(getattr(mesh, "shape", None) or {})
    if given or len(mesh.local_ranks) == mesh.world:  # (a mesh of every rank has no process group to split)
        if list(have.items()) != list(shape.items()):
            key = zero_mesh_key(cfg)
            value = cfg["zero_optimization"][key]
            why = f"true on {shape['replicate']} nodes of {shape['shard']} ranks" if value is True else value
            raise ConfigError(
                f"zero_optimization.{key}",
                f"{why} asks for a mesh of shape {shape} on {mesh.world} ranks, but the mesh given has shape "
                f"{have or '1-D'}: {mesh!r}",
            )
        return mesh
    return regroup(mesh, shape)


def _config_and_mesh(source: Any, mesh: Mesh | None) -> tuple[Config, Mesh]:
    """The validated config, for the world of the mesh, and the mesh it trains on (its timeout set)."""
    given = mesh is not None
    mesh = mesh if mesh is not None else default_mesh()
    cfg = parse_config(source, world=mesh.world)
    mesh = config_mesh(cfg, mesh, given)  # ZeRO++ hpZ, MiCS and qgZ over nodes work on groups of ranks: a 2-D mesh
    timeout = cfg["comms_config"]["timeout"]
    if timeout is not None:
        mesh.set_timeout(timeout)
    return cfg, mesh


# ------------------------------------------------------------------------------------------------------- optimizer
def _optimizer(
    model: nn.Module, cfg: Config, optimizer: Any, model_parameters: Any
) -> tuple[OptimizerSpec, OptimizerView | torch.optim.Optimizer, list[dict[str, Any]], str]:
    """The optimizer to build (before any schedule), the object `initialize` returns as the optimizer, its param
    group dicts that map to fzero's groups (one per group with parameters), and the key `get_mom()` reads."""
    row = None if cfg["optimizer"] is None else OPTIMIZERS[cfg["optimizer"]["type"]]
    if optimizer is None and row is not None and row.mup:
        client = _mup_optimizer(model, cfg, model_parameters)
        spec, groups = _client(model, client)
        return spec, client, groups, row.momentum
    if optimizer is None:
        spec, view = _config_optimizer(model, cfg, model_parameters)  # (raises without an optimizer block)
        return spec, view, view.param_groups, OPTIMIZERS[cfg["optimizer"]["type"]].momentum
    if row is not None:
        warnings.warn(
            "a client optimizer was passed to initialize: the config's optimizer block is ignored (as in DeepSpeed)",
            ConfigWarning,
            stacklevel=4,
        )
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else trainable_params(model))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a callable returning one, got {type(optimizer).__name__}"
        )
    spec, groups = _client(model, optimizer)
    return spec, optimizer, groups, "betas"  # (DeepSpeed reads a client optimizer's momentum from its betas)


# A stateless optimizer (SGD without momentum keeps an empty buffer and a count) whose updates never run: a
# forward-only engine's state then holds no optimizer moments.
FORWARD_ONLY = OptimizerSpec(
    "sgd", 0.0, {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}, 0.0
)


def _forward_only(
    model: nn.Module, cfg: Config, lr_scheduler: Any
) -> tuple[OptimizerSpec, OptimizerView, list[dict[str, Any]], str]:
    """The setup of an engine built without an optimizer (DeepSpeed-Chat's reference, reward and EMA models): the
    stateless `FORWARD_ONLY` spec, and a view of it (learning rate 0) for the engine's own bookkeeping.

    DeepSpeed 0.19.8 accepts such an engine at stages 0 and 3 (runtime/engine.py:681-687: no optimizer, a bf16
    wrapper around a `DummyOptim`, or stage 3's `DeepSpeedZeRoOffload`) and asserts "zero stage {1, 2} requires an
    optimizer" at stages 1-2 (engine.py:2659); fzero builds it at every stage, since without updates stages 1-2
    hold the same full parameters as stage 0. A scheduler is refused: DeepSpeed silently builds none without an
    optimizer (engine.py:681), so the config's block or the client's scheduler would do nothing.

    Raises:
      ConfigError: the config has a `scheduler` block, or a client `lr_scheduler` was passed.
    """
    if cfg["scheduler"] is not None or lr_scheduler is not None:
        what = 'the config\'s "scheduler" block' if cfg["scheduler"] is not None else "lr_scheduler="
        raise ConfigError(
            "scheduler",
            f'{what} without an optimizer: an engine built without an optimizer (no "optimizer" block in the '
            "config and none passed to initialize) runs forwards only and has no learning rate to schedule; add an "
            '"optimizer" block (or pass optimizer=) to train, or drop the scheduler',
        )
    view = OptimizerView([{"params": trainable_params(model)}], {"lr": 0.0, **FORWARD_ONLY.hypers}, FORWARD_ONLY.kind)
    return FORWARD_ONLY, view, view.param_groups, "momentum"


def _client(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[OptimizerSpec, list[dict[str, Any]]]:
    """A client optimizer's fzero equivalent, and its param-group dicts that map to fzero's groups.

    Raises:
      UnsupportedConfigError: another optimizer class, or an option fzero does not implement.
      ValueError: the groups do not hold exactly the model's trainable parameters, once each (see
        `fzero.engine.groups`).
    """
    row = client_type(opt)  # (an optimizer fzero cannot run is refused before its groups are read)
    groups = parse_groups(model, opt.param_groups, WHAT)
    spec = client_spec(opt, row, groups)
    return spec, [cast("dict[str, Any]", group.source) for group in groups]


def _config_optimizer(model: nn.Module, cfg: Config, model_parameters: Any) -> tuple[OptimizerSpec, OptimizerView]:
    """The config's optimizer over `model_parameters` (its param groups mapped to `fzero.param_groups`), before any
    schedule, and the `OptimizerView`, one group per user group."""
    kind = optimizer_kind(cfg)
    if kind is None:
        raise ConfigError(
            "optimizer", 'no optimizer: add an "optimizer" block to the config or pass optimizer= to initialize'
        )
    view_groups: list[dict[str, Any]] = [{"params": trainable_params(model)}]
    pairs = None
    if model_parameters is not None:
        row, name = OPTIMIZERS[cfg["optimizer"]["type"]], cfg["optimizer"]["type"]
        spec = optimizer_spec(cfg, schedule=False)
        assert spec is not None  # (the config has an optimizer: checked above)
        defaults = spec.per_group()[0]
        pairs, view_groups = [], []
        for group in parse_groups(model, model_parameters, "model_parameters"):
            overrides, _ = split_options(group, row.group_keys, name, "model_parameters")
            try:  # the values, checked as the optimizer's constructor checks them, naming the group
                getattr(optim, kind)(**{**defaults, **row.group_hypers(overrides)})
            except (TypeError, ValueError) as e:
                raise type(e)(f"model_parameters[{group.index}]: {e}") from None
            pairs.append((group.names, overrides))
            view_groups.append({"params": group.params, **group.options})
    spec = optimizer_spec(cfg, pairs, schedule=False)  # split_options let through only the optimizer's own keys
    assert spec is not None
    return spec, OptimizerView(view_groups, {"lr": spec.lr, **spec.hypers}, spec.kind)


def _mup_optimizer(model: nn.Module, cfg: Config, model_parameters: Any) -> torch.optim.Optimizer:
    """What DeepSpeed builds for `MuAdam` / `MuAdamW` / `MuSGD`: the `mup` package's, on `model_parameters`, with the
    config's params: a torch Adam / AdamW / SGD whose groups scale each matrix's lr (and weight decay) by its width
    multiplier (`mup.set_base_shapes`), which fzero then runs as that client optimizer, bitwise torch's."""
    kind = cfg["optimizer"]["type"]
    try:
        import mup  # type: ignore[import-untyped]  # (an optional dependency without type information)
    except ImportError:
        raise ConfigError(
            "optimizer.type",
            f"{kind} needs the mup package: pip install --no-deps mup==1.0.0 (its other "
            "requirements, e.g. torchvision and seaborn, are not needed for its optimizers)",
        ) from None
    params = {k: v for k, v in cfg["optimizer"]["params"].items() if v is not None and k != "max_grad_norm"}
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    source = model_parameters if model_parameters is not None else trainable_params(model)
    try:
        return getattr(mup, kind)(source, **params)
    except AssertionError as e:  # mup's "Did you forget to call `mup.set_base_shapes` on the model?"
        raise ConfigError("optimizer.type", f"{kind}: {e}") from None


# -------------------------------------------------------------------------------------------------------- schedule
def _schedule(
    cfg: Config, spec: OptimizerSpec, optimizer: Any, groups: list[dict[str, Any]], lr_scheduler: Any
) -> tuple[OptimizerSpec, Any]:
    """`spec` with its schedule, and the client scheduler (None without one).

    The config's scheduler gives each group's learning rate as a function of the applied updates (DeepSpeed builds
    it on a client optimizer too); a client scheduler sets it in the param groups, so the optimizer then reads each
    group's lr (and betas) from its group at every update."""
    if lr_scheduler is None:
        return scheduled(spec, cfg), None
    if cfg["scheduler"] is not None:
        warnings.warn(
            "a client lr_scheduler was passed to initialize: the config's scheduler block is ignored",
            ConfigWarning,
            stacklevel=4,
        )
    scheduler = lr_scheduler if hasattr(lr_scheduler, "step") else lr_scheduler(optimizer)
    out = []
    for h, group in zip(spec.per_group(), groups, strict=True):
        h = {**h, "lr": live(group, "lr")}
        if "betas" in h:
            h["betas"] = (live(group, "betas", 0), live(group, "betas", 1))
        out.append(h)
    return spec.with_per_group(out), scheduler

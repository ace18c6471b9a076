"""`fzero.initialize`: DeepSpeed's entry point, so that `import fzero as deepspeed` runs a DeepSpeed script.

    engine, optimizer, dataloader, lr_scheduler = fzero.initialize(model=model, config="ds_config.json",
                                                                   model_parameters=model.parameters())
    for x, y in batches:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

The mesh: under `torchrun` (or with a process group already initialised) a `DistMesh` over the world group, created
from the environment if needed (of shape `{"replicate": W // n, "shard": n}` where the config's ZeRO++ hpZ or MiCS
asks for groups of `n` ranks: `config_mesh`); in a plain single process a one-rank `SimMesh`: no process group, no
port, no global `torch.distributed` state left behind, and at world 1 every collective is the identity, so the
arithmetic is that of a `DistMesh` of one.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .. import optim
from ..config import Config, ConfigError, ConfigWarning, parse_config
from ..config.build import (
    MUP,
    OptimizerSpec,
    build_policy,
    build_transform,
    group_hypers,
    group_keys,
    optimizer_kind,
    optimizer_spec,
)
from ..config.build import scheduled as with_schedule
from ..config.zeropp import zero_mesh_shape
from ..host import accelerator, process_group
from ..mesh import DistMesh, Mesh, SimMesh
from ..state.precision import round_params
from .client import OptimizerView, client_spec, live, trainable_params
from .engine import Engine
from .groups import parse_groups, split_options

__all__ = ["DeepSpeedEngine", "Engine", "SchedulerView", "add_config_arguments", "init_distributed", "initialize"]

DeepSpeedEngine = Engine


class SchedulerView:
    """The `lr_scheduler` `initialize` returns for a config `scheduler` block. The engine steps the schedule
    (after applied updates only); this object reports it."""

    def __init__(self, engine: Engine, kind: str) -> None:
        self.engine = engine
        self.kind = kind

    @property
    def last_batch_iteration(self) -> int:
        return self.engine.applied_updates() - 1

    def get_lr(self) -> list[float]:
        """The learning rate of the next update."""
        return self.engine.get_lr()

    def get_last_lr(self) -> list[float]:
        """The learning rate the engine's optimizer holds now (DeepSpeed's: the last one the scheduler set)."""
        return self.engine.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"the engine steps the configured {self.kind} schedule after every applied update: do not call "
            "lr_scheduler.step() (in DeepSpeed that would advance it twice)"
        )

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def __repr__(self) -> str:
        return f"fzero.SchedulerView({self.kind}, last_batch_iteration={self.last_batch_iteration})"


def default_mesh() -> Mesh:
    """`DistMesh()` under torchrun or an initialised process group, else a one-rank `SimMesh`."""
    if dist.is_available() and (dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)):
        return DistMesh()
    return SimMesh(1)


def config_mesh(cfg: Config, mesh: Mesh, given: bool) -> Mesh:
    """The mesh the config trains on: `mesh`, or, where ZeRO++ hpZ or MiCS asks for a 2-D mesh
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
    zero = cfg["zero_optimization"]
    key = "mics_shard_size" if zero["mics_shard_size"] > 0 else "zero_hpz_partition_size"
    have = dict(getattr(mesh, "shape", None) or {})
    if given or mesh.stacked:
        if list(have.items()) != list(shape.items()):
            raise ConfigError(
                f"zero_optimization.{key}",
                f"{zero[key]} asks for a mesh of shape {shape} on {mesh.world} ranks, but the mesh given has shape "
                f"{have or '1-D'}: {mesh!r}",
            )
        return mesh
    return DistMesh(cast(DistMesh, mesh).group, shape=shape)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ValueError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
            "deepspeed.initialize() function call"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config


def _config_optimizer(
    model: nn.Module, cfg: Config, model_parameters: Any
) -> tuple[OptimizerSpec, OptimizerView, list[dict[str, Any]]]:
    """The config's optimizer over `model_parameters` (its param groups mapped to `fzero.param_groups`), before any
    schedule; the `OptimizerView`, one group per user group; the view's groups."""
    kind = optimizer_kind(cfg)
    if kind is None:
        raise ConfigError(
            "optimizer", 'no optimizer: add an "optimizer" block to the config or pass optimizer= to initialize'
        )
    view_groups: list[dict[str, Any]] = [{"params": trainable_params(model)}]
    pairs = None
    if model_parameters is not None:
        groups = parse_groups(model, model_parameters, "model_parameters")
        allowed = group_keys(kind)
        spec = optimizer_spec(cfg, schedule=False)
        assert spec is not None  # (the config has an optimizer: checked above)
        defaults = spec.per_group()[0]
        pairs, view_groups = [], []
        for group in groups:
            overrides, _ = split_options(group, allowed, cfg["optimizer"]["type"], "model_parameters")
            try:  # the values, checked as the optimizer's constructor checks them, naming the group
                getattr(optim, kind)(**{**defaults, **group_hypers(kind, overrides)})
            except (TypeError, ValueError) as e:
                raise type(e)(f"model_parameters[{group.index}]: {e}") from None
            pairs.append((group.names, overrides))
            view_groups.append({"params": group.params, **group.options})
    spec = optimizer_spec(cfg, pairs, schedule=False)  # split_options let through only the optimizer's own keys
    assert spec is not None
    view = OptimizerView(view_groups, {"lr": spec.lr, **spec.hypers}, spec.kind)
    return spec, view, view.param_groups


def _optimizer(
    model: nn.Module, cfg: Config, optimizer: Any, model_parameters: Any
) -> tuple[OptimizerSpec, OptimizerView | torch.optim.Optimizer, list[dict[str, Any]]]:
    """The optimizer to build (before any schedule), the object `initialize` returns as the optimizer, and the param
    group dicts that map to fzero's groups (one per group with parameters)."""
    if optimizer is None and cfg["optimizer"] is not None and cfg["optimizer"]["type"] in MUP:
        optimizer = _mup_optimizer(model, cfg, model_parameters)
        spec, groups = client_spec(model, optimizer)
        return spec, optimizer, groups
    if optimizer is None:
        return _config_optimizer(model, cfg, model_parameters)
    if cfg["optimizer"] is not None:
        warnings.warn(
            "a client optimizer was passed to initialize: the config's optimizer block is ignored (as in DeepSpeed)",
            ConfigWarning,
            stacklevel=3,
        )
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else trainable_params(model))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a callable returning one, got {type(optimizer).__name__}"
        )
    spec, groups = client_spec(model, optimizer)
    return spec, optimizer, groups


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


def _live(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> OptimizerSpec:
    """`spec` reading each group's lr (and betas) from its param group at every update (a client scheduler sets
    them)."""
    out = []
    for h, group in zip(spec.per_group(), groups, strict=True):
        h = {**h, "lr": live(group, "lr")}
        if "betas" in h:
            h["betas"] = (live(group, "betas", 0), live(group, "betas", 1))
        out.append(h)
    return spec.with_per_group(out)


def _dataloader(data: Any, cfg: Config, mesh: Mesh, collate_fn: Any) -> Any:
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

    sampler: Sampler[int]
    if mesh.stacked:
        sampler = RandomSampler(data)
    else:
        sampler = DistributedSampler(data, num_replicas=mesh.world, rank=int(mesh.rank))
    return DataLoader(
        data, batch_size=cfg.micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=cfg["dataloader_drop_last"]
    )


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: dict[str, Any] | str | os.PathLike[str] | None = None,
    mesh_param: Any = None,
    config_params: dict[str, Any] | None = None,
    *,
    mesh: Mesh | None = None,
    printer: Any = print,
) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's `deepspeed.initialize`, over fzero's functional ZeRO.

    Args:
      args: an argparse namespace; its `deepspeed_config` names the config file if `config` is not given.
      model: the `nn.Module` to train (moved to the device; from now on the engine owns its parameters).
      optimizer: None (the config's `optimizer` block), a `torch.optim.Adam` / `AdamW` / `SGD` (translated, param
        groups included), or a callable building one from `model_parameters`.
      model_parameters: what the config's optimizer trains: parameters, or torch-style param-group dicts
        (`{"params": [...], "lr": ..., "weight_decay": ..., "name": ...}`; a group's hyper-parameters override the
        config's for its parameters). Every `requires_grad` parameter of the model must be in it, once; frozen ones
        are ignored and groups without parameters dropped, as in DeepSpeed (see `fzero.engine.groups`). Default:
        the model's trainable parameters.
      training_data: a torch `Dataset`: a `DataLoader` of micro-batches, each rank its share, is returned.
      lr_scheduler: a client scheduler (an object with `step()`, or a callable building one from the optimizer);
        the engine steps it after every applied update, and each group's learning rate (and betas) is read from the
        optimizer's param group at every update.
      distributed_port, dist_init_required: accepted for compatibility (the mesh decides; see the module doc).
      mpu, mesh_param: model parallelism, not supported (must be None).
      collate_fn: the data loader's `collate_fn`.
      config: the DeepSpeed config: a dict or the path of a JSON file. Its `comms_config.timeout` (seconds), if
        given, is set on a `DistMesh`'s group.
      config_params: DeepSpeed's older name for `config`.
      mesh: fzero only: the mesh to train on (default: see the module docstring). With the config's
        `zero_hpz_partition_size` or `mics_shard_size` at stage 3 it must have the shape they ask for (`{"replicate":
        W // n, "shard": n}`); by default `initialize` builds that `DistMesh`.
      printer: fzero only: where the engine's console lines go (rank 0).

    Returns:
      `(engine, optimizer, dataloader, lr_scheduler)`: the `Engine`; the optimizer object (an `OptimizerView`
      whose `param_groups` mirror the user's groups, or the client optimizer); the data loader or None; the
      scheduler (a `SchedulerView` for a config `scheduler`, the client scheduler, or None).
    """
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("model parallelism (mpu / mesh_param) is not supported by fzero: pass None")
    source = _config_source(args, config, config_params)
    device = accelerator.device()
    given = mesh is not None
    mesh = mesh if mesh is not None else default_mesh()
    cfg = parse_config(source, world=mesh.world)
    mesh = config_mesh(cfg, mesh, given)  # ZeRO++ hpZ and MiCS shard over groups of ranks: a 2-D mesh
    timeout = cfg["comms_config"]["timeout"]
    if timeout is not None:
        mesh.set_timeout(timeout)
    model.to(device)
    spec, view, groups = _optimizer(model, cfg, optimizer, model_parameters)
    scheduler = None
    if lr_scheduler is not None:
        if cfg["scheduler"] is not None:
            warnings.warn(
                "a client lr_scheduler was passed to initialize: the config's scheduler block is ignored",
                ConfigWarning,
                stacklevel=2,
            )
        scheduler = lr_scheduler if hasattr(lr_scheduler, "step") else lr_scheduler(view)
        spec = _live(spec, groups)
    else:
        spec = with_schedule(spec, cfg)  # DeepSpeed builds the config's scheduler on the client optimizer too
    if cfg["fzero_precision"]["round_initial_master"] and cfg.precision != "fp32":
        compute_dtype = cast(torch.dtype, build_policy(cfg).compute_dtype)  # (bf16 / fp16: set)
        round_params(model, compute_dtype)  # DeepSpeed's master starts from the cast module
    tx = build_transform(cfg, spec.build(offload=cfg.offload, cpu=device.type == "cpu"))
    hypers = spec.per_group()
    engine = Engine(
        model, cfg, mesh, tx, view, lr=[h["lr"] for h in hypers],
        betas=[h["betas"] for h in hypers] if "betas" in hypers[0] else None, param_groups=groups,
        momentum="momentum" if optimizer is None and spec.kind == "sgd" else "betas",
        client_scheduler=scheduler, device=device, printer=printer,
    )  # fmt: skip
    if scheduler is None and cfg["scheduler"] is not None:
        scheduler = SchedulerView(engine, cfg["scheduler"]["type"])
    return engine, view, _dataloader(training_data, cfg, mesh, collate_fn), scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `--deepspeed` and `--deepspeed_config` arguments (and their old `deepscale` names)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable DeepSpeed (a flag for your code)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's `init_distributed`: initialise the default process group from the torchrun environment, or as
    a group of one (rank 0, `127.0.0.1:distributed_port`) in a plain process. No-op if already initialised.

    `timeout` (a `timedelta`, or seconds) bounds every collective's wait for the other ranks; default, as in
    DeepSpeed, the `DEEPSPEED_TIMEOUT` environment variable (minutes) if set, else torch's default. The group is
    shut down before the interpreter exits (`fzero.host.process_group`)."""
    if dist.is_initialized():
        return
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" not in os.environ:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(distributed_port))):  # fmt: skip
            os.environ.setdefault(key, value)
    backend = dist_backend or accelerator.backend()
    if timeout is None:
        timeout = process_group.env_timeout()
    process_group.init_process_group(backend, timeout=timeout, init_method=init_method)

"""`fzero.initialize`: DeepSpeed's entry point, so that `import fzero as deepspeed` runs a DeepSpeed script.

    engine, optimizer, dataloader, lr_scheduler = fzero.initialize(model=model, config="ds_config.json",
                                                                   model_parameters=model.parameters())
    for x, y in batches:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

`initialize` resolves its arguments and the config once into a `Setup` (`fzero.engine.resolve`: the mesh, the
param groups, the optimizer and its schedule, the precision policy, ...), then builds the engine from it
(`fzero.engine.build`).

May import: `fzero.host`, `fzero.storage`, `fzero.metrics`, `fzero.layout`, `fzero.mesh`, `fzero.sharding`,
`fzero.state`, `fzero.optim`, `fzero.transforms`, `fzero.step`, `fzero.config`, `fzero.checkpoint`.
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch.distributed as dist
from torch import nn

from ..host import accelerator, process_group
from ..mesh import Mesh
from ..sharding.compile import uncompiled
from .build import build
from .client import SchedulerView
from .engine import Engine
from .resolve import resolve

__all__ = ["DeepSpeedEngine", "Engine", "SchedulerView", "add_config_arguments", "init_distributed", "initialize"]

DeepSpeedEngine = Engine


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
      model: the `nn.Module` to train (moved to the device; from now on the engine owns its parameters). A model
        compiled whole (`torch.compile(model)`, `model.compile(...)`) is compiled unit by unit instead, with the
        same backend and options (`fzero.sharding.compile`; a log line says so).
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
      distributed_port, dist_init_required: accepted for compatibility (the mesh decides: see
        `fzero.engine.resolve`).
      mpu, mesh_param: model parallelism, not supported (must be None).
      collate_fn: the data loader's `collate_fn`.
      config: the DeepSpeed config: a dict or the path of a JSON file. Its `comms_config.timeout` (seconds), if
        given, is set on a `DistMesh`'s group.
      config_params: DeepSpeed's older name for `config`.
      mesh: fzero only: the mesh to train on (default: see `fzero.engine.resolve`). With the config's
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
    # a model compiled whole would be traced with the units' gathers: its module, compiled per unit the same way
    model, compiler = uncompiled(model)
    setup = resolve(
        model, _config_source(args, config, config_params), optimizer=optimizer, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, mesh=mesh, training_data=training_data, collate_fn=collate_fn, printer=printer,
    )  # fmt: skip
    out = build(setup)
    if compiler is not None:
        out[0].monitor.printer("fzero: the model came compiled by torch.compile: compiled unit by unit instead, "
                               "with the same backend and options")  # fmt: skip
        out[0].compile_with(compiler)
    return out


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config `initialize` was given: `config`, DeepSpeed's older `config_params`, or the file `args` names."""
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
    DeepSpeed (`deepspeed.constants.default_pg_timeout`), the `DEEPSPEED_TIMEOUT` environment variable (minutes) if
    set, else 10 minutes. The group is shut down before the interpreter exits (`fzero.host.process_group`)."""
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
        timeout = process_group.env_timeout() or datetime.timedelta(minutes=10)
    process_group.init_process_group(backend, timeout=timeout, init_method=init_method)

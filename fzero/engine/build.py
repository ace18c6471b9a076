"""A `fzero.engine.resolve.Setup` built: what `fzero.initialize` returns.

In order: the model on its device (its initial master weights rounded where the setup says), the optimizer and the
ZeRO transform chain around it, the engine (which initialises the training state from the model), then the
scheduler object and the data loader (with curriculum data sampling, `engine.deepspeed_io(training_data)`, DeepSpeed's
`DeepSpeedDataLoader` over its curriculum sampler, as DeepSpeed's `initialize` builds it). Everything here reads the
`Setup`; nothing goes back to the arguments.

Without an optimizer (`Setup.forward_only`: DeepSpeed-Chat's reference, reward and EMA models) the engine runs
forwards only. It holds what a training engine of the same config holds for its parameters (the ZeRO stage's
parameter shards or full parameters, the compute copy in the compute dtype, and, under bf16 / fp16, the fp32 master
weights the state is built around) but no optimizer moments: its optimizer is stateless SGD (an empty momentum
buffer and a count) that never runs, since `engine.backward` and `engine.step` refuse. `engine(x)` (with or without
gradients enabled: its outputs are never differentiable in the parameters, and no micro-step is kept), `eval()`,
`module_state_dict()`, `save_16bit_model` and the gathered reads work as on any engine;
`initialize` returns None as the optimizer (DeepSpeed's engine has none at stage 0 either).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..config import Config
from ..config.build import build_transform
from ..mesh import Mesh
from ..state.precision import round_params
from .autocast import init_autocast_params
from .client import SchedulerView
from .engine import Engine
from .resolve import Setup

__all__ = ["build"]


def build(setup: Setup) -> tuple[Engine, Any, Any, Any]:
    """The engine of `setup`, and the objects `initialize` returns with it.

    Returns:
      `(engine, optimizer, dataloader, lr_scheduler)`, as `fzero.initialize` describes them.
    """
    model, cfg, mesh = setup.model, setup.config, setup.mesh
    model.to(setup.device)
    init_autocast_params(model, cfg)  # DeepSpeed's comm_dtype tags under torch_autocast (fzero.engine.autocast)
    if setup.round_to is not None:
        round_params(model, setup.round_to)  # DeepSpeed's master starts from the cast module
    tx = build_transform(cfg, setup.spec.build(offload=setup.offload, cpu=setup.device.type == "cpu"), setup.policy)
    hypers = setup.spec.per_group()
    engine = Engine(
        model, cfg, mesh, tx, setup.optimizer, lr=[h["lr"] for h in hypers],
        betas=[h["betas"] for h in hypers] if "betas" in hypers[0] else None, param_groups=setup.param_groups,
        momentum=setup.momentum, client_scheduler=setup.client_scheduler, device=setup.device, policy=setup.policy,
        printer=setup.printer,
    )  # fmt: skip
    scheduler = setup.client_scheduler
    if scheduler is None and cfg["scheduler"] is not None:
        scheduler = SchedulerView(engine, cfg["scheduler"]["type"])
    engine.lr_scheduler = scheduler  # DeepSpeed's attributes: what initialize returns
    if setup.training_data is not None and engine.curriculum_learning_enabled():
        engine.training_dataloader = engine.deepspeed_io(setup.training_data, collate_fn=setup.collate_fn)
    else:
        engine.training_dataloader = _dataloader(setup.training_data, cfg, mesh, setup.collate_fn)
    engine.forward_only = setup.forward_only  # (backward and step refuse on it; forwards keep no micro-step)
    optimizer = None if setup.forward_only else setup.optimizer  # (the engine keeps its view for its bookkeeping)
    return engine, optimizer, engine.training_dataloader, scheduler


def _dataloader(data: Any, cfg: Config, mesh: Mesh, collate_fn: Any) -> Any:
    """Micro-batches of `data`: each rank its share (a `DistributedSampler`), or, where this process runs every
    rank and no process group, all of it, shuffled."""
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

    sampler: Sampler[int]
    if len(mesh.local_ranks) == mesh.world and not (dist.is_available() and dist.is_initialized()):
        sampler = RandomSampler(data)
    else:
        sampler = DistributedSampler(data, num_replicas=mesh.world, rank=mesh.local_ranks[0])
    return DataLoader(
        data, batch_size=cfg.micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=cfg["dataloader_drop_last"]
    )

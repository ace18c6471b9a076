"""DeepSpeed 0.19.8 itself and fzero's engine on the same config with `csv_monitor` (2 gloo processes), for
tests/test_monitors_deepspeed.py to compare what each wrote: the reference for fzero's event names, x-axis and
cadence. Each rank works in its own directory (`out/<trainer>/rank<r>`; the default `output_path` "" is it)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import mlp

GAS, MICRO, STEPS = 2, 2, 3


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 5, "warmup_type": "linear"}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "job_name": "run"},
    }  # fmt: skip


def run(rank: int, world: int, out_dir: str, trainer: str) -> None:
    workdir = os.path.join(out_dir, trainer, f"rank{rank}")
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_worker(rank, world, os.path.join(out_dir, f"store-{trainer}"))
    try:
        model = mlp([6, 9, 4], 0)
        if trainer == "deepspeed":
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config())
        else:
            import fzero

            engine, *_ = fzero.initialize(model=model, config=config(), printer=lambda *a: None)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS * GAS):
            x, y = torch.randn(MICRO, 6, generator=gen), torch.randn(MICRO, 4, generator=gen)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        if trainer == "fzero":  # (DeepSpeed opens and closes its CSV files for each row)
            engine.close()
    finally:
        process_group.shutdown()

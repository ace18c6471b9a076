"""The engine runs behind `tests/test_monitors.py`: DeepSpeed's monitors (TensorBoard, W&B offline, CSV, Comet
offline) on 2 gloo processes, and what the engine reported at each boundary, for the test to compare with what the
libraries read back.

Each rank works in its own directory (`out/rank<r>`) with the config's default `output_path` ("": the working
directory), so what a rank wrote is what its directory holds: rank 1 must hold nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch
import torch.nn.functional as F

from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import mlp

WORLD, GAS, MICRO, STEPS = 2, 2, 2, 3
SAMPLES = WORLD * GAS * MICRO  # train_batch_size: the x-axis advances by this much per optimizer step
COMET_INTERVAL = 16  # samples_log_interval: steps 8 and 24 are sent (16 - 8 < 16), not 16
HAS_COMET = importlib.util.find_spec("comet_ml") is not None

# name: (ZeRO stage, fp16, wall_clock_breakdown)
CASES = {"fp32-stage2": (2, False, True), "fp16-stage3": (3, True, False)}


def offline_env(workdir: str, scratch: str) -> dict[str, str]:
    """Environment that keeps W&B and Comet offline, their runs in `workdir` and their caches and settings in
    `scratch` (nothing in the home directory)."""
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": workdir, "WANDB_SILENT": "true", "WANDB_CACHE_DIR": f"{scratch}/cache",
        "WANDB_CONFIG_DIR": f"{scratch}/config", "WANDB_DATA_DIR": f"{scratch}/data",
        "WANDB_ARTIFACT_DIR": f"{scratch}/artifacts", "WANDB_DISABLE_CODE": "true", "WANDB_DISABLE_GIT": "true",
        "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_MACHINE_INFO": "true",
        "COMET_OFFLINE_DIRECTORY": f"{workdir}/comet", "MPLCONFIGDIR": f"{scratch}/mpl",
    }  # fmt: skip


def config(case: str) -> dict:
    stage, fp16, wall = CASES[case]
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        # the LR changes every step, so that logging the LR of the wrong update would show
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 5, "warmup_type": "linear"}},
        "steps_per_print": 1000,  # events are written every boundary regardless
        "wall_clock_breakdown": wall,
        "tensorboard": {"enabled": True, "job_name": case},
        "wandb": {"enabled": True, "project": "fzero-tests", "group": case},
        "csv_monitor": {"enabled": True, "job_name": case},
    }  # fmt: skip
    if fp16:  # a small scale that grows every 2 steps: the logged scale changes
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1}
    if HAS_COMET:
        cfg["comet"] = {"enabled": True, "online": False, "project": "fzero-tests", "experiment_name": case,
                        "samples_log_interval": COMET_INTERVAL}  # fmt: skip
    return cfg


def train(case: str, rank: int) -> dict:
    """Train STEPS optimizer steps; per boundary, what the monitors must show (this rank's own losses)."""
    import fzero

    fp16 = CASES[case][1]
    engine, *_ = fzero.initialize(model=mlp([6, 9, 4], 0), config=config(case), printer=lambda *a: None)
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(STEPS):
        losses = []
        for _ in range(GAS):
            x = torch.randn(MICRO, 6, generator=gen)
            y = torch.randn(MICRO, 4, generator=gen)
            out = engine(x.half() if fp16 else x)
            loss = F.mse_loss(out.float(), y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        rec = engine.last_record
        assert rec is not None
        steps.append({
            "samples": engine.global_samples, "losses": losses, "lr_next": engine.get_lr()[0], "lr_used": rec["lr"],
            "loss_scale": engine.optimizer.cur_scale,
            "times": {k: rec[f"{k}_ms"] for k in ("forward", "backward", "step") if f"{k}_ms" in rec},
        })  # fmt: skip
    engine.close()
    engine.close()  # a second close does nothing
    return {"steps": steps, "comet": HAS_COMET}


def run(rank: int, world: int, out_dir: str) -> None:
    workdir = os.path.join(out_dir, f"rank{rank}")
    os.environ.update(offline_env(workdir, os.path.join(out_dir, f"scratch{rank}")))
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)  # the config's output_path "" is this directory
    init_worker(rank, world, os.path.join(out_dir, "store"))
    try:
        results = {case: train(case, rank) for case in CASES}
        with open(os.path.join(out_dir, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        process_group.shutdown()

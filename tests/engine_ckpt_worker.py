"""Engines, data and loops shared by `tests/test_engine_checkpoint.py` and its 2-process gloo worker (`run`)."""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import fzero
from fzero.checkpoint import CheckpointError
from fzero.host import process_group
from tests.spawn import init_worker


def model(seed: int) -> nn.Module:
    """A small MLP with dropout: a resumed run matches only if the generators are restored too."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))


def config(stage: int, precision: str = "fp32", gas: int = 1, scheduler: bool = True, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        **extra,
    }
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}
    if precision == "fp16":  # a dynamic scale that starts low and grows during the run (window 2)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def engine(cfg: dict, seed: int = 0, module: nn.Module | None = None, **kwargs):
    """An engine on `model(seed)` (or `module`)."""
    module = model(seed) if module is None else module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on ignored config keys
        eng, *_ = fzero.initialize(model=module, config=cfg, printer=lambda *a: None, **kwargs)
    return eng


def batches(n: int, rank: int = 0, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def train(eng, data, start: int, stop: int) -> list[float]:
    """Micro-steps `start` .. `stop - 1` of `data`: the returned losses."""
    out = []
    for x, y in data[start:stop]:
        x = x.half() if eng.fp16_enabled() else x.bfloat16() if eng.bfloat16_enabled() else x
        out.append(float(eng.backward(F.mse_loss(eng(x).float(), y))))
        eng.step()
    return out


def counters(eng) -> tuple[int, int, int, int]:
    return eng.global_steps, eng.global_samples, eng.micro_steps, eng.skipped_steps


def run(rank: int, world: int, out_dir: str) -> None:
    """Save at micro-step 5 of 9 (inside an accumulation window of 2) and continue; a fresh engine loads it and
    continues; a world-2 stage-2 checkpoint at a boundary for the single-process resharding test; a tag mismatch."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store")
    results: dict = {}
    data = batches(9, rank)
    for stage in (1, 3):
        cfg = config(stage, "fp16" if stage == 1 else "bf16", gas=2)
        root = os.path.join(out_dir, f"ckpt{stage}")
        a = engine(cfg, seed=0)
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        train(a, data, 0, 5)
        a.save_checkpoint(root, client_state={"rank_saved": rank, "epoch": 3})
        losses_a = train(a, data, 5, 9)
        b = engine(cfg, seed=1)
        torch.manual_seed(999)
        path, client = b.load_checkpoint(root)
        losses_b = train(b, data, 5, 9)
        pa, pb = a.module_state_dict(), b.module_state_dict()
        results[stage] = {
            "path": path,
            "client": client,
            "equal": all(torch.equal(pa[k], pb[k]) for k in pa),
            "losses": [losses_a, losses_b],
            "counters": [counters(a), counters(b)],
            "loss_scale": [a.optimizer.cur_scale, b.optimizer.cur_scale],
        }
    # a boundary checkpoint at world 2, stage 2, and its consolidated parameters for the resharding test
    c = engine(config(2, gas=2), seed=0)
    train(c, data, 0, 4)
    c.save_checkpoint(os.path.join(out_dir, "w2"), tag="at4")
    params = c.module_state_dict()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in params.items()}, os.path.join(out_dir, "w2_params.safetensors"))
        results["w2_counters"] = counters(c)
    try:
        c.save_checkpoint(os.path.join(out_dir, "w2"), tag=f"rank{rank}")
        results["mismatch"] = None
    except CheckpointError as e:
        results["mismatch"] = str(e)
    results["mismatch_exists"] = [os.path.exists(os.path.join(out_dir, "w2", f"rank{r}")) for r in range(world)]
    with open(os.path.join(out_dir, f"results{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

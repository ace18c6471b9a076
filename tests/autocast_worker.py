"""Workers of tests/test_torch_autocast.py: the same script under DeepSpeed 0.19.8 (CPU accelerator, gloo) and under
fzero (`import fzero.deepspeed as deepspeed`), with a `torch_autocast` block, on 1 or 2 processes; each writes the
losses of every step (float hex), the final weights and the `comm_dtype` tags.

Every run sees the same global batch per step (`GLOBAL` samples split over the ranks), so the losses are the same
quantity at every world size.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from fzero.host import process_group
from tests.spawn import init_deepspeed_worker

GLOBAL, STEPS, LR = 8, 3, 1e-2
# name: (stage, autocast dtype, gradient_clipping)
CASES: dict[str, tuple[int, str, float]] = {
    "z0-bf16": (0, "bfloat16", 1.0),
    "z2-bf16": (2, "torch.bfloat16", 1.0),
    "z3-bf16": (3, "bf16", 1.0),
    "z0-fp16": (0, "float16", 1.0),  # the engine's GradScaler: unscale_ before clipping
    "z2-fp16": (2, "fp16", 0.0),  # the ZeRO optimizer's GradScaler (clipping refused: see fzero.config.autocast)
}


class Net(nn.Module):
    """An embedding, a LayerNorm and two Linear layers: the Linear parameters' gradients are reduced in the autocast
    dtype at ZeRO stages 1-3, the others in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 16)
        self.ln = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.ln(self.emb(x)))))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 13, (GLOBAL, 5), generator=g), torch.randn(GLOBAL, 5, 4, generator=g)
    n = GLOBAL // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def config(name: str, world: int) -> dict[str, Any]:
    stage, dtype, clip = CASES[name]
    return {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        # (DeepSpeed's memory-efficient linear would replace torch.nn.functional.linear in the whole process)
        "zero_optimization": {"stage": stage, "memory_efficient_linear": False},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "torch_autocast": {"enabled": True, "dtype": dtype},
        "steps_per_print": 10**9,
    }


def run_case(deepspeed: Any, trainer: str, name: str, rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    kwargs = {"printer": lambda *_: None} if trainer == "fzero" else {}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(name, world),
                                      **kwargs)  # fmt: skip
    from deepspeed.runtime.torch_autocast import get_comm_dtype  # (fzero's shell: the same module path)

    tags = {n: str(get_comm_dtype(p)) for n, p in model.named_parameters()}
    losses, dtypes = [], []
    for step in range(1, STEPS + 1):
        x, y = batch(step, rank, world)
        pred = engine(x)
        dtypes.append(str(pred.dtype))
        loss = (pred.float() - y).square().mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float((total / world).item()).hex())
    if trainer == "fzero":
        weights = engine.module_state_dict()
    else:
        from deepspeed.utils import safe_get_full_fp32_param

        # (collective at stage 3; None at stage 0, whose module holds the fp32 parameters themselves)
        full = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        weights = {n: (p if full[n] is None else full[n]).detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, f"{name}.safetensors"))
    engine.destroy()
    return {"losses": losses, "out_dtypes": dtypes, "tags": tags}


def run(rank: int, world: int, out_dir: str) -> None:
    """Every case with DeepSpeed, then with fzero: `out_dir/{trainer}-{world}.json` and the weights beside it."""
    deepspeed, shell = init_deepspeed_worker(rank, world, os.path.join(out_dir, f"store-{world}"))
    import sys

    for trainer, module in (("deepspeed", deepspeed), ("fzero", shell)):
        out = os.path.join(out_dir, f"{trainer}-{world}")
        os.makedirs(out, exist_ok=True)
        if trainer == "fzero":  # `from deepspeed.runtime.torch_autocast import ...` reaches fzero's shell from here
            sys.modules["deepspeed.runtime.torch_autocast"] = shell.runtime.torch_autocast
        results = {name: run_case(module, trainer, name, rank, world, out) for name in CASES}
        if rank == 0:
            with open(f"{out}.json", "w") as f:
                json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

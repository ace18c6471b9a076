"""Workers of tests/test_deepspeed_import.py: DeepSpeed 0.19 itself (CPU accelerator, gloo) trains and saves ZeRO
checkpoints; fzero imports them and continues at other world sizes and stages.

Every run sees the same global batch per step (`GLOBAL` samples, split evenly over the ranks), so a step's global
loss (the mean of the ranks' means) is the same quantity at every world size.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

from fzero.host import process_group
from tests.spawn import init_worker

GLOBAL, SAVE_AT, STEPS = 12, 10, 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# stage, precision (fp16: DeepSpeed refuses it on the CPU); "-groups": two param groups (weight decay on the
# matrices only) with AMSGrad and round-robin gradients at stage 2, and small sub-groups at stage 3
CASES = [(2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16"), (1, "fp32"), (2, "fp32-groups"), (3, "fp32-groups")]


class Net(nn.Module):
    """Linear layers around a LayerNorm whose bias is frozen, two layers sharing (tying) one weight, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 10)
        self.ln = nn.LayerNorm(10)
        self.ln.bias.requires_grad_(False)
        self.mid = nn.Linear(10, 10)
        self.mid2 = nn.Linear(10, 10, bias=False)
        self.mid2.weight = self.mid.weight
        self.head = nn.Linear(10, 3)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.ln(self.emb(x)) * self.scale.to(x.dtype))
        return self.head(torch.tanh(self.mid2(torch.tanh(self.mid(h)))))


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the matrices, none on vectors (biases, LayerNorm), as transformer recipes do."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in trainable if p.ndim > 1], "weight_decay": 0.05},
        {"params": [p for _, p in trainable if p.ndim <= 1], "weight_decay": 0.0},
    ]


def parameters(model: nn.Module, precision: str):
    return param_groups(model) if precision.endswith("-groups") else model.parameters()


def config(stage: int, precision: str, world: int) -> dict:
    grouped = precision.endswith("-groups")
    precision = precision.removesuffix("-groups")
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 15},
        },
        "steps_per_print": 10**9,
    }
    if grouped:
        cfg["optimizer"]["params"]["amsgrad"] = True
        cfg["zero_optimization"].update({"round_robin_gradients": True} if stage < 3 else {"sub_group_size": 64})
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    return cfg


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of step `step`'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
    n = GLOBAL // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(engine, precision: str, steps: range, rank: int, world: int) -> tuple[list[str], list[str]]:
    """Steps `steps` (1-based); per step the global loss and the learning rate used, as float hex."""
    losses, lrs = [], []
    for step in steps:
        x, y = batch(step, rank, world)
        lrs.append(float(engine.get_lr()[0]).hex())
        out = engine(x.to(DTYPES[precision.removesuffix("-groups")]))
        loss = (out.float() - y).square().mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item().hex())
    return losses, lrs


def case_name(stage: int, precision: str) -> str:
    return f"z{stage}-{precision}"


def deepspeed_run(rank: int, world: int, out_dir: str) -> None:
    """DeepSpeed trains each case for `STEPS` steps, saving at `SAVE_AT` (`out_dir/<case>/global_step10`)."""
    # DeepSpeed's CPU accelerator compiles its shared-memory collective on first use: into the session's
    # TORCH_EXTENSIONS_DIR (tests/conftest.py)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-ds")
    import deepspeed

    results = {}
    for stage, precision in CASES:
        torch.manual_seed(0)
        model = Net()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters(model, precision),
                                          config=config(stage, precision, world))  # fmt: skip
        name = case_name(stage, precision)
        losses, lrs = train(engine, precision, range(1, SAVE_AT + 1), rank, world)
        engine.save_checkpoint(os.path.join(out_dir, name), client_state={"epoch": 3, "note": "from DeepSpeed"})
        more, more_lrs = train(engine, precision, range(SAVE_AT + 1, STEPS + 1), rank, world)
        results[name] = {"losses": losses + more, "lrs": lrs + more_lrs}
    if rank == 0:
        with open(os.path.join(out_dir, "deepspeed.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    process_group.shutdown()


def fzero_run(rank: int, world: int, out_dir: str, runs: list[tuple[str, int, str | None]]) -> None:
    """fzero loads each imported checkpoint (`out_dir/<case>-fzero`) at `world` ranks, the stage and the
    `communication_data_type` given, and trains steps `SAVE_AT + 1 .. STEPS`."""
    import fzero

    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-fz{world}")
    results = {}
    for name, stage, comm in runs:
        precision = name.split("-", 1)[1]
        cfg = config(stage, precision, world)
        if comm is not None:
            cfg["communication_data_type"] = comm
        torch.manual_seed(123)  # another initialisation: the checkpoint must replace it
        model = Net()
        engine, *_ = fzero.initialize(model=model, model_parameters=parameters(model, precision), config=cfg,
                                      printer=lambda _: None)  # fmt: skip
        _, client = engine.load_checkpoint(os.path.join(out_dir, f"{name}-fzero"))
        start = (engine.global_steps, engine.global_samples, engine.skipped_steps)
        losses, lrs = train(engine, precision, range(SAVE_AT + 1, STEPS + 1), rank, world)
        results[f"{name}@{stage}" + ("" if comm is None else f"/{comm}")] = {
            "losses": losses,
            "lrs": lrs,
            "client": client,
            "start": start,
        }
    if rank == 0:
        with open(os.path.join(out_dir, f"fzero-{world}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

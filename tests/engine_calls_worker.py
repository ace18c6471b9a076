"""Worker of tests/test_engine_module_calls.py: DeepSpeed 0.19.8 (CPU accelerator, gloo) and fzero behind
`import fzero.deepspeed as deepspeed`, in the same processes, call the module's attributes and methods through the
engine (`engine.tag`, `engine.forward_value(x)`, as DeepSpeed-Chat's critic does), train on a method's output, call
the stage-3 module outside the engine, and read `engine.tput_timer`; rank 0 reports what each returned.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fzero.host import process_group
from tests.spawn import init_deepspeed_worker, report

STEPS = 3


class Critic(nn.Module):
    """Two units in a ModuleList and a head; `forward_value` is a method of its own (not `forward`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 1)
        self.tag = "critic"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def forward_value(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).squeeze(-1) * 2


def config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        # (DeepSpeed's memory-efficient linear would replace torch.nn.functional.linear for the whole process;
        # persistence 0: its small parameters are partitioned too, as fzero's are)
        "zero_optimization": {"stage": stage, "memory_efficient_linear": False,
                              "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10**9,
    }  # fmt: skip


def hexes(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.detach().float().reshape(-1)]


def case(deepspeed: Any, trainer: str, stage: int, rank: int) -> dict[str, Any]:
    kwargs = {"printer": lambda *_: None} if trainer == "fzero" else {}
    torch.manual_seed(0)
    model = Critic()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage), **kwargs)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 6, generator=gen)
    out: dict[str, Any] = {"tag": engine.tag, "layers": type(engine.layers).__name__}
    try:
        engine.no_such_attribute  # noqa: B018
    except AttributeError as e:
        out["missing"] = type(e).__name__
    with torch.no_grad():
        out["value"] = hexes(engine.forward_value(x))
    engine.tput_timer.update_epoch_count()
    losses = []
    for step in range(STEPS):
        loss = engine.forward_value(x + step).square().mean()  # a method's output trains, as engine(x)'s
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total).hex())
    out["losses"] = losses
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    timer = engine.tput_timer
    out["timer"] = [timer.epoch_count, timer.micro_step_count, timer.global_step_count]
    out["timer_average_positive"] = timer.avg_samples_per_sec() > 0
    with torch.no_grad():  # the module called directly (DeepSpeed-Chat's actor.module.generate), no gradients
        out["direct"] = hexes(engine.module.forward_value(x))
        out["engine"] = hexes(engine.forward_value(x))
    if trainer == "fzero" and stage == 3:
        try:
            engine.module(x)
        except RuntimeError as e:
            out["outside"] = str(e)
    engine.destroy()
    return out


def run(rank: int, world: int, out_dir: str) -> None:
    deepspeed, shell = init_deepspeed_worker(rank, world, os.path.join(out_dir, "store"))
    trainers = (("deepspeed", deepspeed), ("fzero", shell))
    results = {f"{name}-z{stage}": case(module, name, stage, rank) for stage in (2, 3) for name, module in trainers}
    with deepspeed.zero.Init(config_dict_or_path=config(3), mem_efficient_linear=False):
        built = Critic()  # partitioned by DeepSpeed itself (transformers' HfDeepSpeedConfig with deepspeed installed)
    try:
        shell.initialize(model=built, model_parameters=built.parameters(), config=config(3))
    except ValueError as e:
        results["deepspeed_partitioned"] = str(e)
    report(rank, out_dir, results)
    process_group.shutdown()

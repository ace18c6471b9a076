"""Worker for the ZeRO-3 memory tests: a wide MLP of `layers` units on `world` gloo processes; reports peak
resident memory during sharded construction and during training steps (VmHWM, reset in between), or during the
init of a model built in memory (`run_init`)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import proc_status


class Wide(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.norm(x)


def initializer(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=module.in_features**-0.5)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def peak_rss() -> int:
    return proc_status("VmHWM")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (Linux >= 4.0)


def current_rss() -> int:
    return proc_status("VmRSS")


def run_init(rank: int, world: int, out_dir: str, stage: int, d: int, layers: int) -> None:
    """`fzero.init` of a model built in memory (the usual way, not on `meta`): the resident memory it adds on top
    of the model, at its peak and once done."""
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-init-{stage}")
    torch.manual_seed(rank)  # different values per rank: init must start every rank from rank 0's
    model = Wide(d, layers)
    tx = [fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3][stage](fzero.adamw(1e-3))
    before = current_rss()
    reset_peak()
    mesh = fzero.DistMesh()
    state = fzero.init(model, tx, mesh)
    result = {
        "before": before,
        "init_peak": peak_rss(),
        "after": current_rss(),
        "numel": state.layout.numel,
        "largest_unit": max(u.size for u in state.layout.units),
    }
    full = fzero.state_dict(state, mesh)  # (a collective: every rank gathers)
    if rank == 0:  # the state holds rank 0's model exactly
        result["rank0_exact"] = all(torch.equal(full[n], p) for n, p in model.state_dict().items())
    with open(os.path.join(out_dir, f"init-rank{rank}-stage{stage}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    process_group.shutdown()


def run(rank: int, world: int, out_dir: str, stage: int, d: int, layers: int, prefetch: int, steps: int) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-{stage}-{prefetch}")  # fmt: skip
    mesh = fzero.DistMesh()
    torch.manual_seed(0)  # the same initial model in every launch (rank 0 broadcasts it to the others anyway)
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(rank))
    reset_peak()
    baseline = peak_rss()
    with torch.device("meta"):
        model = Wide(d, layers)
    tx = [fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3][stage](fzero.adamw(1e-3))
    reset_peak()
    state = fzero.init(model, tx, mesh, initializer=initializer)
    init_peak = peak_rss()

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch,)).square().mean()

    policy = fzero.GatherPolicy(prefetch=prefetch)
    step = fzero.train_step(model, loss_fn, tx, mesh, donate=True, gather=policy)
    state, metrics = step(state, x)  # the first step allocates the optimizer's buffers for good
    reset_peak()
    for _ in range(steps):
        state, metrics = step(state, x)
    result = {
        "baseline": baseline,
        "init_peak": init_peak,
        "step_peak": peak_rss(),
        "gathered_peak": metrics["gathered_peak"],
        "psi": state.layout.real_numel,
        "numel": state.layout.numel,
        "largest_unit": max(u.size for u in state.layout.units),
        "loss": float(metrics["loss"]),
    }
    with open(os.path.join(out_dir, f"rank{rank}-stage{stage}-prefetch{prefetch}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    process_group.shutdown()

"""Worker for the multi-process tests: runs every preset over a real gloo process group and saves the results."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fzero
from tests.support import lm_batches, lm_loss, tiny_gpt

CASES = [(preset, micro) for preset in ("zero0", "zero1", "zero2", "zero3") for micro in (1, 2)]
STEPS = 3


def sim_batches(world: int, micro: int):
    return lm_batches(tiny_gpt(0), world, micro, 2, STEPS, 7)


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    mesh = fzero.DistMesh()
    ledgers = {}
    for preset, micro in CASES:
        model = tiny_gpt(0)
        if rank:  # only rank 0's initial values count: init broadcasts them
            torch.nn.init.zeros_(model.blocks[0].fc.weight)
        tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, lm_loss(model), tx, mesh)
        for batch in sim_batches(world, micro):
            state, metrics = step(state, {k: v[rank] for k, v in batch.items()})
        full = fzero.state_dict(state, mesh)
        ledgers[f"{preset}-{micro}"] = metrics["comm"]
        if rank == 0:
            save_file(
                {k: v.contiguous() for k, v in full.items() if k != "head.weight"}, f"{out_dir}/{preset}-{micro}.st"
            )
    if rank == 0:
        with open(os.path.join(out_dir, "ledgers.json"), "w") as f:
            json.dump(ledgers, f)
    dist.barrier()
    dist.destroy_process_group()

"""Worker for the multi-process tests: runs every preset over a real gloo process group and saves the results."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fzero
from fzero.host import process_group
from fzero.transforms import stats
from tests.spawn import init_worker
from tests.support import lm_batches, lm_loss, tiny_gpt

CASES = [(preset, micro, poison) for preset in ("zero0", "zero1", "zero2", "zero3") for micro in (1, 2)
         for poison in (False, True)]  # fmt: skip
STEPS = 3


def sim_batches(world: int, micro: int, poison: bool):
    """The batches; with `poison`, the last rank's loss is inf on the second optimizer step's micro-steps."""
    batches = lm_batches(tiny_gpt(0), world, micro, 2, STEPS, 7)
    for i, batch in enumerate(batches):
        bad = poison and i // micro == 1
        batch["poison"] = torch.tensor([1.0] * (world - 1) + [float("inf") if bad else 1.0])
    return batches


def loss_of(model):
    inner = lm_loss(model)
    return lambda params, batch: inner(params, batch) * batch["poison"]


def name(preset: str, micro: int, poison: bool) -> str:
    return f"{preset}-{micro}" + ("-poison" if poison else "")


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # stage 0's statistics as large gradients get them: each rank sums its part (test_dist's SimMesh does the same)
    stats.SPLIT_STATS_ELEMENTS = 0
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    ledgers = {}
    for preset, micro, poison in CASES:
        model = tiny_gpt(0)
        if rank:  # only rank 0's initial values count: init broadcasts them
            torch.nn.init.zeros_(model.blocks[0].fc.weight)
        tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, loss_of(model), tx, mesh)
        skipped, norms = [], []
        for batch in sim_batches(world, micro, poison):
            state, metrics = step(state, {k: v[rank] for k, v in batch.items()})
            skipped.append(bool(metrics["skipped"]))
            if "grad_norm" in metrics:  # (the last micro-step of a window)
                norms.append(metrics["grad_norm"])
        full = fzero.state_dict(state, mesh)
        ledgers[name(preset, micro, poison)] = {"comm": metrics["comm"], "skipped": skipped, "grad_norm": norms}
        if rank == 0:
            tensors = {k: v.contiguous() for k, v in full.items() if k != "head.weight"}
            save_file(tensors, f"{out_dir}/{name(preset, micro, poison)}.st")
    if rank == 0:
        with open(os.path.join(out_dir, "ledgers.json"), "w") as f:
            json.dump(ledgers, f)
    dist.barrier()
    process_group.shutdown()

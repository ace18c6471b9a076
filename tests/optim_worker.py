"""Worker for `tests/test_optim_dist.py`: Lamb, Lion, Adagrad and the gradient averages over a real gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fzero
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import lm_batches, lm_loss, tiny_gpt

STEPS = 2
CASES = [
    ("lamb", "zero1", None), ("lamb", "zero3", None), ("lion", "zero2", None), ("adagrad", "zero3", None),
    ("adamw", "zero2", "prescale"), ("adamw", "zero3", "predivide"), ("muon", "zero2", None), ("muon", "zero3", None),
]  # fmt: skip


def name(case: tuple) -> str:
    return "-".join(str(c) for c in case if c is not None)


def build(case: tuple) -> fzero.Transform:
    """The chain of a case (built in each process: a chain holds closures, which do not pickle)."""
    opt_name, preset, average = case
    if opt_name == "muon":  # (its groups are its Muon and Adam tensors)
        opt = fzero.muon(0.05, weight_decay=0.1, adam_lr=1e-2)
    else:
        opt = getattr(fzero, opt_name)(1e-2, groups=fzero.param_groups({"*.bias": {"lr": 5e-3}}))
    avg = {None: None, "prescale": fzero.Average(prescale=True), "predivide": fzero.Average(predivide=2.0)}[average]
    return getattr(fzero, preset)(opt, average=avg)


def batches(world: int):
    return lm_batches(tiny_gpt(0), world, 1, 2, STEPS, 11)


def train(case: tuple, mesh: fzero.Mesh, rank: int | None, world: int):
    model = tiny_gpt(0)
    tx = build(case)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    for batch in batches(world):
        state, metrics = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
    return fzero.state_dict(state, mesh), metrics["comm"]


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    for case in CASES:
        full, _ = train(case, mesh, rank, world)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items() if k != "head.weight"}, f"{out_dir}/{name(case)}.st")
    dist.barrier()
    process_group.shutdown()

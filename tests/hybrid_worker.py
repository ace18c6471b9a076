"""Worker for tests/test_hybrid.py: a 2-D DistMesh over 4 gloo processes runs the axis collectives and the hybrid
presets, and saves what it got."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

import fzero
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import lm_batches, lm_loss, tiny_gpt

SHAPE = {"replicate": 2, "shard": 2}
CASES = [(stage, micro, False) for stage in (1, 2, 3) for micro in (1, 2)] + [(2, 1, True), (3, 2, True)]
CASES += [(3, 1, "zero++"), (3, 2, "zero++")]  # ZeRO++ at stage 3 (qwZ, qgZ, hpZ; a frozen block qwZ'd too)
STEPS = 2


def inputs(world: int) -> torch.Tensor:
    """Every rank's input to the collectives: `[world, 2, 6]` (rank r's is row r)."""
    return torch.randn(world, 2, 6, generator=torch.Generator().manual_seed(3))


def collectives(mesh, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every collective over every axis of this rank's (a SimMesh: every rank's) `x`."""
    out = {}
    for axis in SHAPE:
        out[f"all_reduce:{axis}"] = mesh.all_reduce(x, "mean", axis=axis)
        out[f"reduce_scatter:{axis}"] = mesh.reduce_scatter(x, "mean", axis=axis)
        out[f"all_gather:{axis}"] = mesh.all_gather(x, axis=axis)
        out[f"all_to_all:{axis}"] = mesh.all_to_all(x, axis=axis)
        out[f"broadcast:{axis}"] = mesh.broadcast(x, 1, axis=axis)
        out[f"local_shard:{axis}"] = mesh.local_shard(x, axis=axis)
    return out


def batches(micro: int):
    return lm_batches(tiny_gpt(0), 4, micro, 2, STEPS, 5)


def name(stage: int, micro: int, quantized: bool | str) -> str:
    return f"zero{stage}-{micro}" + ("-zero++" if quantized == "zero++" else "-q" if quantized else "")


def train(mesh, stage: int, micro: int, quantized: bool | str, rank: int | None):
    """Hybrid `zero{stage}` for `STEPS` steps (`quantized`: with qgZ and qwZ; "zero++": ZeRO++'s stage 3, sharded
    over every rank with hpZ's secondary copies over `shard`); `rank` None: a SimMesh (batches with every rank's
    rows)."""
    model = tiny_gpt(0)
    if quantized == "zero++":
        model.blocks[1].ln1.requires_grad_(False)
        opts = {"qgz": True, "qwz": True, "hpz": True, "qwz_frozen": True}
    else:
        opts = {"hybrid": True, **({"qgz": True, "qwz": True} if quantized else {})}
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro, **opts)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    for batch in batches(micro):
        state, metrics = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
    full = fzero.state_dict(state, mesh)
    return {k: v.contiguous() for k, v in full.items() if k != "head.weight"}, metrics["comm"]


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh(shape=SHAPE)
    got = collectives(mesh, inputs(world)[rank])
    save_file({k: v.contiguous() for k, v in got.items()}, f"{out_dir}/collectives-{rank}.st")
    ledgers = {}
    for case in CASES:
        params, comm = train(mesh, *case, rank)
        ledgers[name(*case)] = comm
        if rank == 0:
            save_file(params, f"{out_dir}/{name(*case)}.st")
    if rank == 0:
        with open(f"{out_dir}/ledgers.json", "w") as f:
            json.dump(ledgers, f)
    process_group.shutdown()

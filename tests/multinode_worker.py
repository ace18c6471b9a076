"""Worker for tests/test_multinode.py, started by two `torchrun --nnodes 2 --nproc-per-node 2` launches on one host
(`python -m tests.multinode_worker OUT_DIR`): every rank reads the node layout torchrun gave it, trains a DeepSpeed
config with ZeRO++ qgZ through `fzero.initialize` (whose mesh it builds from the layout) and the functional
`fzero.zero3(..., qgz=("replicate", "shard"))` on that mesh, recording the ledger; rank 0 also runs the functional
chain on `SimMesh(shape={"replicate": 2, "shard": 2})` and writes `results.json`."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero.config import parse_config
from fzero.config.zeropp import zeropp_arguments
from fzero.host import process_group
from tests.support import lm_batches, tiny_gpt

WORLD, SHAPE = 4, {"replicate": 2, "shard": 2}
MICRO, STEPS, LR = 2, 2, 1e-2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
}


def criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batches() -> list[dict[str, torch.Tensor]]:
    """`STEPS` batches `{x, y}` of shape `[WORLD, MICRO, seq]` (rank r's rows: `[r]`)."""
    return lm_batches(tiny_gpt(0), WORLD, 1, MICRO, STEPS, 11)


def functional(mesh: fzero.Mesh, rank: int | None) -> tuple[dict[str, torch.Tensor], dict]:
    """What the engine builds from `CONFIG` on several nodes, as the functional core: `fzero.zero3(...,
    qgz=("replicate", "shard"))` (AdamW on the fused kernel, clip 1.0) on `mesh`; `rank` None: a `SimMesh` (every
    rank's rows). The consolidated parameters and the ledger of the steps."""
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.adamw(LR, weight_decay=0.01, fused=True), clip=1.0, qgz=("replicate", "shard"))

    def loss_fn(params, batch):
        return criterion(torch.func.functional_call(model, params, (batch["x"],)), batch["y"])

    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_fn, tx, mesh)
    with mesh.record() as ledger:
        for batch in batches():
            state, _ = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
    return fzero.state_dict(state, mesh), ledger.as_dict()


def engine_run(rank: int) -> tuple[dict[str, torch.Tensor], fzero.Mesh]:
    """The DeepSpeed loop on this rank through `fzero.initialize` (its mesh the default); its parameters, its mesh."""
    engine, *_ = fzero.initialize(model=tiny_gpt(0), config=CONFIG)
    for batch in batches():
        engine.backward(criterion(engine(batch["x"][rank]), batch["y"][rank]))
        engine.step()
    return engine.module_state_dict(), engine.mesh


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest difference of each tensor of `a` not bitwise `b`'s (a key missing from `b`: inf)."""
    return {
        k: float((v.double() - b[k].double()).abs().max()) if k in b else float("inf")
        for k, v in a.items()
        if k not in b or not torch.equal(v, b[k])
    }


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    layout = {"node_layout": list(process_group.node_layout(world)), "local_rank": process_group.local_rank(),
              "group_rank": int(os.environ["GROUP_RANK"]), "rank": rank}  # fmt: skip
    got, mesh = engine_run(rank)
    cfg = parse_config(CONFIG, world=world)
    core, ledger = functional(mesh, rank)
    layouts: list = [None] * world
    dist.all_gather_object(layouts, layout)
    results: dict[str, Any] = {"layouts": layouts, "mesh": repr(mesh), "arguments": repr(zeropp_arguments(cfg))}
    results["engine_vs_core"] = differ(got, core)
    flat = torch.cat([v.flatten() for v in got.values()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    results["same_on_all_ranks"] = bool(torch.equal(flat, ref))
    if rank == 0:
        sim, sim_ledger = functional(fzero.SimMesh(shape=SHAPE), None)
        results.update(core_vs_sim=differ(core, sim), ledger=ledger, sim_ledger=sim_ledger)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    process_group.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

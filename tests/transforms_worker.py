"""The 2-process gloo half of tests/test_transforms.py: user-written reductions at stages 2 and 3 on a DistMesh,
against each other and against the same run on a SimMesh."""

from __future__ import annotations

import torch

import fzero
from fzero.host import process_group
from tests.chains import train
from tests.spawn import init_worker, report
from tests.support import differing, lm_batches, tiny_gpt

SPECS = {
    "bf16": {"reduce": "bf16", "micro": 2, "scale": None, "clip": 0.5, "opt": "adamw"},
    "topk": {"reduce": "topk", "micro": 1, "scale": 64.0, "clip": None, "opt": "sgd"},
    "nested-cpu": {"reduce": "nested", "micro": 1, "scale": "none", "clip": None, "opt": "cpu_adamw"},
}


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    try:
        mesh = fzero.DistMesh()
        results = {}
        for name, spec in SPECS.items():
            batches = lm_batches(tiny_gpt(1), world, spec["micro"], 2, 2, 3)
            mine = [{k: v[rank] for k, v in b.items()} for b in batches]
            two, three = train(spec, 2, mesh, mine), train(spec, 3, mesh, mine)
            sim = train(spec, 3, fzero.SimMesh(world), batches)
            results[name] = {"stage3_vs_stage2": differing(three, two), "dist_vs_sim": differing(three, sim)}
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()

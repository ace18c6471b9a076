"""The 2-process gloo half of tests/test_unit_patterns.py: each pattern at stage 3 on a `DistMesh`, core and engine,
against stage 2 (core: on a `SimMesh`, computed here too; engine: the same engine at stage 2)."""

from __future__ import annotations

import os

import torch

import fzero
from fzero.host import process_group
from tests import patterns
from tests.spawn import init_worker, report
from tests.support import differing

WORLD, STEPS = 2, 3


def _engine(p: patterns.Pattern, stage: int, rank: int) -> dict[str, torch.Tensor]:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    model = patterns.make(p)
    engine, *_ = fzero.initialize(
        model=model, model_parameters=model.parameters(), config=config, printer=lambda line: None
    )
    for batch in patterns.batches(p, WORLD, 1, STEPS):
        x = batch["x"][rank]
        engine.backward(patterns.loss_of(engine(x), x))
        engine.step()
    return engine.module_state_dict()


def run(rank: int, world: int, out_dir: str, cases: list[dict]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what the engine reads
    init_worker(rank, world, f"{out_dir}/store")
    try:
        mesh = fzero.DistMesh()
        results = {}
        for i, case in enumerate(cases):
            p = patterns.Pattern(**case)
            data = patterns.batches(p, WORLD, 1, STEPS)
            want = patterns.train(p, "zero2", fzero.SimMesh(WORLD), data)
            core = patterns.train(p, "zero3", mesh, data, rank=rank)
            results[i] = {"core": differing(core, want), "engine": differing(_engine(p, 3, rank), _engine(p, 2, rank))}
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()

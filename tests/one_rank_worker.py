"""The process of tests/test_one_rank.py: one gloo rank, where a step reduces once after the backward rather than
unit by unit (`fzero.step.microstep.reduce_per_unit`), against the same step made to go unit by unit."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F

import fzero
from fzero.host import process_group
from fzero.step import microstep
from tests.engine_worker import case_config
from tests.spawn import init_worker, report
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

CASES = [(stage, micro, precision) for stage in range(4) for micro in (1, 2) for precision in ("fp32", "bf16")]


def _core(stage: int, micro: int, precision: str, mesh: fzero.DistMesh):
    model = tiny_gpt(0)
    policy = fzero.get_policy(None if precision == "fp32" else precision)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro, precision=policy, clip=1.0)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True)
    calls = []
    for batch in lm_batches(tiny_gpt(0), 1, micro, 2, 3, 5):
        state, metrics = step(state, {k: v[0] for k, v in batch.items()})
        calls.append(sum(c["calls"] for c in metrics["comm"].values()))
    return fzero.state_dict(state, mesh), calls


def _engine(stage: int, micro: int, precision: str, mesh: fzero.DistMesh):
    model = tiny_gpt(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on config keys
        engine, *_ = fzero.initialize(model=copy.deepcopy(model), config=case_config(stage, precision, micro, 2),
                                      mesh=mesh, printer=lambda *a: None)  # fmt: skip
    for batch in lm_batches(model, 1, micro, 2, 3, 5):
        logits = engine(batch["x"][0])
        engine.backward(F.cross_entropy(logits.float().flatten(0, 1), batch["y"][0].flatten()))
        engine.step()
    return engine.module_state_dict()


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    pays = microstep.reduce_per_unit
    results = {}
    try:
        for stage, micro, precision in CASES:
            microstep.reduce_per_unit = pays
            whole, whole_calls = _core(stage, micro, precision, mesh)
            engine_whole = _engine(stage, micro, precision, mesh)
            microstep.reduce_per_unit = lambda state, mesh: True
            units, unit_calls = _core(stage, micro, precision, mesh)
            engine_units = _engine(stage, micro, precision, mesh)
            results[f"{stage}-{micro}-{precision}"] = {
                "core": differing(whole, units),
                "engine": differing(engine_whole, engine_units),
                "calls": [whole_calls, unit_calls],
            }
    finally:
        microstep.reduce_per_unit = pays
    report(rank, out_dir, results)
    process_group.shutdown()

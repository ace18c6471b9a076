"""The 2-process half of tests/test_overlap.py: every preset with each unit's reduction overlapped with the
backward (in-flight budgets from one element to all), against the same run waiting for each reduction."""

from __future__ import annotations

import torch

import fzero
from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

BUDGETS = {"wait": None, "one unit": 1, "all": 10**9}  # None: no overlap; 1: each waits for the one before
CASES = [(preset, micro, reduce) for preset in ("zero0", "zero1", "zero2", "zero3") for micro in (1, 2)
         for reduce in ("fp32", "bf16")]  # fmt: skip


def _train(preset: str, micro: int, reduce: str, budget: int | None, mesh: fzero.DistMesh, rank: int):
    model = tiny_gpt(0)
    policy = fzero.Policy(reduce_dtype=torch.bfloat16) if reduce == "bf16" else None
    tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro, precision=policy)
    state = fzero.init(model, tx, mesh)
    gather = fzero.GatherPolicy(overlap_reduce=budget is not None, reduce_bucket_elements=budget or 1)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True, gather=gather)
    peaks = []
    for batch in lm_batches(tiny_gpt(0), 2, micro, 2, 3, 5):
        state, metrics = step(state, {k: v[rank] for k, v in batch.items()})
        peaks.append(metrics.get("reduce_in_flight_peak"))
    return fzero.state_dict(state, mesh), metrics["comm"], peaks


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    results = {}
    for preset, micro, reduce in CASES:
        runs = {k: _train(preset, micro, reduce, b, mesh, rank) for k, b in BUDGETS.items()}
        base, comm, _ = runs["wait"]
        results[f"{preset}-{micro}-{reduce}"] = {
            k: {"differ": differing(base, got), "same_comm": c == comm,
                "peaks": peaks}
            for k, (got, c, peaks) in runs.items()
        }  # fmt: skip
    results["decided"] = decisions(mesh)
    report(rank, out_dir, results)
    process_group.shutdown()


def decisions(mesh: fzero.DistMesh) -> dict[str, bool]:
    """`GatherPolicy(overlap_reduce=None).on(mesh)` on this gloo mesh (`fzero.sharding.policy.overlap_pays`)."""
    return {"undecided": bool(fzero.GatherPolicy().on(mesh).overlap_reduce)}

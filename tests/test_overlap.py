"""Overlapped reductions (`GatherPolicy(overlap_reduce=True)`, the config's `overlap_comm`): each unit's reduction
starts as its gradient completes and the backward goes on; the results are bitwise those that wait for each."""

from __future__ import annotations

import json

import pytest
import torch

import fzero
from tests import overlap_worker
from tests.spawn import spawn
from tests.support import lm_batches, lm_loss, tiny_gpt


@pytest.mark.timeout(600)
def test_overlap_changes_nothing_on_two_gloo_processes(tmp_path):
    spawn(overlap_worker.run, (2, str(tmp_path)), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results.pop("decided") == {
        "undecided": True
    }  # several processes: overlap (fzero.sharding.policy.overlap_pays)
    assert len(results) == len(overlap_worker.CASES)
    for case, runs in results.items():
        for budget, r in runs.items():
            # the same reductions, in the same order, summed in the same order: bitwise, the same ledger
            assert r["differ"] == [] and r["same_comm"], (case, budget)
        preset, micro, _ = case.split("-")
        per_unit = preset in ("zero2", "zero3") or micro == "1"  # 0-1 accumulate whole, then reduce once
        if per_unit:
            assert all(p == 0 for p in runs["wait"]["peaks"]), case  # nothing left in flight
            assert all(p > 0 for p in runs["all"]["peaks"]), case
            # a budget of one element: every reduction waits for the one before (one unit in flight at most)
            # (how many overlap depends on timing: a completed reduction lands as the next unit's gradient comes)
            assert max(runs["one unit"]["peaks"]) <= max(runs["all"]["peaks"]), case


def test_the_policy_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="reduce_bucket_elements must be an int >= 1"):
            fzero.GatherPolicy(overlap_reduce=True, reduce_bucket_elements=bad)
    with pytest.raises(ValueError, match="overlap_reduce must be a bool or None"):
        fzero.GatherPolicy(overlap_reduce="yes")
    # undecided until it meets a mesh; one process (a SimMesh) has nothing in flight to overlap
    assert fzero.GatherPolicy().overlap_reduce is None and fzero.GatherPolicy().reduce_budget is None
    assert fzero.GatherPolicy().on(fzero.SimMesh(2)).overlap_reduce is False
    assert fzero.GatherPolicy(overlap_reduce=True).on(fzero.SimMesh(2)).overlap_reduce is True


@pytest.mark.parametrize("preset", ["zero0", "zero2", "zero3"])
def test_overlap_on_a_simmesh_is_the_same_step(preset):
    """A SimMesh reduces at once: overlap is accepted and changes nothing."""
    model, mesh = tiny_gpt(0), fzero.SimMesh(2)
    tx = getattr(fzero, preset)(fzero.adamw(1e-2))
    out = []
    for overlap in (False, True):
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, lm_loss(model), tx, mesh, gather=fzero.GatherPolicy(overlap_reduce=overlap))
        for batch in lm_batches(tiny_gpt(0), 2, 1, 2, 2, 3):
            state, metrics = step(state, batch)
        out.append(fzero.state_dict(state))
        assert metrics["reduce_in_flight_peak"] == 0
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])

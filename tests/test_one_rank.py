"""One process: a step reduces its gradients once after the backward, not unit by unit (nothing to overlap the
reduction with: `fzero.step.microstep.reduce_per_unit`), and trains bitwise as the unit-by-unit step does."""

from __future__ import annotations

import json

import pytest

from tests import one_rank_worker
from tests.spawn import spawn


@pytest.mark.timeout(600)
def test_one_rank_reduces_once_and_changes_nothing(tmp_path):
    spawn(one_rank_worker.run, (1, str(tmp_path)), 1)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(one_rank_worker.CASES)
    for case, r in results.items():
        assert r["core"] == [] and r["engine"] == [], (case, r)
        stage, micro, _ = case.split("-")
        whole, units = r["calls"]
        if stage in ("2", "3") or micro == "1":  # (stages 0-1 accumulate whole, then reduce once either way)
            assert sum(whole) < sum(units), (case, r["calls"])

"""Ranks that do not run the same step (issue: silent desynchronisation). On 2 gloo processes:

- a rank that skips units another runs (layer drop, early exit) gets exactly SimMesh's result (the skipped units
  are gathered and reduced with zero gradients, as the ranks that ran them are);
- a rank whose forward raises makes every rank raise `fzero.DesyncError` in that step, before any update; a loop
  that catches it on every rank goes on in step, as if the step had never been taken;
- ranks at different steps raise `DesyncError` on every rank, in the first step.
"""

from __future__ import annotations

import json

import pytest
import torch

import fzero
from tests import desync_worker as w
from tests.spawn import spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("desync")
    spawn(w.run, (2, str(tmp)), 2)
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]


def sim(preset: str, autodiff: str, prefetch: int, data: list[dict]) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers
    try:
        return w.train(fzero.SimMesh(2), preset, autodiff, prefetch, data, None)[0]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("preset", "autodiff", "prefetch"), w.CASES)
def test_per_rank_skipped_units_equal_simmesh(runs, preset, autodiff, prefetch):
    key = f"{preset}-{autodiff}-{prefetch}"
    skips = w.SKIPS
    got, errors = runs[0][f"skip {key}"]
    assert errors == [None] * 4
    assert got == runs[1][f"skip {key}"][0]
    assert got == sim(preset, autodiff, prefetch, w.batches(2, skips))  # bitwise (2 ranks: a + b == b + a)
    assert got != sim(preset, autodiff, prefetch, w.batches(2, [[[], []]] * 4))  # the skips changed the result


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("preset", "autodiff", "prefetch"), w.CASES)
def test_a_rank_that_raises_fails_the_step_on_every_rank(runs, preset, autodiff, prefetch):
    key = f"{preset}-{autodiff}-{prefetch}"
    skips = w.SKIPS
    for rank in (0, 1):
        got, errors = runs[rank][f"fail {key}"]
        assert [e is None for e in errors] == [True, False, True, True], errors
        cause, in_step, text = errors[1]
        assert cause == ("ValueError" if rank == 1 else "NoneType") and in_step
        assert "rank 1: ValueError: a bad batch on this rank" in text and "still in step" in text
    # the abandoned step changed nothing: training went on as if its batch had never come
    data = w.batches(2, skips)
    assert got == sim(preset, autodiff, prefetch, [data[0], data[2], data[3]])


@pytest.mark.timeout(600)
def test_ranks_at_different_steps_raise_on_every_rank(runs):
    for rank in (0, 1):
        _, errors = runs[rank]["out of step"]
        assert errors[0] is not None and errors[0][1] is False, errors
        assert "out of step (rank 0: micro-step 0" in errors[0][2] and "rank 1: micro-step 1" in errors[0][2]


@pytest.fixture(scope="module")
def shell_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shell-desync")
    spawn(w.shell, (2, str(tmp)), 2)
    return [json.loads((tmp / f"shell-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_shell_checks_the_ranks_agree_as_the_core_does(shell_runs, stage):
    """`engine.step()` closes its micro-step with the core's own `MicroStep.close`: engines at different steps
    raise `DesyncError` on every rank, in the first step, before any update (and keep raising: nothing applied)."""
    for rank in (0, 1):
        run = shell_runs[rank][str(stage)]
        assert run["micro_steps"] == 0, run  # no step was taken on either rank
        for in_step, text in run["errors"]:
            assert in_step is False
            assert "out of step (rank 0: micro-step 0" in text and "rank 1: micro-step 1" in text

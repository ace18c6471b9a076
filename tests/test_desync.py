"""Ranks that do not run the same step (issue: silent desynchronisation). On 2 gloo processes:

- a rank that skips units another runs (layer drop, early exit) gets exactly SimMesh's result (the skipped units
  are gathered and reduced with zero gradients, as the ranks that ran them are);
- a rank whose forward raises makes every rank raise `fzero.DesyncError` in that step, before any update; a loop
  that catches it on every rank goes on in step, as if the step had never been taken;
- ranks at different steps raise `DesyncError` on every rank, in the first step;
- the same in the engine (`fzero.initialize` engines, stages 0-3), and an evaluation forward in which one rank exits
  early stays paired with the others'.
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


def check_failed_in_step(errors: list, rank: int) -> None:
    """Only the second step raised `DesyncError` on `rank`: from rank 1's ValueError on rank 1, from nothing on
    rank 0, naming rank 1's failure, the ranks still in step."""
    assert [e is None for e in errors] == [i != 1 for i in range(len(errors))], errors
    cause, in_step, text = errors[1]
    assert cause == ("ValueError" if rank == 1 else "NoneType") and in_step
    assert "rank 1: ValueError: a bad batch on this rank" in text and "still in step" in text


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("preset", "autodiff", "prefetch"), w.CASES)
def test_a_rank_that_raises_fails_the_step_on_every_rank(runs, preset, autodiff, prefetch):
    key = f"{preset}-{autodiff}-{prefetch}"
    skips = w.SKIPS
    for rank in (0, 1):
        got, errors = runs[rank][f"fail {key}"]
        assert len(errors) == 4
        check_failed_in_step(errors, rank)
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
def engine_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-desync")
    spawn(w.engine, (2, str(tmp)), 2)
    return [json.loads((tmp / f"engine-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_checks_the_ranks_agree_as_the_core_does(engine_runs, stage):
    """`engine.step()` closes its micro-step with the core's own `MicroStep.close`: engines at different steps
    raise `DesyncError` on every rank, in the first step, before any update (and keep raising: nothing applied)."""
    for rank in (0, 1):
        run = engine_runs[rank][str(stage)]
        assert run["micro_steps"] == 0, run  # no step was taken on either rank
        for in_step, text in run["errors"]:
            assert in_step is False
            assert "out of step (rank 0: micro-step 0" in text and "rank 1: micro-step 1" in text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_engine_rank_whose_forward_raises_fails_the_step_on_every_rank(engine_runs, stage):
    """The engine as the core: rank 1's `engine(...)` raises in step 2 (caught by a skip-the-bad-batch loop); every
    rank raises `DesyncError` in that step (rank 1 from its forward, rank 0 from `engine.step()`), still in step,
    nothing updated: the run equals one that never saw that batch, bitwise."""
    for rank in (0, 1):
        got, errors = engine_runs[rank][f"fail {stage}"]
        assert len(errors) == 4
        check_failed_in_step(errors, rank)
        assert got == engine_runs[rank][f"without {stage}"][0]
    assert engine_runs[0][f"fail {stage}"][0] == engine_runs[1][f"fail {stage}"][0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", ["backward", "gas"])
def test_an_engine_rank_that_fails_midway_fails_the_step_on_every_rank(engine_runs, stage, case):
    """As above, with rank 1 failing in its backward after the last blocks' gradients were complete (at stages 2-3
    already reduced: the rest are reduced as zeros), and failing in the second micro-step of an accumulation window
    of 2 (the window goes on with the next batch: bitwise a run that never saw the failed one)."""
    for rank in (0, 1):
        got, errors = engine_runs[rank][f"fail {case} {stage}"]
        assert len(errors) == (6 if case == "gas" else 4)
        check_failed_in_step(errors, rank)
        assert got == engine_runs[rank][f"without gas {stage}" if case == "gas" else f"without {stage}"][0]
    assert engine_runs[0][f"fail {case} {stage}"][0] == engine_runs[1][f"fail {case} {stage}"][0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_engine_evaluation_where_one_rank_exits_early(engine_runs, stage):
    """`engine(...)` under no_grad in which rank 1 skips the last blocks (at stage 3 it gathers them all the same,
    as the core's `eval_step` does): no hang, rank 0's outputs are those of a forward where nobody exits early, and
    training goes on with the ranks in step (the same parameters on both)."""
    early, full = (engine_runs[r][f"eval {stage}"] for r in (0, 1))
    assert early["early"] == early["full"]  # rank 0 ran every block either way
    assert full["early"] != full["full"]  # rank 1 did exit early
    assert early["params"] == full["params"]

"""Per-unit compilation (`fzero.sharding.compile`): the engine's `compile`, a `torch.compile`d model handed to
`initialize`, and `train_step(compile=...)`, on 2 gloo processes; at stages 1-3, in fp32, bf16 and fp16, and with the
habits a unit must survive (gradient accumulation, activation checkpointing, the optimizer offloaded, qwZ).

With the `aot_eager` backend the units run the aten graph dynamo and AOTAutograd traced, op for op as eager, so the
losses are bitwise eager's at every stage and precision: any difference is a wrong gather, a parameter swapped in
late, or a gradient lost between graphs. Dynamo's counters show one graph for the model's two blocks (the same
code), no graph break, no recompilation after the first step, and at most one for a last short batch. (Inductor
fuses the elementwise work, so its losses differ from eager's by rounding; that backend is exercised by
benchmarks, not here: its C++ compile costs a minute on two cores.)
"""

from __future__ import annotations

import json

import pytest

from . import compile_worker
from .spawn import spawn


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile")
    spawn(compile_worker.run, (2, str(out / "store"), str(out)), 2)
    return json.loads((out / "results.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["1-fp32", "3-bf16", *compile_worker.MIXED])
def test_compiled_units_train_as_eager(results, case):
    eager, compiled = results[f"{case}-eager"], results[f"{case}-compile"]
    assert compiled["losses"] == eager["losses"]
    assert len(set(eager["losses"])) > 1  # (steps were taken: fp16's loss scale did not skip them all)
    assert compiled.get("copy_bound", case in compile_worker.MIXED)  # a deep copy's compiled blocks: the copy's
    counts = compiled["counts"]
    assert all(c["breaks"] == 0 for c in counts), counts
    assert counts[0]["graphs"] == 1  # the two blocks share one graph
    assert counts[-1 if case in compile_worker.MIXED else compile_worker.STEPS - 1]["graphs"] == 1  # none after
    if len(counts) > compile_worker.STEPS and case not in compile_worker.MIXED:
        assert counts[-1]["graphs"] <= 2  # the last short batch: at most one more
    assert eager["counts"][-1]["graphs"] == 0  # (eager compiles nothing)


@pytest.mark.timeout(600)
def test_a_compiled_model_is_unwrapped_and_compiled_per_unit(results):
    wrapped = results["3-bf16-wrapped"]
    assert wrapped["unwrapped"]
    assert wrapped["losses"] == results["3-bf16-eager"]["losses"][: compile_worker.STEPS]


@pytest.mark.timeout(600)
def test_train_step_compile(results):
    core = results["core"]
    assert core["True"] == core["False"]


@pytest.mark.timeout(600)
def test_compile_refusals(results):
    e = results["errors"]
    assert e["schedule"].startswith("NotImplementedError: engine.compile(schedule=...) (DeepCompile)")
    assert e["autograd"].startswith("NotImplementedError: engine.compile(compiled_autograd_enabled=True)")
    assert e["kwargs"].startswith("TypeError: compile options ['fulgraph']")

"""Curriculum learning against DeepSpeed 0.19.8 (CPU accelerator): the schedules (`fzero.optim.curriculum`, and
`CurriculumScheduler` in `fzero.deepspeed`), the config's errors, the legacy `curriculum_learning` block in the
engine, the curriculum data sampler and its index files, and resuming both from fzero's checkpoints.

The engine runs (tests/curriculum_worker.py, two processes) do DeepSpeed's arithmetic exactly (fp32, ZeRO-1, two
accumulation steps: DeepSpeed divides each micro-batch's gradient by 2 and adds, fzero adds and divides once; dividing
by a power of two is exact, so both are the same sum), so losses are compared bitwise.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.config import parse_config
from fzero.config.schema import ConfigError, UnsupportedConfigError
from fzero.deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from fzero.optim import curriculum
from tests import curriculum_worker as w
from tests.spawn import spawn

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_scheduler(config):
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler as DS

    return DS(config)


@st.composite
def schedules(draw):
    lo = draw(st.integers(0, 300))
    hi = lo + draw(st.integers(0, 3000))
    kind = draw(st.sampled_from(["fixed_linear", "fixed_root", "fixed_discrete"]))
    if kind == "fixed_discrete":
        n = draw(st.integers(1, 4))
        config = {"difficulty": draw(st.lists(st.integers(0, 4000), min_size=n + 1, max_size=n + 1)),
                  "max_step": sorted(draw(st.lists(st.integers(0, 60), min_size=n, max_size=n)))}  # fmt: skip
    else:
        config = {"total_curriculum_step": draw(st.integers(1, 80)), "difficulty_step": draw(st.integers(1, 64))}
        if kind == "fixed_root":
            config["root_degree"] = draw(st.integers(1, 4))
    return {"min_difficulty": lo, "max_difficulty": hi, "schedule_type": kind, "schedule_config": config}


@settings(max_examples=150, deadline=None)
@given(schedules(), st.lists(st.integers(0, 120), min_size=1, max_size=40))
def test_schedules_are_deepspeeds(config, steps):
    """Any schedule, any sequence of steps (not only increasing: a resumed or custom caller's): every
    `get_difficulty` and `update_difficulty` is DeepSpeed's, value and type; the pure `advance` is the update."""
    ours, theirs = CurriculumScheduler(config), ds_scheduler(config)
    pure = CurriculumScheduler(config)._schedule
    current = config["min_difficulty"]
    for s in steps:
        got, want = ours.get_difficulty(s), theirs.get_difficulty(s)
        assert (got, type(got)) == (want, type(want)) and pure(s) == want
        got, want = ours.update_difficulty(s), theirs.update_difficulty(s)
        current = curriculum.advance(pure, current, s, config["max_difficulty"])
        assert got == want == current == ours.get_current_difficulty()
    restored = CurriculumScheduler(config)
    restored.load_state_dict(json.loads(json.dumps(ours.state_dict())))
    assert restored.update_difficulty(steps[-1] + 1) == ours.update_difficulty(steps[-1] + 1)


def test_custom_schedule():
    config = {"min_difficulty": 2, "max_difficulty": 10, "schedule_type": "custom"}
    ours, theirs = CurriculumScheduler(config), ds_scheduler(config)
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        ours.update_difficulty(1)
    for s in (ours, theirs):
        s.set_custom_get_difficulty(lambda step: (step * 3) % 13)
    assert [ours.update_difficulty(s) for s in range(12)] == [theirs.update_difficulty(s) for s in range(12)]


LEGACY_OK = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": 64,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
}


@pytest.mark.parametrize(
    ("block", "key", "error"),
    [
        ({"min_difficulty": None}, "curriculum_learning", ConfigError),
        ({"curriculum_type": None}, "curriculum_learning", ConfigError),
        ({"schedule_type": "linear"}, "curriculum_learning.schedule_type", ConfigError),
        ({"max_difficulty": 4}, "curriculum_learning", ConfigError),
        ({"schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8}},
         "curriculum_learning.schedule_config.total_curriculum_step", ConfigError),
        ({"schedule_config": {"total_step": 10, "difficulty_step": 8}},
         "curriculum_learning.schedule_config.total_step", ConfigError),
        ({"schedule_type": "fixed_root"}, "curriculum_learning.schedule_config", ConfigError),
        ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [1, 2], "max_step": [3, 4]}},
         "curriculum_learning.schedule_config.difficulty", ConfigError),
    ],
)  # fmt: skip
def test_legacy_config_errors_name_the_key(block, key, error):
    """A wrong value is named by its key; a missing one by its block, the key's name in the message (so that a
    config setting only `enabled` gets an error about that block)."""
    with pytest.raises(error) as info:
        parse_config({"train_batch_size": 2, "curriculum_learning": {**LEGACY_OK, **block}}, world=1)
    assert info.value.key == key


def test_data_efficiency_config():
    """DeepSpeed's defaults; the sampling block's errors name their key; dynamic batching is refused."""
    cfg = parse_config({"train_batch_size": 2}, world=1)["data_efficiency"]
    assert (cfg["enabled"], cfg["seed"]) == (False, 1234)
    sampling = cfg["data_sampling"]
    assert (sampling["num_epochs"], sampling["num_workers"], sampling["curriculum_learning"]["enabled"]) == (
        1000,
        0,
        False,
    )
    on = {
        "enabled": True,
        "data_cluster_path": "/tmp/c",
        "curriculum_metrics": {
            "m": {
                "difficulty_type": "value",
                "clustering_type": "schedule_based",
                "min_difficulty": 1,
                "max_difficulty": 2,
                "index_to_sample_path": "/tmp/s",
                "index_to_metric_path": "/tmp/m",
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1},
            }
        },
    }
    for change, key in (({"data_cluster_path": None}, ""),
                        ({"curriculum_metrics": {"m": {**on["curriculum_metrics"]["m"], "difficulty_type": None}}},
                         ".curriculum_metrics.m"),
                        ({"curriculum_metrics": {"m": {**on["curriculum_metrics"]["m"], "index_to_sample_path": None}}},
                         ".curriculum_metrics.m")):  # fmt: skip
        with pytest.raises(ConfigError) as info:
            parse_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {
                "curriculum_learning": {**on, **change}}}}, world=1)  # fmt: skip
        assert info.value.key == f"data_efficiency.data_sampling.curriculum_learning{key}"
    with pytest.raises(UnsupportedConfigError, match="dynamic_batching.enabled"):
        parse_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {"dynamic_batching": {
            "enabled": True}}}}, world=1)  # fmt: skip
    with pytest.raises(ConfigError, match="data_efficiency.seed"):
        parse_config({"train_batch_size": 2, "data_efficiency": {"seed": -1}}, world=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curriculum")
    spawn(w.run, (2, str(tmp)), 2)
    return [json.loads((tmp / f"results-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_legacy_block_is_deepspeeds(runs):
    """Every forward's curriculum_seqlen (evaluation forwards: none) and every micro-batch's global loss are
    DeepSpeed's, bitwise, over 4 steps of 2 accumulated micro-batches on 2 ranks."""
    for rank in (0, 1):
        ds, fz = runs[rank]["deepspeed"]["legacy"], runs[rank]["fzero"]["legacy"]
        assert fz["seen"] == ds["seen"] == [8, 8, None, 40, 40, None, 40, 40, None, 40, 40, None]
        assert fz["losses"] == ds["losses"]
        assert fz["accessors"] == [True, "seqlen"]


@pytest.mark.timeout(300)
def test_legacy_resume_is_bitwise(runs):
    """A checkpoint keeps the scheduler's state: after resuming, the difficulty stays 40 (the maximum was reached;
    a fresh scheduler would say 16), and losses equal the uninterrupted run's; the client state is the caller's."""
    r = runs[0]["fzero"]["legacy"]["resume"]
    assert r["seen_resumed"] == r["seen_uninterrupted"] == [40] * 4
    assert r["resumed"] == r["uninterrupted"]
    assert r["client"] == {"mine": 1}
    assert r["parts"] == {"curriculum_legacy": {"min_difficulty": 8, "max_difficulty": 32, "schedule_type":
                          "fixed_discrete", "schedule_config": {"difficulty": [8, 40, 16], "max_step": [1, 2]},
                          "current_difficulty": 40}}  # fmt: skip


@pytest.mark.timeout(300)
def test_data_sampler_is_deepspeeds(runs):
    """One value-based metric, then two (value and a custom percentile schedule): the indices of every
    micro-batch on every rank, over 10 global batches, are DeepSpeed's; the index files fzero writes are DeepSpeed's
    bytes."""
    for rank in (0, 1):
        for case in ("sampler1", "sampler2"):
            assert runs[rank]["fzero"][case] == runs[rank]["deepspeed"][case], (rank, case)
        assert runs[rank]["same_bytes"]
    assert runs[0]["fzero"]["sampler1"] != runs[1]["fzero"]["sampler1"]  # (each rank its share)


@pytest.mark.timeout(300)
def test_engine_data_sampling(runs):
    """initialize(training_data=...) with curriculum data sampling: the loader is DeepSpeed's kind and yields its
    batches; fzero's checkpoint resumes the sampler: the resumed batches are the uninterrupted run's."""
    for rank in (0, 1):
        ds, fz = runs[rank]["deepspeed"]["engine"], runs[rank]["fzero"]["engine"]
        assert fz["type"] == ds["type"] == "DeepSpeedDataLoader"
        assert fz["batches"] == ds["batches"]
        assert fz["resumed"] == fz["more"]
        assert fz["parts"] == ["data_sampler"]  # (the engine record's, not the client state's)


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # (NumPy absent: importing it raises ImportError)
import fzero, fzero.deepspeed, fzero.deepspeed.utils
from fzero.deepspeed.runtime import data_pipeline, dataloader
from fzero.deepspeed.runtime.data_pipeline import constants, curriculum_scheduler
from fzero.deepspeed.runtime.data_pipeline.data_routing import helper
assert curriculum_scheduler.CurriculumScheduler is fzero.engine.curriculum_scheduler.CurriculumScheduler
cfg = fzero.config.parse_config({"train_batch_size": 2, "data_efficiency": {"data_sampling": {"curriculum_learning": {
    "enabled": True, "data_cluster_path": "unused", "curriculum_metrics": {"m": {
        "difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 1, "max_difficulty": 2,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1}}}}}}},
    world=1)
try:
    dataloader.DeepSpeedDataLoader(range(4), 2, False, 0, None, deepspeed_dataloader_config={
        "curriculum_learning": True, "data_efficiency": cfg["data_efficiency"], "gradient_accumulation_steps": 1,
        "global_rank": 0, "data_sampling_num_workers": 0})
except ImportError as e:
    assert "curriculum data sampling" in str(e) and "pip install numpy" in str(e), e
else:
    raise AssertionError("no ImportError")
print("ok")
"""


def test_fzero_imports_without_numpy():
    """NumPy is optional: with it absent, fzero, its DeepSpeed namespace and the data pipeline's modules at DeepSpeed's
    paths import (the scheduler is the engine's own), and only building a curriculum data loader needs it, saying
    so."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", NO_NUMPY], capture_output=True, text=True,
                          timeout=120, check=False, cwd=root)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

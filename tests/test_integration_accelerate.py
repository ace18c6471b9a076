"""Accelerate's ordinary training loop on fzero (`fzero.integrations.accelerate.Accelerator`), 2 gloo processes.

A tiny GPT-2, ZeRO stages 2 and 3, accumulation 2, clipping 1.0, a decaying learning rate, 6 optimizer steps
(tests/accelerate_worker.py). Against Accelerate's own DDP run on the same data the runs differ only in the order
gradients are summed (per rank then across ranks, against DDP's bucketed all-reduce): float32, so tests/bounds.py's
kind 3 (Adam's step bound per element, and the detection threshold on the mean). Against the same training through
`fzero.deepspeed.initialize` directly the arithmetic is the same: bitwise. Resuming from Accelerate's
`save_state` at step 3 gives the uninterrupted run bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests import accelerate_worker as w
from tests.bounds import adam_check, assert_within
from tests.real_models import gpt2
from tests.spawn import spawn

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    spawn(w.worker, (2, str(out / "store"), str(out)), nprocs=2)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_fzero_matches_ddp_and_its_own_shell(runs, stage):
    out, results = runs
    got = load_file(out / f"fzero{stage}-{w.STEPS}-False.safetensors")
    ddp = load_file(out / f"ddp-{w.STEPS}-False.safetensors")
    shell = load_file(out / f"shell{stage}.safetensors")
    assert got.keys() == ddp.keys() == shell.keys()
    assert_within(adam_check(got, ddp, gpt2().state_dict(), w.LR, w.STEPS))
    assert all(torch.equal(got[k], shell[k]) for k in shell), "Accelerate's loop must be fzero's engine, bitwise"
    assert results[f"fzero{stage}"] == results[f"shell{stage}"]
    # the first window's losses: the same parameters, data and forward as DDP's, bitwise
    assert results[f"fzero{stage}"][: w.GAS] == results["ddp"][: w.GAS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_save_state_is_bitwise(runs, stage):
    out, results = runs
    whole = load_file(out / f"fzero{stage}-{w.STEPS}-False.safetensors")
    resumed = load_file(out / f"fzero{stage}-{w.STEPS}-True.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert results[f"fzero{stage}-resumed"] == results[f"fzero{stage}"][3 * w.GAS :]


@pytest.mark.timeout(600)
def test_clipping_other_than_the_configs_is_refused(runs):
    """Accelerate's DeepSpeed path would return the engine's norm and ignore max_norm: fzero refuses it."""
    message = runs[1]["refused_clip"]
    assert "max_norm=0.5" in message and '"gradient_clipping" (1.0)' in message


@pytest.mark.timeout(600)
def test_accelerates_deepspeed_switch_is_restored_when_the_accelerator_goes(runs):
    """Accelerate sets ACCELERATE_USE_DEEPSPEED for the process when given a DeepSpeed plugin: once fzero's
    Accelerator is collected it is as before, so a later plain Accelerator or Trainer does not take that path."""
    assert runs[1]["env_after"] is None


def test_an_accumulation_contradicting_the_config_is_refused():
    from fzero.integrations.accelerate import Accelerator

    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4.*\"gradient_accumulation_steps\": 2"):
        Accelerator(fzero_config=w.config(2) | {"gradient_accumulation_steps": 2}, gradient_accumulation_steps=4)


def test_a_config_file_that_is_not_json_is_named(tmp_path):
    from fzero.integrations.accelerate import load_config

    bad = tmp_path / "ds.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ValueError, match=str(bad)):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_config(tmp_path / "missing.json")

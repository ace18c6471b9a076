"""Hugging Face's `Trainer` on fzero (`fzero.integrations.transformers`), 2 gloo processes.

A tiny GPT-2, ZeRO stages 2 and 3, accumulation 2, clipping 1.0, the Trainer's AdamW and warmup-then-linear
schedule, 6 steps (tests/trainer_worker.py). Against the Trainer's own DDP run on the same data the runs differ only
in the order gradients are summed: float32, so tests/bounds.py's kind 3 (Adam's step bound per element, the
detection threshold on the mean); the learning rates are equal, the first loss bitwise, and the later losses,
gradient norms and held-out loss within the same detection threshold (`assert_tracks`).
Resuming from the Trainer's checkpoint gives the uninterrupted run bitwise; `save_model` writes the Hugging Face
format that `from_pretrained` loads strictly; a LoRA model saves its adapter alone.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests import trainer_worker as w
from tests.bounds import TRACKS, adam_check, assert_within
from tests.real_models import gpt2, lora
from tests.spawn import spawn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    spawn(w.worker, (2, str(out / "store"), str(out)), nprocs=2)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_fzero_matches_the_trainers_ddp(runs, stage):
    out, results = runs
    got, ddp = load_file(out / f"fzero{stage}.safetensors"), load_file(out / "ddp.safetensors")
    assert got.keys() == ddp.keys()
    assert_within(adam_check(got, ddp, gpt2().state_dict(), w.LR, w.STEPS))
    ours, theirs = results[f"fzero{stage}"], results["ddp"]
    assert ours["learning_rate"] == theirs["learning_rate"]  # (a function of the step alone)
    assert len(ours["loss"]) == len(theirs["loss"]) == w.STEPS
    # the first step's loss: the same parameters, data and forward, bitwise
    assert ours["loss"][0] == theirs["loss"][0]
    # later losses, the gradient norms and the held-out loss follow parameters that differ within the bound above:
    # kind 3's detection threshold on them (the mean difference, a small fraction of how far DDP's own moved)
    for key in ("loss", "grad_norm"):
        assert_tracks(ours[key], theirs[key])
    assert_tracks([results["fzero3-eval"]], [results["ddp-eval"]], start=theirs["loss"][0])
    assert results["engine"] == "fzero.engine.engine"


def assert_tracks(got: list[float], ref: list[float], start: float | None = None) -> None:
    """tests/bounds.py's detection threshold on a logged series: mean |got - ref| <= TRACKS * mean |ref - start|
    (`start`: the reference's first value). A threshold, not an error bound: a wrong mean, a skipped step or a
    scheduler stepped twice moves these by a large fraction of their own movement."""
    first = ref[0] if start is None else start
    diff = sum(abs(a - b) for a, b in zip(got, ref, strict=True)) / len(ref)
    moved = sum(abs(b - first) for b in ref) / len(ref)
    assert diff <= TRACKS * moved, (got, ref)


@pytest.mark.timeout(600)
def test_the_trainer_is_fzeros_engine_bitwise(runs):
    """The same arithmetic through `fzero.deepspeed.initialize` directly (the Trainer's groups, schedule and loss
    normalisation, tests/trainer_worker.shell): the Trainer adds nothing to fzero's step."""
    out, _ = runs
    got, shell = load_file(out / "fzero2.safetensors"), load_file(out / "shell2.safetensors")
    assert got.keys() == shell.keys() and all(torch.equal(got[k], shell[k]) for k in got)


@pytest.mark.timeout(600)
def test_resume_from_the_trainers_checkpoint_is_bitwise(runs):
    out, results = runs
    whole, resumed = load_file(out / "fzero3.safetensors"), load_file(out / "resumed.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # the resumed Trainer's history holds the checkpoint's first 3 steps, then its own
    assert results["resumed"] == results["fzero3"]


@pytest.mark.timeout(600)
def test_save_model_loads_strictly_as_the_consolidated_parameters(runs):
    from transformers import GPT2LMHeadModel

    out, results = runs
    loaded = GPT2LMHeadModel.from_pretrained(out / "saved").state_dict()
    ours = load_file(out / "fzero3.safetensors")
    assert loaded.keys() == ours.keys()
    assert all(torch.equal(loaded[k], ours[k]) for k in ours)
    assert results["sharded"], "from_pretrained under FzeroTrainingArguments at stage 3 must load into partitions"
    # and trains as the same checkpoint built whole does, bitwise
    assert results["whole"] and len(results["from-sharded"]["loss"]) == 2
    assert results["from-sharded"] == results["from-whole"]


@pytest.mark.timeout(600)
def test_lora_saves_its_adapter_alone_and_reloads(runs):
    from peft import PeftModel

    out, results = runs
    files = sorted(p.name for p in (out / "adapter").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    trained = load_file(out / "lora.safetensors")
    reloaded = PeftModel.from_pretrained(gpt2(), out / "adapter").state_dict()
    lora_keys = [k for k in trained if "lora_" in k]
    assert lora_keys and all(torch.equal(reloaded[k], trained[k]) for k in lora_keys)
    assert not all(torch.equal(trained[k], lora().state_dict()[k]) for k in lora_keys), "the adapter trained"
    assert len(results["lora"]["loss"]) == w.STEPS
    # the Trainer's checkpoint of a PEFT model: save_checkpoint(exclude_frozen_parameters=True), in a global_step dir
    assert (out / "lora" / "checkpoint-3" / "global_step3").is_dir()


def test_arguments_that_contradict_the_config_are_refused(tmp_path):
    from fzero.integrations.transformers import FzeroTrainer, FzeroTrainingArguments

    with pytest.raises(ValueError, match=r"(?s)contradicts the arguments.*gradient_accumulation_steps=4"):
        FzeroTrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, use_cpu=True, report_to=[],
                               fzero_config=w.config(2) | {"gradient_accumulation_steps": 4})  # fmt: skip
    with pytest.raises(ValueError, match="fzero_config"):
        FzeroTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="FzeroTrainingArguments"):
        FzeroTrainer(model=gpt2())
    import fzero.deepspeed

    assert sys.modules.get("deepspeed") is not fzero.deepspeed, "a refused FzeroTrainingArguments keeps no alias"
    assert not torch.distributed.is_initialized(), "nor the process group it made"

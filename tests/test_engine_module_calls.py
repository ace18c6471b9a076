"""The module's attributes and methods through the engine (`fzero.engine.module_calls`), a stage-3 module called
outside it, and `engine.tput_timer`, against DeepSpeed 0.19.8 on 2 gloo processes (tests/engine_calls_worker.py).

DeepSpeed passes unknown names to the module, and its hooks gather a stage-3 module's parameters around any call;
fzero runs the module's methods as its forward. With `torch_adam` AdamW and two ranks' commutative sums the
arithmetic is the same, so the outputs and losses are compared by their floats' bits.
"""

from __future__ import annotations

import json

import pytest

from tests import engine_calls_worker as w
from tests.spawn import spawn


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("module-calls")
    spawn(w.run, (2, str(tmp)), 2)
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("stage", [2, 3])
def test_methods_and_attributes_are_deepspeeds(results, stage):
    ds, fz = results[f"deepspeed-z{stage}"], results[f"fzero-z{stage}"]
    assert fz["tag"] == ds["tag"] == "critic" and fz["layers"] == ds["layers"] == "ModuleList"
    assert fz["missing"] == ds["missing"] == "AttributeError"
    assert fz["value"] == ds["value"]  # a method's output, without gradients, bitwise
    assert fz["losses"] == ds["losses"]  # trained on a method's output: the same updates


@pytest.mark.parametrize("stage", [2, 3])
def test_the_throughput_timer_counts_as_deepspeeds(results, stage):
    ds, fz = results[f"deepspeed-z{stage}"], results[f"fzero-z{stage}"]
    assert fz["timer"] == ds["timer"] == [1, 5, 5]  # epochs, micro-steps, global steps
    assert fz["timer_average_positive"] and ds["timer_average_positive"]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_module_called_directly_without_gradients_is_deepspeeds(results, stage):
    ds, fz = results[f"deepspeed-z{stage}"], results[f"fzero-z{stage}"]
    assert fz["direct"] == fz["engine"] == ds["direct"] == ds["engine"]


def test_a_stage3_module_called_outside_the_engine_with_gradients_is_a_named_error(results):
    message = results["fzero-z3"]["outside"]
    assert "called outside its engine, with gradients enabled, at ZeRO stage 3" in message
    assert "engine.generate(...)" in message and "torch.no_grad()" in message


def test_a_model_partitioned_by_deepspeed_itself_is_refused_by_name(results):
    """Its parameters are empty stand-ins whose values are in DeepSpeed's partitions: never trained as empty."""
    message = results["deepspeed_partitioned"]
    assert message.startswith("parameter 'layers.0.weight' was partitioned by DeepSpeed itself")
    assert "fzero.deepspeed.zero.Init" in message

"""`fzero.deepspeed.zero` (`Init`, `GatheredParameters`, `register_external_parameter`, the parameters' `ds_*`
attributes) and `fzero.deepspeed.utils.tensor_fragment`'s `safe_get_*` / `safe_set_*`, against DeepSpeed 0.19.8 itself
on its CPU accelerator, in the same processes (tests/deepspeed_zero_worker.py), on one gloo process and on two.

Where the arithmetic is the same the comparisons are bitwise: construction draws the same random numbers in the same
order; fzero's ZeRO-3 with AdamW (`torch_adam`) is DeepSpeed's step for step (tests/test_deepspeed_import.py), and the
reductions of two ranks are one commutative sum. So every value here is held with `torch.equal` and every loss by
its float's bits; nothing needed a tolerance.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fzero.deepspeed import zero
from tests import deepspeed_zero_worker as w
from tests.spawn import spawn

tensor_fragment = importlib.import_module("fzero.deepspeed.utils.tensor_fragment")
partition_parameters = importlib.import_module("fzero.deepspeed.runtime.zero.partition_parameters")
runtime_zero = importlib.import_module("fzero.deepspeed.runtime.zero")
DEEPSPEED = Path(importlib.util.find_spec("deepspeed").origin).parent  # (its source: read, not imported, here)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both libraries side by side, on one process and on two (one spawn each)."""
    out = {}
    for world in (1, 2):
        tmp = tmp_path_factory.mktemp(f"zero-{world}")
        spawn(w.run, (world, str(tmp)), world)
        out[world] = json.loads((tmp / "results.json").read_text())
    return out


@pytest.mark.timeout(900)
def test_init_builds_the_values_of_a_normal_construction_and_of_deepspeeds_init(runs):
    """Under `zero.Init` each parameter is an empty stand-in with DeepSpeed's attributes, its `ds_tensor` bitwise
    DeepSpeed's partition; gathered, the values are those of the model built normally with the same seed, and of
    DeepSpeed's `Init`; a parent's `apply` initialisation reaches its children; `enabled=False` builds normally.
    Under a bf16 config the values are rounded through bf16 (kept in fp32); `fzero.init` builds a `SimMesh` state from
    the partitions whose consolidated parameters are those values."""
    for world, r in runs.items():
        for key in ("attributes", "built_as_normal", "built_as_deepspeed", "status_inside", "apply_gathered"):
            assert r[key] is True, (world, key)
        assert r["disabled"] is True
        assert r["bf16_rounded"] is True and r["functional_init"] is True


@pytest.mark.timeout(900)
def test_init_on_nvme_keeps_the_partitions_in_files(runs):
    """`zero.Init` under a config whose `offload_param` is on `nvme`: the partitions are bitwise those kept in
    memory and `fzero.init` builds the same state from them, while the process's anonymous memory grows by less
    than a quarter of the partitions' bytes (what stays: each parameter's last partial page, the stand-ins), where
    the in-memory build (the control) grows by at least three quarters of them (its partitions are written zeros,
    then values: resident)."""
    for world, r in runs.items():
        assert r["nvme_bitwise"] is True, world
        assert r["nvme_grown"] < r["partition_bytes"] / 4, (world, r["nvme_grown"], r["partition_bytes"])
        assert r["memory_grown"] >= 3 * r["partition_bytes"] / 4, (world, r["memory_grown"], r["partition_bytes"])


@pytest.mark.timeout(900)
def test_a_write_lost_to_a_stand_in_is_an_error(runs):
    for r in runs.values():
        assert "Overwrites.__init__ wrote to its parameter 'a.weight'" in r["lost_write"]
        assert "GatheredParameters(param, modifier_rank=0)" in r["lost_write"]


@pytest.mark.timeout(900)
def test_gathered_parameters_before_initialize(runs):
    """Rank 0's write with `modifier_rank=0` lands in every rank's partition; a write without it is dropped."""
    for r in runs.values():
        assert r["written_before"] is True


@pytest.mark.timeout(900)
def test_training_with_writes_before_and_after_initialize_is_deepspeeds_bitwise(runs):
    """Six steps, with `GatheredParameters` writes before `initialize` and after step 3, and the `safe_set_*`
    writes after it: the losses are DeepSpeed's, bit for bit, on one process and on two."""
    for world, r in runs.items():
        assert r["after_initialize"] is True, world
        assert r["losses"]["fzero"] == r["losses"]["deepspeed"], world
        assert len(r["losses"]["fzero"]) == w.STEPS


@pytest.mark.timeout(900)
def test_gathered_parameters_after_initialize(runs):
    """Gathered after `initialize`, every parameter's value is DeepSpeed's; rank 0's write lands in fzero's fp32
    master. DeepSpeed's lands in its compute partition only (its next step would overwrite it from the master): the
    worker copies it over with DeepSpeed's own `refresh_fp32_params()` before the runs go on."""
    for r in runs.values():
        assert r["gathered_after"] is True
        assert r["deepspeed_keeps_it"] is False


@pytest.mark.timeout(900)
def test_safe_get_and_set_equal_deepspeeds(runs):
    """Full and local parameters, Adam's two moments and gradients (between backward and step) of every parameter
    equal DeepSpeed's, and the local fragments of the ranks put together are the full values; at stages 1 and 2 and
    with two micro-steps per step too (gradients there against DeepSpeed's stage 3, whose are the same sums)."""
    for world, r in runs.items():
        assert r["checks"] == "all equal", (world, r["checks"])
        assert r["checked"] >= 70
        for stage, found in r["stages"].items():
            equal, _, total = found.partition(" of ")
            assert equal == total.split()[0] and int(equal) > 0, (world, stage, found)


@pytest.mark.timeout(900)
def test_external_parameters(runs):
    """A weight used outside its unit's forward, registered before `initialize`, trains as DeepSpeed's; not
    registered too, at stage 3 (read after its unit's forward: gathered again, `Gatherer.read`) and at stage 2."""
    for world, r in runs.items():
        assert r["external"] == {
            "same_losses": True, "stage3_unregistered_same": True, "stage2_unregistered_same": True
        }, world  # fmt: skip


@pytest.mark.timeout(900)
def test_misuse_is_named(runs):
    for world, r in runs.items():
        e = r["errors"]
        assert e["outer_overlap"].startswith("RuntimeError: Nested GatheredParameters contexts cannot overlap")
        assert e["grad_outside"] == (
            "ValueError: Gradients are only available immediately after backward and before engine step"
        )
        assert "not one of an engine's" in e["no_engine"]
        assert e["bad_key"] == "ValueError: momentum_buffer not found in optimizer state fragment"
        assert f"modifier_rank must be a rank in [0, {world})" in e["bad_modifier"]
        assert e["mpu"].startswith("NotImplementedError: deepspeed.zero.Init(mpu=...) is not supported by fzero")
        assert e["tiled"].startswith("NotImplementedError: deepspeed.zero.TiledLinear is not supported by fzero")
        assert "safe_set_full_grad is not supported by fzero" in e["set_grad"]
        assert e["frozen_is_none"] == "None"


@pytest.mark.timeout(900)
def test_from_pretrained_loads_into_the_partitions(runs):
    """Hugging Face's `from_pretrained` with fzero's `HfDeepSpeedConfig` (ZeRO-3) builds the model under fzero's
    `zero.Init` and loads the checkpoint through `GatheredParameters`: partitioned, the checkpoint's values bitwise
    (under bf16: rounded through bf16, as into DeepSpeed's bf16 partitions), and its first step's loss that of the
    model loaded normally; the `import deepspeed` inside transformers got fzero's, and DeepSpeed's is back after."""
    for world, r in runs.items():
        assert r["pretrained"] == {
            "deepspeed_back": True,
            "partitioned": True,
            "loaded": True,
            "loaded_bf16": True,
            "trains_as_loaded": True,
        }, (world, r["pretrained"])


# ------------------------------------------------------------------------------------ in this process, no group
def _deepspeed_names(relative: str) -> list[str]:
    """The public classes and functions DeepSpeed's module defines or re-exports from its package."""
    tree = ast.parse((DEEPSPEED / relative).read_text())
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef) and not n.name.startswith("_")]
    names += [a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.level for a in n.names]
    return names


@pytest.mark.parametrize(
    ("module", "relative"),
    [
        (zero, "runtime/zero/__init__.py"),
        (runtime_zero, "runtime/zero/__init__.py"),
        (partition_parameters, "runtime/zero/partition_parameters.py"),
        (tensor_fragment, "utils/tensor_fragment.py"),
    ],
)
def test_every_deepspeed_name_is_there_or_refused_by_name(module, relative):
    names = _deepspeed_names(relative)
    assert len(names) > 8
    for name in names:
        try:
            getattr(module, name)
        except NotImplementedError as e:
            assert f".{name} is not supported by fzero: " in str(e)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018 (what a typo gets)


def test_outside_any_engine_or_partition_nothing_happens():
    """A parameter fzero does not hold: `GatheredParameters` leaves it alone, the getters give None (as
    DeepSpeed's), the setters say why they cannot write."""
    layer = nn.Linear(2, 2)
    before = layer.weight.detach().clone()
    with zero.GatheredParameters(layer.parameters(), modifier_rank=0), torch.no_grad():
        layer.weight.add_(1.0)  # a plain module: written directly, as without the context
    assert torch.equal(layer.weight, before + 1)
    assert tensor_fragment.safe_get_full_fp32_param(layer.weight) is None
    assert tensor_fragment.safe_get_local_optimizer_state(layer.weight, "exp_avg") is None
    with pytest.raises(ValueError, match="not one of an engine's"):
        tensor_fragment.safe_set_local_fp32_param(layer.weight, torch.zeros(4))
    assert not zero.is_zero_param(layer.weight)
    with pytest.raises(RuntimeError, match="Parameter is not a torch.nn.Parameter"):
        zero.register_external_parameter(layer, torch.zeros(2))
    zero.register_external_parameter(layer, layer.weight)
    assert [p for _, p in layer.ds_external_parameters()] == [layer.weight]
    zero.unregister_external_parameter(layer, layer.weight)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        zero.unregister_external_parameter(layer, layer.weight)


def test_init_options_fzero_does_not_have_are_refused_by_name():
    for kwargs in ({"zero_quantized_weights": True}, {"param_swapper": object()}):
        with pytest.raises(NotImplementedError, match=r"deepspeed\.zero\.Init\(.*\) is not supported by fzero"):
            zero.Init(**kwargs)
    for kwargs in ({"remote_device": "nvme"}, {"config_dict_or_path": {"zero_optimization": {"offload_param": {
            "device": "nvme"}}}}):  # fmt: skip
        with pytest.raises(ValueError, match=r"zero_optimization\.offload_param\.nvme_path, which is not set"):
            zero.Init(**kwargs)
    with pytest.raises(ValueError, match=r"remote_device='disk'\): expected None, 'cpu' or 'nvme'"):
        zero.Init(remote_device="disk")
    with zero.Init(enabled=False):
        layer = nn.Linear(3, 3)
    assert layer.weight.shape == (3, 3) and not hasattr(layer.weight, "ds_id")


def test_hf_deepspeed_config_tells_transformers(tmp_path):
    from transformers.integrations.deepspeed import (
        deepspeed_config,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    try:
        dschf = zero.HfDeepSpeedConfig(path)
        assert is_deepspeed_zero3_enabled() and deepspeed_config() == cfg
        assert dschf.is_offload() and not dschf.is_zero2()
        assert dschf.get_value("bf16.enabled") == "auto" and dschf.get_value("fp16.enabled", 0) == 0
        assert dschf.is_true("zero_optimization.stage") and not dschf.is_false("bf16.missing")
        dschf.del_config_sub_tree("zero_optimization.offload_param")
        assert dschf.get_value("zero_optimization.offload_param") is None
        with pytest.raises(ValueError, match="Can't find"):
            dschf.del_config_sub_tree("nothing.here", must_exist=True)
        del dschf  # (transformers holds a weak reference)
        assert not is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()

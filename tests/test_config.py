"""The DeepSpeed JSON config: DeepSpeed's defaults, the batch triad (every combination, DeepSpeed's exact messages),
each unsupported feature's error, unknown-key warnings, and fuzzed malformed configs that must all raise a
`ValueError`/`TypeError` naming the key, never anything else."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fzero.config import (
    SCHEMA,
    BatchSizeError,
    ConfigError,
    ConfigTypeError,
    ConfigWarning,
    UnsupportedConfigError,
    parse_config,
)
from fzero.config.batch import resolve_batch
from fzero.config.build import build_gather_policy, build_optimizer, build_transform, optimizer_spec
from fzero.config.schema import Bool, Int, ListOf, Nullable, Num, PerGroup, Section, Str

BASE = {"train_batch_size": 8}


def parse(extra: dict, world: int = 1):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # a typo in a test's config must not pass silently
        return parse_config({**BASE, **extra}, world=world)


# -------------------------------------------------------------------------------------------------------- defaults
def test_deepspeed_defaults():
    v = parse({}).values
    assert v["gradient_clipping"] == 1.0  # DeepSpeed 0.19.8: GRADIENT_CLIPPING_DEFAULT = 1.0 (runtime/constants.py)
    assert v["steps_per_print"] is None and v["wall_clock_breakdown"] is False
    assert parse({"steps_per_print": float("inf")}).values["steps_per_print"] is None  # never (Accelerate writes it)
    assert v["zero_optimization"]["stage"] == 0
    assert v["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert v["zero_optimization"]["allgather_bucket_size"] == 500_000_000
    assert v["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert v["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000
    assert v["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert v["fp16"] == {
        "enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1, "fp16_master_weights_and_grads": False,
    }  # fmt: skip
    assert v["bf16"]["enabled"] is False and v["bf16"]["check_grad_overflow"] is True
    assert v["optimizer"] is None and v["scheduler"] is None


def test_aliases_and_legacy_forms():
    cfg = parse({"zero_optimization": {"stage": 3, "cpu_offload": True, "prefetch_bucket_size": 7}})
    assert cfg.offload and cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 7
    assert parse({"zero_optimization": True}).stage == 1  # DeepSpeed's legacy boolean
    assert parse({"bfloat16": {"enabled": True}}).precision == "bf16"
    assert parse({"zero_optimization": {"reduce_bucket_size": 5e8}})["zero_optimization"]["reduce_bucket_size"] == 5e8
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: give either"):
        parse({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})


def test_optimizer_mapping():
    adam = optimizer_spec(parse({"optimizer": {"type": "adam", "params": {"lr": 0.1}}}))
    assert adam.kind == "adamw" and adam.hypers == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert optimizer_spec(parse({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})).kind == "adam"
    assert optimizer_spec(parse({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})).kind == "adamw"
    assert optimizer_spec(parse({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})).kind == "sgd"
    cyc = parse({"optimizer": {"type": "Adam"}, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}}})  # fmt: skip
    spec = optimizer_spec(cyc)
    assert spec.hypers["betas"][1] == 0.99 and spec.hypers["betas"][0](0) == 0.8  # DeepSpeed's OneCycle quirks
    warm = optimizer_spec(parse({"optimizer": {"type": "Adam", "params": {"lr": 0.5}},
                                 "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}))  # fmt: skip
    assert [warm.lr(n) for n in range(4)] == [0.0, 0.0, 0.5, 0.5]  # warmup_max_lr: the optimizer's lr (0.19)


def test_every_optimizer_type_maps_with_deepspeeds_defaults():
    """Lamb, Lion and Adagrad take DeepSpeed's parameter names and defaults (FusedLamb's, FusedLion's,
    torch.optim.Adagrad's); `bias_correction` holds for every group; the CPU runs build the native kernels."""

    def spec(kind, params=None):
        return optimizer_spec(parse({"optimizer": {"type": kind, "params": params or {}}}))

    lamb = spec("lamb")
    assert (lamb.kind, lamb.lr) == ("lamb", 1e-3)
    assert lamb.hypers == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0,
                           "min_coeff": 0.01}  # fmt: skip
    assert lamb.options == {"bias_correction": True, "eps_inside_sqrt": False}
    assert spec("Lion").hypers == {"betas": (0.9, 0.999), "weight_decay": 0.0} and spec("Lion").lr == 1e-3
    adagrad = spec("Adagrad")
    assert adagrad.lr == 1e-2
    assert adagrad.hypers == {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10}
    assert spec("Adam", {"bias_correction": False}).options == {"bias_correction": False}
    ams = spec("AdamW", {"torch_adam": True, "amsgrad": True})
    assert ams.options == {"amsgrad": True} and type(ams.build(offload=True).init(torch.ones(2))).__name__ == (
        "AMSGradState"
    )
    assert spec("Lion").build(cpu=True).features == spec("Adam").build(cpu=True).features  # the C kernels
    assert spec("Lamb").build(cpu=True).features == frozenset({"tensors"})  # torch's ops (no CPU Lamb kernel)
    with pytest.raises(ConfigError, match="optimizer.params.bias_correction: torch_adam builds torch.optim.AdamW"):
        parse({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "bias_correction": False}}})
    with pytest.raises(ConfigError, match="optimizer.params.min_coeff: 1 exceeds max_coeff 0.5"):
        parse({"optimizer": {"type": "Lamb", "params": {"min_coeff": 1, "max_coeff": 0.5}}})


def test_bias_correction_false_is_the_optimizers():
    import fzero

    opt = optimizer_spec(parse({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}})).build()
    ref = fzero.adamw(1e-3, weight_decay=0.0, bias_correction=False)
    p, g = torch.linspace(-1, 1, 9), torch.linspace(1, -2, 9)
    assert torch.equal(opt.update(g, opt.init(p), p)[0], ref.update(g, ref.init(p), p)[0])


def test_prescale_and_predivide_build_the_average():
    """The config's gradient options are the preset's `average`: the same values as the preset built by hand,
    bitwise, and not the default mean's."""
    import fzero
    from tests.support import mlp, regression_batches, regression_loss

    def train(tx):
        model = mlp([4, 3], 0)
        mesh = fzero.SimMesh(3)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, regression_loss(model), tx, mesh)
        for batch in regression_batches(model, 3, 1, 2, 2, 0):
            state, _ = step(state, batch)
        return fzero.state_dict(state)

    for extra, average in (({"prescale_gradients": True}, fzero.Average(prescale=True)),
                           ({"gradient_predivide_factor": 2.0}, fzero.Average(predivide=2.0))):  # fmt: skip
        cfg = parse({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2},
                     "train_batch_size": 6, **extra}, world=3)  # fmt: skip
        got = train(build_transform(cfg, build_optimizer(cfg)))
        want = train(fzero.zero2(fzero.sgd(0.1), average=average))
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_autotuning_is_accepted_with_one_warning_that_says_what_deepspeed_would_do():
    with pytest.warns(ConfigWarning, match=r"autotuning.enabled is ignored: fzero trains on\. DeepSpeed's engine .* "
                      r"profiles steps 2-4, writes autotuning_metric.json and exits") as record:  # fmt: skip
        parse_config({**BASE, "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 4,
                                             "fast": True, "arg_mappings": {}}})  # fmt: skip
    assert len(record) == 1
    parse({"autotuning": {"enabled": False, "fast": True}})  # off: silent


def test_torch_adam_takes_torch_defaults():
    """DeepSpeed's `torch_adam` builds torch.optim.AdamW / Adam from the config's params: an unset weight decay is
    torch's default (AdamW 0.01, Adam 0); without it DeepSpeed's FusedAdam / CPU Adam default, 0, applies."""

    def spec(params, kind="Adam"):
        return optimizer_spec(parse({"optimizer": {"type": kind, "params": params}}))

    assert spec({"torch_adam": True}).hypers["weight_decay"] == 0.01 and spec({"torch_adam": True}).torch_adam
    assert spec({"torch_adam": True}, "AdamW").hypers["weight_decay"] == 0.01
    assert spec({"torch_adam": True, "adam_w_mode": False}).hypers["weight_decay"] == 0.0
    assert spec({"torch_adam": True, "weight_decay": 0.3}).hypers["weight_decay"] == 0.3
    assert spec({}).hypers["weight_decay"] == 0.0 and not spec({}).torch_adam
    assert spec({"torch_adam": True}).build(offload=True).features == frozenset()  # torch's ops, not the C kernel


def test_per_group_scheduler_values_and_fzero_precision():
    params = {"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 1, "cycle_max_mom": [0.9, 0.95]}
    sched = parse({"scheduler": {"type": "OneCycle", "params": params}})["scheduler"]
    assert sched["params"]["cycle_min_lr"] == [0.1, 0.2] and sched["params"]["cycle_min_mom"] == 0.8
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_min_lr\[1\]: expected a finite number >= 0"):
        parse({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0.1, -1]}}})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_max_lr: expected .* got an empty list"):
        parse({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": []}}})
    assert parse({})["fzero_precision"] == {"round_initial_master": False}
    with pytest.raises(ConfigTypeError, match="fzero_precision.round_initial_master: expected true or false"):
        parse({"fzero_precision": {"round_initial_master": 1}})


# ------------------------------------------------------------------------------------------------ the batch triad
def deepspeed_triad(tbs, mb, gas, world):
    """DeepSpeed 0.19's `_set_batch_related_parameters` then `_batch_assertion`, transliterated (the reference)."""
    if tbs is not None and mb is not None and gas is not None:
        pass
    elif tbs is not None and mb is not None:
        gas = tbs // mb
        gas //= world
    elif tbs is not None and gas is not None:
        mb = tbs // world
        mb //= gas
    elif mb is not None and gas is not None:
        tbs = mb * gas * world
    elif tbs is not None:
        gas, mb = 1, tbs // world
    elif mb is not None:
        tbs, gas = mb * world, 1
    else:
        raise AssertionError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    for ok, message in (
        (tbs > 0, f"Train batch size: {tbs} has to be greater than 0"),
        (mb > 0, f"Micro batch size per gpu: {mb} has to be greater than 0"),
        (gas > 0, f"Gradient accumulation steps: {gas} has to be greater than 0"),
        (tbs == mb * gas * world, "Check batch related parameters. train_batch_size is not equal to "
         f"micro_batch_per_gpu * gradient_acc_step * world_size {tbs} != {mb} * {gas} * {world}"),
    ):  # fmt: skip
        if not ok:
            raise AssertionError(message)
    return tbs, mb, gas


TRIAD = [
    ((32, 4, 4, 2), (32, 4, 4)),
    ((32, 4, None, 2), (32, 4, 4)),
    ((32, None, 4, 2), (32, 4, 4)),
    ((None, 4, 4, 2), (32, 4, 4)),
    ((32, None, None, 2), (32, 16, 1)),
    ((None, 4, None, 2), (8, 4, 1)),
    ((None, None, 4, 2), "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
    ((None, None, None, 1), "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"),
    ((32, 4, 3, 2), "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                    "gradient_acc_step * world_size 32 != 4 * 3 * 2"),
    ((32, 5, None, 2), "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                       "gradient_acc_step * world_size 32 != 5 * 3 * 2"),
    ((30, None, 4, 2), "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                       "gradient_acc_step * world_size 30 != 3 * 4 * 2"),
    ((33, None, None, 2), "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                          "gradient_acc_step * world_size 33 != 16 * 1 * 2"),
    ((0, 4, None, 1), "Train batch size: 0 has to be greater than 0"),
    ((None, -2, None, 1), "Train batch size: -2 has to be greater than 0"),  # DeepSpeed derives tbs first
    ((8, -2, 2, 1), "Micro batch size per gpu: -2 has to be greater than 0"),
    ((8, 2, 0, 1), "Gradient accumulation steps: 0 has to be greater than 0"),
    ((4, 8, None, 1), "Gradient accumulation steps: 0 has to be greater than 0"),
    ((3, None, None, 4), "Micro batch size per gpu: 0 has to be greater than 0"),
]  # fmt: skip


@pytest.mark.parametrize(("given_", "expected"), TRIAD)
def test_batch_triad_table(given_, expected):
    tbs, mb, gas, world = given_
    cfg = {k: v for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mb),
                             ("gradient_accumulation_steps", gas)) if v is not None}  # fmt: skip
    if isinstance(expected, str):
        with pytest.raises(BatchSizeError) as e:
            parse_config(cfg, world=world)
        assert str(e.value) == expected  # DeepSpeed's message, word for word
        assert isinstance(e.value, ValueError)
    else:
        c = parse_config(cfg, world=world)
        assert (c.train_batch_size, c.micro_batch, c.gas) == expected


maybe = st.one_of(st.none(), st.integers(-3, 70))


@given(tbs=maybe, mb=maybe, gas=maybe, world=st.integers(1, 8))
def test_batch_triad_matches_deepspeed(tbs, mb, gas, world):
    """Every combination against the transliterated reference: the same values, or the same message (where
    DeepSpeed divides by zero, fzero names the offending key instead)."""
    try:
        want: object = deepspeed_triad(tbs, mb, gas, world)
    except ZeroDivisionError:
        want = ZeroDivisionError
    except AssertionError as e:
        want = str(e)
    try:
        got: object = resolve_batch(tbs, mb, gas, world)
    except BatchSizeError as e:
        got = str(e)
        assert e.key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if want is ZeroDivisionError:
        assert isinstance(got, str) and "has to be greater than 0" in got
    else:
        assert got == want


# ------------------------------------------------------------------------------------------- unsupported features
UNSUPPORTED = [
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
     "zero_optimization.offload_optimizer.super_offload"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type"),
    ({"optimizer": {"type": "rmsprop", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"optimizer": {"type": "Lamb", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "Adagrad", "params": {"maximize": True}}}, "optimizer.params.maximize"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
    ({"scheduler": {"type": "LRRangeTest"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
     "scheduler.params.last_batch_iteration"),
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "expert_parallel.enabled"),
    ({"weight_quantization": {"post_init_quant": {"fc": {}}}}, "weight_quantization.post_init_quant"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, "torch_autocast.dtype"),
    ({"flops_profiler": {"enabled": True}}, "flops_profiler.enabled"),
    ({"comms_logger": {"enabled": True}}, "comms_logger.enabled"),
    ({"memory_breakdown": True}, "memory_breakdown"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
    ({"elasticity": {"enabled": True}}, "elasticity.enabled"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training"),
    ({"quantize_training": {"enabled": True}}, "quantize_training"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "key"), UNSUPPORTED, ids=[k for _, k in UNSUPPORTED])
def test_unsupported_features_raise(extra, key):
    with pytest.raises(UnsupportedConfigError) as e:
        parse(extra)
    assert e.value.key == key
    assert str(e.value).startswith(f"{key}: ") and "not supported" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, NotImplementedError)


def test_an_unsupported_open_block_is_shown_as_written():
    with pytest.raises(
        UnsupportedConfigError, match=r"sparse_attention: \{'mode': 'fixed'\} \(dict\) is not supported"
    ):
        parse({"sparse_attention": {"mode": "fixed"}})


def test_disabled_features_are_accepted():
    parse({"amp": {"enabled": False}, "tensorboard": {"enabled": False, "output_path": "x"},
           "zero_optimization": {"offload_param": {"device": "none"}, "zero_quantized_weights": False},
           "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4},
           "checkpoint": {"tag_validation": "Warn"}, "pipeline": {"stages": "auto"}})  # fmt: skip


def test_deepspeeds_other_top_level_keys_are_known():
    """DeepSpeed 0.19.8's top-level keys that change nothing in fzero are accepted without the unknown-key warning
    (`parse` turns that warning into an error)."""
    parse({"timers": {"throughput": {"enabled": True, "synchronized": False}}, "log_level": "info",
           "graph_harvesting": True, "datastates_ckpt": None, "data_parallel_size": 1, "disable_allgather": True,
           "vocabulary_size": 50257, "allgather_size": 1000, "use_data_before_expert_parallelism": False,
           "gradient_allreduce_op": "mean",
           "managed_gradient_accumulation": True, "weight_quantization": None,
           "expert_parallel": {"enabled": False}})  # fmt: skip


def test_offload_builds_the_preset_with_offload():
    cfg = parse({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                 "optimizer": {"type": "AdamW"}})  # fmt: skip
    assert cfg.offload
    build_transform(cfg, build_optimizer(cfg))


# --------------------------------------------------------------------------------------- unknown keys, bad values
def test_unknown_keys_warn_naming_them():
    with pytest.warns(ConfigWarning) as record:
        cfg = parse_config({**BASE, "trian_batch_size": 8, "zero_optimization": {"stagee": 2},
                            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}})  # fmt: skip
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("trian_batch_size", "zero_optimization.stagee", "optimizer.params.momentun"):
        assert key in message
    assert cfg.unknown == ("optimizer.params.momentun", "trian_batch_size", "zero_optimization.stagee")


BAD = [
    ({"zero_optimization": {"stage": "2"}}, ConfigTypeError, "zero_optimization.stage: expected an integer in [0, 3]"),
    ({"zero_optimization": {"stage": 4}}, ConfigError, "zero_optimization.stage: expected an integer in [0, 3], got 4"),
    ({"zero_optimization": {"stage": 2.5}}, ConfigTypeError, "zero_optimization.stage"),
    ({"zero_optimization": 3}, ConfigTypeError, "zero_optimization: expected an object"),
    ({"fp16": {"enabled": "true"}}, ConfigTypeError, "fp16.enabled: expected true or false, got 'true' (str)"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ConfigError, "fp16 and bf16 cannot both be enabled"),
    ({"fp16": {"loss_scale": -1}}, ConfigError, "fp16.loss_scale: expected a finite number >= 0"),
    ({"fp16": {"hysteresis": 0}}, ConfigError, "fp16.hysteresis: expected an integer >= 1, got 0"),
    ({"train_batch_size": "auto"}, ConfigTypeError, "train_batch_size: expected an integer, got 'auto' (str) ('auto"),
    ({"gradient_clipping": -1.0}, ConfigError, "gradient_clipping: expected a finite number >= 0"),
    ({"gradient_clipping": math.nan}, ConfigError, "gradient_clipping: expected a finite number >= 0, got nan"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -0.1}}}, ConfigError, "optimizer.params.lr"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, ConfigError, "optimizer.params.betas: expected a "
                                                                               "list of 2 values"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, ConfigError, "optimizer.params.betas[1]"),
    ({"optimizer": {"type": "Adamm"}}, ConfigError, "optimizer.type: expected one of 'Adam', 'AdamW', 'SGD'"),
    ({"optimizer": {"params": {}}}, ConfigError, "optimizer.type: is required"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, ConfigError, "optimizer.params.nesterov"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ConfigError, "scheduler.params.total_num_steps: is "
                                                                          "required"),
    ({"scheduler": {"type": "warmuplr"}}, ConfigError, "scheduler.type: expected one of 'WarmupLR'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, ConfigError,
     "scheduler.params.warmup_type: expected one of 'log', 'linear'"),
    ({"zero_optimization": {"allgather_bucket_size": 3}}, ConfigError, "allgather_bucket_size: must be a multiple"),
    ({"steps_per_print": 0}, ConfigError, "steps_per_print: expected an integer >= 1, got 0"),
    ({"zero_optimization": {"reduce_bucket_size": 10**30}}, ConfigError, "zero_optimization.reduce_bucket_size"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "kind", "message"), BAD, ids=[m.split(":")[0] for _, _, m in BAD])
def test_bad_values_name_the_key(extra, kind, message):
    with pytest.raises(kind) as e:
        parse(extra)
    assert message in str(e.value)


def test_json_files(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 1}}))
    assert parse_config(str(good)).stage == 1 and parse_config(good).source == str(good)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 4,\n "zero_optimization": {"stage": 1,}}')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 2, column 35"):
        parse_config(bad)
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    with pytest.raises(ConfigTypeError, match="array.json: the config must be a JSON object, got a list"):
        parse_config(array)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        parse_config(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------------- the fuzzer
VALID = {
    "train_batch_size": 16, "gradient_accumulation_steps": 2, "steps_per_print": 5, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "none"}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
    "fzero_metrics": {"warmup_steps": 1, "seq_length": 16},
}  # fmt: skip

PATHS = [p for p, _ in SCHEMA.paths()] + [
    "optimizer.type", "optimizer.params", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay", "optimizer.params.adam_w_mode", "optimizer.params.torch_adam", "scheduler.type",
    "scheduler.params", "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_type",
]  # fmt: skip
JSONISH = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-3, 4), st.sampled_from([0.0, 0.5, 1.0, 1e-3, 1e9, 5e8, -1.0, 2**64]),
        st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(["", "auto", "cpu", "none", "Adam", "log", "fp16", "WarmupLR"]), st.text(max_size=5),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=5,
)  # fmt: skip


SPECS = dict(SCHEMA.paths())
NUMBERS = st.one_of(st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True))


def typed(spec) -> st.SearchStrategy:
    """Values of the type a spec expects, most of them out of range: they reach the range checks and the build."""
    if isinstance(spec, Nullable):
        return st.one_of(st.none(), typed(spec.inner))
    if isinstance(spec, Int):
        return st.one_of(st.integers(-3, 10**6), st.integers())
    if isinstance(spec, Num):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3))
    if isinstance(spec, Bool):
        return st.booleans()
    if isinstance(spec, Str):
        return st.sampled_from([*(spec.choices or ()), "bogus", ""])
    if isinstance(spec, ListOf):
        return st.lists(typed(spec.inner), max_size=3)
    if isinstance(spec, PerGroup):  # one group here: a list of another length is an error naming the key
        return st.one_of(typed(spec.inner), st.lists(typed(spec.inner), max_size=3))
    return JSONISH


def mutation(path: str) -> st.SearchStrategy:
    value = typed(SPECS[path]) if path in SPECS else st.one_of(NUMBERS, st.booleans(), st.sampled_from(["linear"]))
    return st.tuples(st.just(path), st.one_of(JSONISH, value))


def _set(cfg: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = cfg
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value
    return cfg


BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
CROSS = {"bf16.enabled", "fp16.min_loss_scale", "zero_optimization.allgather_bucket_size", "optimizer.params.nesterov"}


def _related(error_key: str, path: str) -> bool:
    if error_key in CROSS or (path in BATCH_KEYS and error_key in BATCH_KEYS):
        return True
    return (
        error_key == path
        or error_key.startswith(path + ".")
        or error_key.startswith(path + "[")
        or (path.startswith(error_key + "."))
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(st.sampled_from(PATHS).flatmap(mutation), min_size=1, max_size=2))
def test_fuzzed_configs_fail_cleanly(mutations):
    """Malformed configs raise a ConfigError (ValueError, or TypeError for types) naming a mutated key; valid
    ones build an optimizer and a transform chain without error. Nothing else may escape."""
    cfg = json.loads(json.dumps(VALID))
    for path, value in mutations:
        cfg = _set(cfg, path, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = parse_config(cfg, world=2)
            opt = build_optimizer(parsed)
            if opt is not None:
                build_transform(parsed, opt)
                spec = optimizer_spec(parsed)
                for n in range(3):  # the schedule evaluates
                    spec.lr(n) if callable(spec.lr) else spec.lr
    except ConfigError as e:
        assert isinstance(e, (ValueError, TypeError))
        assert any(_related(e.key, p) for p, _ in mutations), (e.key, mutations)
        if not isinstance(e, BatchSizeError):
            assert str(e).startswith(e.key) or e.key == "", str(e)


def test_schema_paths_cover_nested_sections():
    paths = dict(SCHEMA.paths())
    assert "zero_optimization.offload_optimizer.device" in paths
    assert isinstance(paths["zero_optimization"], Section) and isinstance(paths["train_batch_size"], Nullable)


@pytest.mark.parametrize(
    ("zero", "overlap"),
    [({"stage": 3}, None), ({"stage": 2}, None), ({"stage": 1}, None), ({"stage": 2, "overlap_comm": True}, True),
     ({"stage": 3, "overlap_comm": False}, False)],
)  # fmt: skip
def test_overlap_comm_and_reduce_bucket_size_take_effect(zero, overlap):
    """overlap_comm as given; unset, undecided (None: `GatherPolicy.on(mesh)` decides per machine, not DeepSpeed's
    stage-3-only default); reduce_bucket_size bounds the gradient elements in flight."""
    policy = build_gather_policy(parse({"zero_optimization": {**zero, "reduce_bucket_size": 1234}}))
    assert policy.overlap_reduce is overlap
    assert policy.reduce_bucket_elements == 1234
    assert policy.reduce_budget == (1234 if overlap else None)


@pytest.mark.parametrize(("value", "distance"), [(None, 0), (5, 5), (1e9, 10**9), (0, 0)])
def test_stage3_max_reuse_distance_takes_effect(value, distance):
    """A value given is the policy's, DeepSpeed's rule (`test_zero3.test_reuse_distance_keeps_the_units_deepspeed_keeps`
    shows which units it keeps); unset, 0: stage 3's least memory, where DeepSpeed's implicit 1e9 would hold a small
    model's every unit gathered at the forward's end."""
    zero = {"stage": 3} if value is None else {"stage": 3, "stage3_max_reuse_distance": value}
    assert build_gather_policy(parse({"zero_optimization": zero})).reuse_distance == distance

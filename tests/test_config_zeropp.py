"""DeepSpeed's ZeRO++ (`zero_hpz_partition_size`, `zero_quantized_weights`, `zero_quantized_nontrainable_weights`,
`zero_quantized_gradients`) and MiCS (`mics_shard_size`, `mics_hierarchical_params_gather`) config keys: parsing,
DeepSpeed's rules as errors naming the key, the stage < 3 no-ops, the mesh and `fzero.zero3` arguments they map
to, `fzero.initialize` on 4 gloo processes against the functional core bitwise, and `fzero train`'s flags
(docs/hybrid.md, "From a DeepSpeed config")."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fzero
from fzero import cli
from fzero.commands import train as train_command
from fzero.config import ConfigError, ConfigWarning, parse_config
from fzero.config.build import build_transform
from fzero.config.zeropp import zero_mesh_shape, zeropp_arguments
from fzero.host.hostmem import VARIABLE
from tests import zeropp_worker
from tests.spawn import spawn
from tests.support import tiny_gpt

BASE = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather")  # fmt: skip


def parse(zero: dict, world: int = 4, **top):
    """The config, with any `ConfigWarning` an error (the tests that expect one catch it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        return parse_config({**BASE, **top, "zero_optimization": zero}, world=world)


def mapped(zero: dict, world: int = 4, **top):
    cfg = parse(zero, world, **top)
    return zero_mesh_shape(cfg), zeropp_arguments(cfg)


# ----------------------------------------------------------------------------------------------------- parsing
def test_defaults_are_deepspeeds_and_off():
    zero = parse({"stage": 3}).values["zero_optimization"]
    assert [zero[k] for k in KEYS] == [1, False, False, False, -1, False]  # DeepSpeed's zero/config.py defaults
    assert mapped({"stage": 3}) == (None, {})


SHAPE = {"replicate": 2, "shard": 2}
MAPPINGS = [
    # the ZeRO++ tutorial's keys, its hpZ group 2 of 4 ranks; on one node (no launcher's LOCAL_WORLD_SIZE) qgZ does
    # nothing, as DeepSpeed's (several nodes: tests/test_multinode.py)
    ({"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True}, 4,
     (SHAPE, {"hpz": True, "qwz": True, "qwz_frozen": True})),
    ({"zero_quantized_nontrainable_weights": True}, 4, (None, {"qwz_frozen": True})),
    ({"zero_hpz_partition_size": 2}, 8, ({"replicate": 4, "shard": 2}, {"hpz": True})),
    ({"zero_hpz_partition_size": 4}, 4, (None, {})),  # a group of every rank: the primary shard, plain stage 3
    ({"zero_hpz_partition_size": 16}, 4, (None, {})),  # DeepSpeed's min(N, W)
    ({"zero_hpz_partition_size": 2, "zero_quantized_weights": True}, 1,
     (None, {"qwz": True, "qwz_frozen": True})),  # one rank
    ({"zero_hpz_partition_size": 0}, 4, (None, {})),  # 0 and 1: off (DeepSpeed's ge=0, acts when > 1)
    ({"mics_shard_size": 2}, 4, (SHAPE, {"hybrid": True})),
    ({"mics_shard_size": 2, "mics_hierarchical_params_gather": True}, 4, (SHAPE, {"hybrid": True})),
    ({"mics_shard_size": 1}, 4, ({"replicate": 4, "shard": 1}, {"hybrid": True})),
    ({"mics_shard_size": 4}, 4, (None, {})),  # one shard group: the 1-D preset, bitwise
    ({"mics_shard_size": 4, "offload_optimizer": {"device": "cpu"}}, 4, (None, {})),  # nothing to all-reduce
    ({"mics_shard_size": 0}, 4, (None, {})),  # <= 0: off (DeepSpeed's `mics_shard_size > 0`)
    ({"mics_shard_size": -3}, 4, (None, {})),
]  # fmt: skip


@pytest.mark.parametrize(("zero", "world", "want"), MAPPINGS, ids=[f"{z}-w{w}" for z, w, _ in MAPPINGS])
def test_stage3_keys_map_to_a_mesh_and_zero3_arguments(zero, world, want):
    assert mapped({"stage": 3, **zero}, world) == want


def test_build_transform_passes_nothing_new_for_plain_configs():
    """Configs without the keys (or with them at a no-op value) build exactly the chain they built before."""
    opt = fzero.adamw(1e-3)
    plain = build_transform(parse({"stage": 3}), opt)
    for zero in ({"mics_shard_size": 4}, {"zero_hpz_partition_size": 1}, {"zero_hpz_partition_size": 4}):
        assert [n for n, _ in build_transform(parse({"stage": 3, **zero}), opt).children] == [
            n for n, _ in plain.children
        ]


# ------------------------------------------------------------------------------------------------ their errors
ERRORS = [
    # DeepSpeed's rules: utils/groups.py `_ensure_divisibility(world, min(N, world))`, mics_utils.py
    # `_generate_mics_config`, stage3.py's "when enable all_to_all_reduce, reduce_scatter should also be enabled"
    ({"zero_hpz_partition_size": 3}, 4, {}, "zero_hpz_partition_size", "3 does not divide the world size 4"),
    ({"mics_shard_size": 3}, 4, {}, "mics_shard_size", "3 does not divide the world size 4"),
    ({"mics_shard_size": 8}, 4, {}, "mics_shard_size", "8 does not divide the world size 4"),
    ({"mics_shard_size": 2}, 1, {}, "mics_shard_size", "2 does not divide the world size 1"),
    ({"mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}, 4, {}, "mics_shard_size",
     "with offload_optimizer"),
    ({"zero_quantized_gradients": True, "reduce_scatter": False}, 4, {}, "zero_quantized_gradients",
     "needs reduce_scatter true"),
    # combinations DeepSpeed has no mode for
    ({"zero_hpz_partition_size": 2, "mics_shard_size": 2}, 4, {}, "zero_hpz_partition_size", "give one of them"),
    ({"mics_shard_size": 2, "zero_quantized_nontrainable_weights": True}, 4, {},
     "zero_quantized_nontrainable_weights", "not supported with mics_shard_size"),
    ({"zero_quantized_gradients": True}, 4, {"prescale_gradients": True}, "zero_quantized_gradients",
     "takes no prescale_gradients"),
    ({"zero_quantized_gradients": True}, 4, {"gradient_predivide_factor": 2.0}, "zero_quantized_gradients",
     "gradient_predivide_factor"),
    # types and ranges (DeepSpeed's pydantic fields: hpZ `ge=0`)
    ({"zero_hpz_partition_size": -1}, 4, {}, "zero_hpz_partition_size", "expected an integer >= 0, got -1"),
    ({"zero_quantized_weights": 1}, 4, {}, "zero_quantized_weights", "expected true or false"),
    ({"mics_shard_size": "2"}, 4, {}, "mics_shard_size", "expected an integer"),
]  # fmt: skip


@pytest.mark.parametrize(("zero", "world", "top", "key", "message"), ERRORS, ids=[e[3] + "-" + e[4] for e in ERRORS])
def test_rules_raise_naming_the_key(zero, world, top, key, message):
    """Every rule fails with a ConfigError naming the key, at parse time or, for the world size's, when the chain
    is built (`build_transform`, which `fzero.initialize` runs)."""
    with pytest.raises(ConfigError) as e:
        build_transform(parse({"stage": 3, **zero}, world, **top), fzero.adamw(1e-3))
    assert e.value.key == f"zero_optimization.{key}"
    assert str(e.value).startswith(f"zero_optimization.{key}: ") and message in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------- the no-op warnings
ON = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True,
      "zero_quantized_gradients": True, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("key", KEYS)
def test_below_stage_3_each_key_is_a_noop_with_a_warning(stage, key):
    """DeepSpeed hands these keys to its stage-3 optimizer only: below it they change nothing, here too (never
    stage 1-2's own qwz/qgz), and a ConfigWarning names the key."""
    with pytest.warns(ConfigWarning, match=rf"zero_optimization\.{key} is ignored at stage {stage}: .*stage 3 only"):
        cfg = parse_config({**BASE, "zero_optimization": {"stage": stage, key: ON[key]}}, world=4)
    assert zero_mesh_shape(cfg) is None and zeropp_arguments(cfg) == {}
    plain = parse({"stage": stage})
    opt = fzero.adamw(1e-3)
    assert [n for n, _ in build_transform(cfg, opt).children] == [n for n, _ in build_transform(plain, opt).children]


def test_one_warning_names_every_ignored_key():
    with pytest.warns(ConfigWarning) as record:
        parse_config({**BASE, "zero_optimization": {"stage": 2, **{k: v for k, v in ON.items() if "mics" not in k}}})
    assert len(record) == 1
    assert "zero_hpz_partition_size, zero_optimization.zero_quantized_weights, " in str(record[0].message)


@pytest.mark.parametrize(
    ("zero", "ignored"),
    [({"mics_shard_size": 2, "zero_quantized_weights": True}, "zero_quantized_weights is ignored with mics"),
     ({"mics_shard_size": 2, "zero_quantized_gradients": True}, "zero_quantized_gradients is ignored with mics"),
     ({"mics_hierarchical_params_gather": True}, "mics_hierarchical_params_gather is ignored without mics")],
)  # fmt: skip
def test_stage3_keys_deepspeed_ignores_warn(zero, ignored):
    """DeepSpeed's MiCS optimizer is built without qgZ's groups and its gather drops the quantization; the
    hierarchical gather is MiCS's alone."""
    with pytest.warns(ConfigWarning, match=ignored):
        cfg = parse_config({**BASE, "zero_optimization": {"stage": 3, **zero}}, world=4)
    assert zeropp_arguments(cfg) == ({"hybrid": True} if "mics_shard_size" in zero else {})


def test_mics_hierarchical_gather_is_silent_with_mics():
    """It schedules MiCS's all-gather in two hops (inter-node, then intra-node): the same gathered values."""
    assert mapped({"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}) == (
        SHAPE,
        {"hybrid": True},
    )


# ----------------------------------------------------------------------------------------------- the engine's mesh
def test_initialize_refuses_a_mesh_of_another_shape():
    config = {**BASE, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    for mesh, shape in ((fzero.SimMesh(4), "1-D"), (fzero.SimMesh(shape={"shard": 2, "replicate": 2}), "{'shard': 2")):
        with pytest.raises(ConfigError) as e:
            fzero.initialize(model=tiny_gpt(0), config=config, mesh=mesh)
        assert e.value.key == "zero_optimization.mics_shard_size"
        assert "asks for a mesh of shape {'replicate': 2, 'shard': 2} on 4 ranks" in str(e.value)
        assert f"the mesh given has shape {shape}" in str(e.value)


def test_one_process_runs_the_tutorial_config_on_one_rank():
    """Without torchrun the engine's mesh is a one-rank SimMesh: DeepSpeed's min(N, W) makes hpZ's group 1."""
    config = {**BASE, "train_batch_size": 2, "zero_optimization": dict(zeropp_worker.ZEROPP)}
    engine, *_ = fzero.initialize(model=tiny_gpt(0), config=config)
    assert repr(engine.mesh) == "SimRank(rank=0 of SimMesh(world=1))"
    x = torch.zeros(2, 8, dtype=torch.long)
    engine.backward(engine(x).float().mean())
    engine.step()
    assert engine.global_steps == 1


# ------------------------------------------------------------------------------------- 4 processes, bitwise
def test_the_mapping_is_not_vacuous():
    """On the (2, 2) SimMesh the tutorial's chain (int8 gathers and reductions) and MiCS's (sharded over 2 ranks)
    differ from plain stage 3 over 4: the engine test below would notice a dropped key."""
    plain = zeropp_worker.core({})
    for preset in ({"hpz": True, "qwz": True, "qgz": True}, {"hybrid": True}):
        got = zeropp_worker.core(preset)
        assert any(not torch.equal(got[k], plain[k]) for k in plain), preset


@pytest.mark.timeout(300)
def test_engine_on_4_processes_equals_zero3_on_the_2x2_sim_mesh(tmp_path):
    """The ZeRO++ tutorial config (hpZ 2, qwZ, qgZ) and a MiCS config (shard size 2) through `fzero.initialize`,
    `engine.backward`, `engine.step` on 4 gloo processes numbered as torchrun numbers 2 nodes of 2 (qgZ acts on
    several nodes only) give bitwise the parameters of `fzero.zero3(..., hpz=True, qwz=True, qgz=True)` and
    `zero3(..., hybrid=True)` on `SimMesh(shape={"replicate": 2, "shard": 2})`; an engine checkpoint saved half-way
    and loaded into a fresh engine resumes bitwise."""
    spawn(zeropp_worker.run, (zeropp_worker.WORLD, str(tmp_path)), zeropp_worker.WORLD)
    results = json.loads((tmp_path / "results.json").read_text())
    mesh = "DistMesh(shape={'replicate': 2, 'shard': 2}, world=4, rank=0, backend=gloo)"
    for name, r in results.items():
        assert r["mesh"] == mesh, name
        assert r["keys_match"] and r["differ"] == {}, (name, r["differ"])
        assert r["same_on_all_ranks"] and r["global_steps"] == zeropp_worker.STEPS, name
        assert r["resumed_bitwise"], name  # engine.save_checkpoint / load_checkpoint half-way, on the 2-D mesh
    # hpZ keeps the layout over every rank; MiCS shards over the 2 ranks of the shard axis
    assert (results["zeropp"]["layout_world"], results["mics"]["layout_world"]) == (4, 2)


# ------------------------------------------------------------------------------------------------- fzero train
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch", "2", "--threads", "1",
        "--no-progress"]  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_train_flags_set_the_config_keys(tmp_path):
    cfg = train_command.build_config(_args("--hpz", "2", "--qwz", "--qgz"))
    assert cfg["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                        "zero_quantized_gradients": True}  # fmt: skip
    assert train_command.build_config(_args("--hybrid", "2"))["zero_optimization"]["mics_shard_size"] == 2
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 4}}))
    assert train_command.build_config(_args("--config", str(ds), "--hybrid", "2"))["zero_optimization"] == {
        "stage": 3, "mics_shard_size": 2}  # fmt: skip
    argv = " ".join(train_command._relaunch_argv(_args("--hpz", "2", "--qwz", "--qgz", "--hybrid", "1")))
    assert "--hybrid 1" in argv and "--hpz 2" in argv and "--qwz" in argv and "--qgz" in argv


ZEROPP_BAD = [
    (["--hpz", "2", "--hybrid", "2", "--nproc", "4"], "--hybrid (MiCS) does not combine with --hpz"),
    (["--qwz", "--hybrid", "2", "--nproc", "4"], "--hybrid (MiCS) does not combine with --qwz"),
    (["--qgz", "--stage", "2"], "--qgz needs ZeRO stage 3, got stage 2: DeepSpeed applies ZeRO++ and MiCS"),
    (["--hybrid", "2", "--config", "CFG"], "--hybrid needs ZeRO stage 3, got stage 1 from --config"),
    (["--hybrid", "3", "--nproc", "4"], "--hybrid 3 does not divide the 4 rank(s)"),
    (["--hpz", "3", "--nproc", "4"], "--hpz 3 does not divide the 4 rank(s)"),
    (["--hpz", "0"], "argument --hpz: expected an integer >= 1, got 0"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), ZEROPP_BAD, ids=[" ".join(f) for f, _ in ZEROPP_BAD])
def test_train_flag_combinations_are_usage_errors(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}))
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *[str(ds) if f == "CFG" else f for f in flags]])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fzero train") and f"fzero train: error: {message}" in err, err


@pytest.mark.usefixtures("keep_threads")
def test_train_runs_with_the_zeropp_flags(tmp_path, capsys, monkeypatch):
    """One process: the flags reach the config (hpZ's group is min(2, 1) = 1 rank: nothing to show; qgZ does nothing
    on one node, as DeepSpeed's)."""
    monkeypatch.setenv(VARIABLE, os.environ.get(VARIABLE, "1"))  # `fzero train` asks for huge pages: restore it
    code = cli.main(["train", "--steps", "2", "--hpz", "2", "--qwz", "--qgz", "--out", str(tmp_path), *TINY])
    assert code == 0
    assert "ZeRO-3, fp32, qwZ, 1 rank(s)" in capsys.readouterr().out
    zero = json.loads((tmp_path / "config.json").read_text())["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 2 and zero["zero_quantized_weights"] and zero["zero_quantized_gradients"]


@pytest.mark.timeout(300)
def test_train_hybrid_on_four_processes_under_torchrun(tmp_path):
    """`--nproc 4 --hybrid 2`: the torchrun workers get the flag and train on the (2, 2) DistMesh."""
    cmd = [sys.executable, "-m", "fzero.cli", "train", "--nproc", "4", "--hybrid", "2", "--steps", "2", "--out",
           str(tmp_path), "--timeout", "120", *TINY]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = "DistMesh(shape={'replicate': 2, 'shard': 2}, world=4, rank=0, backend=gloo)"
    assert f"ZeRO-3, fp32, MiCS shard groups of 2, 4 rank(s) over {mesh}" in done.stdout, done.stdout


def test_train_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--hybrid S", "--hpz N", "--qwz", "--qgz"):
        assert flag in out
    assert "mics_shard_size" in out and "zero_hpz_partition_size" in out

"""DeepSpeed's monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`): an engine on 2 gloo processes writes
DeepSpeed 0.19.8's events, and each backend's own reader finds them, at the right x (global samples) with the
values the engine reported; rank 1 writes nothing. Also: the config blocks (DeepSpeed's keys and defaults, unknown
keys named), a missing package's error, the writers closed at interpreter exit, `fzero train`'s flags.

W&B is read from its offline run file: wandb >= 0.2x no longer ships a Python reader of `.wandb` files, so
`wandb_records` undoes the file's framing (LevelDB's log format, which `wandb.sdk.internal.datastore` read) and each
record is decoded with wandb's own protobuf `Record`.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from fzero.commands import train as train_command
from fzero.config import ConfigError, ConfigTypeError, parse_config
from fzero.metrics.monitors import MonitorMaster, boundary_events
from tests import monitor_worker as w
from tests.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
LR, SCALE, LOSS = "Train/Samples/lr", "Train/Samples/loss_scale", "Train/Samples/train_loss"
TIMES = [f"Train/Samples/elapsed_time_ms_{k}" for k in ("forward", "backward", "step")]


def _values(extra: dict) -> dict:
    """The validated config values of `extra` (with a batch size)."""
    return parse_config({"train_batch_size": 2, **extra}).values


# ------------------------------------------------------------------------------------------------------ readers
def wandb_records(path: str) -> list:
    """The records of a `.wandb` file, decoded with wandb's protobuf `Record`.

    The file is a 7-byte header (`:W&B`, 0xBEE1, version 0) then LevelDB log blocks of 32 KiB: chunks with a
    7-byte header (crc32c, little-endian length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4), a block's tail shorter
    than a header being padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and data[6] == 0, data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST chunk of a record
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_runs(root: Path) -> dict[str, dict]:
    """W&B offline runs under `root`, by group: project and history (name -> [(step, value)])."""
    runs = {}
    for path in glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb")):
        run, history = None, {}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run = r.run
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                for name, value in row.items():
                    if name.startswith("Train/"):
                        history.setdefault(name, []).append((row["_step"], value))
        assert run is not None
        runs[run.run_group] = {"project": run.project, "history": history}
    return runs


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def csv_events(logdir: Path) -> dict[str, tuple[list[str], list[tuple[int, float]]]]:
    out = {}
    for path in sorted(logdir.glob("*.csv")):
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        out[path.stem] = (header, [(int(s), float(v)) for s, v in rows])
    return out


def comet_metrics(root: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Comet offline archives under `root/comet`, by experiment name: name -> [(step, value)] of DeepSpeed's
    events (Comet's own system metrics left out)."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for path in glob.glob(str(root / "comet" / "*.zip")):
        with zipfile.ZipFile(path) as z:
            messages = [json.loads(line) for line in z.read("messages.json").splitlines() if line.strip()]
        name = next(
            m["payload"]["value"] for m in messages if m["type"] == "log_other" and m["payload"]["key"] == "Name"
        )
        metrics: dict[str, list[tuple[int, float]]] = {}
        for m in messages:
            metric = m["payload"].get("metric") if m["type"] == "metric_msg" else None
            if metric and metric["metricName"].startswith("Train/"):
                metrics.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
        out[name] = metrics
    return out


# ------------------------------------------------------------------------------------------ 2 processes, all on
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("monitors")
    spawn(w.run, (w.WORLD, str(out)), w.WORLD)
    results = [json.loads((out / f"results{r}.json").read_text()) for r in range(w.WORLD)]
    return out, results


def expected(results: list[dict], case: str) -> dict[str, list[tuple[int, float]]]:
    """What DeepSpeed writes per boundary, from what each rank saw: the window's mean micro-batch loss averaged
    over the ranks, the next update's LR, the loss scale after the step (fp16), the window's times."""
    per_rank = [r[case]["steps"] for r in results]
    events: dict[str, list[tuple[int, float]]] = {}
    for i, step in enumerate(per_rank[0]):
        loss = sum(sum(s[i]["losses"]) / len(s[i]["losses"]) for s in per_rank) / len(per_rank)
        scale = step["loss_scale"] if w.CASES[case][1] else None
        times = step["times"] or None
        for name, value, x in boundary_events(step["samples"], step["lr_next"], loss, loss_scale=scale, times_ms=times):
            events.setdefault(name, []).append((x, value))
    return events


def _close(got, want) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-9)


@pytest.mark.timeout(300)
def test_expected_events_are_deepspeeds(runs):
    """The test's own expectation: DeepSpeed's names, x = global samples 8, 16, 24 (train_batch_size 8), the loss
    scale under fp16 only, the times under wall_clock_breakdown only; the LR is the next update's (it differs from
    the one the step used while the warm-up ramps)."""
    _, results = runs
    fp32, fp16 = expected(results, "fp32-stage2"), expected(results, "fp16-stage3")
    assert sorted(fp32) == sorted([LR, LOSS, *TIMES]) and sorted(fp16) == sorted([LR, LOSS, SCALE])
    assert [s for s, _ in fp32[LR]] == [w.SAMPLES * (i + 1) for i in range(w.STEPS)]
    steps = results[0]["fp32-stage2"]["steps"]
    assert any(s["lr_next"] != s["lr_used"] for s in steps)
    assert len({v for _, v in fp16[SCALE]}) > 1  # the scale grew: the event follows it


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(w.CASES))
def test_tensorboard(runs, case):
    out, results = runs
    got, want = tensorboard_scalars(out / "rank0" / case), expected(results, case)
    assert sorted(got) == sorted(want)
    for name in want:
        _close(got[name], want[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(w.CASES))
def test_wandb(runs, case):
    out, results = runs
    run = wandb_runs(out / "rank0")[case]
    assert run["project"] == "fzero-tests"
    want = expected(results, case)
    assert sorted(run["history"]) == sorted(want)
    for name in want:
        _close(run["history"][name], want[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(w.CASES))
def test_csv(runs, case):
    out, results = runs
    got, want = csv_events(out / "rank0" / case), expected(results, case)
    assert sorted(got) == sorted(name.replace("/", "_") for name in want)
    for name in want:
        header, rows = got[name.replace("/", "_")]
        assert header == ["step", name.split("/")[-1]]  # DeepSpeed's header: the name's last part
        _close(rows, want[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(w.CASES))
def test_comet(runs, case):
    out, results = runs
    if not results[0][case]["comet"]:
        pytest.skip("comet_ml is not installed")
    got, want = comet_metrics(out / "rank0")[case], expected(results, case)
    assert sorted(got) == sorted(want)
    for name in want:  # samples_log_interval 16: the first event of a name, then 16 samples on (not 8 on)
        _close(got[name], [(s, v) for s, v in want[name] if s in (8, 24)])


@pytest.mark.timeout(300)
def test_rank_one_writes_nothing(runs):
    out, _ = runs
    assert os.listdir(out / "rank1") == []
    assert sorted(os.listdir(out / "rank0")) == sorted(["wandb", *w.CASES, *(["comet"] if w.HAS_COMET else [])])


# ----------------------------------------------------------------------------------------- one process, exits
def _python(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **w.offline_env(str(cwd), str(cwd / ".scratch")), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_missing_package_is_an_error_naming_the_extra(tmp_path):
    """Each monitor's package made unimportable (`sys.modules[name] = None`, a real ImportError): initialize fails
    on rank 0, and the check alone (a rank that does not write) fails the same way, creating nothing."""
    proc = _python(
        """
        import json, sys
        for name in ("tensorboard", "wandb", "comet_ml"):
            sys.modules[name] = None
        import fzero
        from fzero.metrics.monitors import MonitorMaster
        from tests.support import mlp

        out = {}
        for block in ("tensorboard", "wandb", "comet"):
            cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, block: {"enabled": True}}
            try:
                fzero.initialize(model=mlp([2, 2], 0), config=cfg)
            except ImportError as e:
                out[block] = str(e)
            try:
                MonitorMaster({block: {"enabled": True}}, write=False)
            except ImportError as e:
                out[block + "-check"] = str(e)
        print(json.dumps(out))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for block, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")):
        for key in (block, block + "-check"):
            assert f"{block!r} monitor" in errors[key] and f"{package!r} package" in errors[key], errors[key]
            assert 'pip install "fzero[monitor]"' in errors[key]
    assert [p.name for p in tmp_path.iterdir() if p.name != ".scratch"] == []  # no DeepSpeedJobName/, wandb/


@pytest.mark.timeout(180)
def test_writers_close_at_exit_without_engine_close(tmp_path):
    """A script that never calls engine.close(): at exit the W&B run is finished (its last row committed) and
    TensorBoard's and the CSV's events are complete."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    proc = _python(
        """
        import torch
        import fzero
        from tests.support import mlp

        cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "tensorboard": {"enabled": True, "output_path": "tb"}, "csv_monitor": {"enabled": True},
               "wandb": {"enabled": True, "group": "exit"}}
        engine, *_ = fzero.initialize(model=mlp([3, 2], 0), config=cfg)
        for _ in range(3):
            engine.backward(engine(torch.ones(2, 3)).square().mean())
            engine.step()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    steps = [2, 4, 6]
    tb = tensorboard_scalars(tmp_path / "tb" / "DeepSpeedJobName")
    assert sorted(tb) == [LR, LOSS] and [s for s, _ in tb[LOSS]] == steps
    _, rows = csv_events(tmp_path / "DeepSpeedJobName")["Train_Samples_train_loss"]
    assert [s for s, _ in rows] == steps
    run = wandb_runs(tmp_path)["exit"]
    assert run["project"] == "deepspeed"  # DeepSpeed's default project
    assert [s for s, _ in run["history"][LOSS]] == steps  # the last row too: the run was finished


def test_master_registers_close_at_exit(tmp_path, monkeypatch):
    registered: list = []
    monkeypatch.setattr("atexit.register", registered.append)
    monkeypatch.setattr("atexit.unregister", registered.remove)
    master = MonitorMaster(_values({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}}))
    assert master.enabled and registered == [master.close]
    master.write_events(boundary_events(8, 0.5, 2.0))
    master.close()
    master.close()
    assert registered == [] and master.writers == {}
    idle = MonitorMaster(_values({}))
    assert not idle.enabled and idle.writers == {} and registered == []
    quiet = MonitorMaster(_values({"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "q")}}),
                          write=False)  # fmt: skip
    assert quiet.enabled and quiet.writers == {} and not (tmp_path / "q").exists()


# -------------------------------------------------------------------------------------------------- the config
def test_config_blocks_have_deepspeeds_keys_and_defaults():
    v = _values({})
    assert v["tensorboard"] == {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}
    assert v["csv_monitor"] == {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"}
    assert v["wandb"] == {"enabled": False, "group": None, "team": None, "project": "deepspeed"}
    assert v["comet"] == {
        "enabled": False, "samples_log_interval": 100, "project": None, "workspace": None, "api_key": None,
        "experiment_name": None, "experiment_key": None, "online": None, "mode": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("block", "key", "error"),
    [
        ({"tensorboard": {"enabled": True, "output_dir": "x"}}, "tensorboard.output_dir", ConfigError),
        ({"wandb": {"entity": "me"}}, "wandb.entity", ConfigError),
        ({"csv_monitor": {"enabled": True, "path": "x"}}, "csv_monitor.path", ConfigError),
        ({"comet": {"offline": True}}, "comet.offline", ConfigError),
        ({"wandb": {"enabled": True, "project": 3}}, "wandb.project", ConfigTypeError),
        ({"tensorboard": {"enabled": "yes"}}, "tensorboard.enabled", ConfigTypeError),
        ({"comet": {"mode": "fetch"}}, "comet.mode", ConfigError),
        ({"comet": {"samples_log_interval": 1.5}}, "comet.samples_log_interval", ConfigTypeError),
        ({"csv_monitor": ["enabled"]}, "csv_monitor", ConfigTypeError),
    ],
)
def test_bad_keys_are_named_errors(block, key, error):
    with pytest.raises(error) as e:
        _values(block)
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")


def test_train_command_flags_set_the_blocks(tmp_path):
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    cfg = train_command.build_config(parser.parse_args(["--tensorboard", "runs/tb", "--wandb"]))
    assert cfg["tensorboard"] == {"enabled": True, "output_path": "runs/tb"} and cfg["wandb"] == {"enabled": True}
    assert "tensorboard" not in train_command.build_config(parser.parse_args([]))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "tensorboard": {"job_name": "mine"}, "wandb": {"project": "p"}}))
    cfg = train_command.build_config(parser.parse_args(["--config", str(ds), "--tensorboard", "tb", "--wandb"]))
    assert cfg["tensorboard"] == {"job_name": "mine", "enabled": True, "output_path": "tb"}
    assert cfg["wandb"] == {"project": "p", "enabled": True}
    relaunch = train_command._relaunch_argv(parser.parse_args(["--tensorboard", "tb", "--wandb"]))
    assert relaunch[-3:] == ["--tensorboard", "tb", "--wandb"]

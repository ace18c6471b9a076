"""`fzero train` (in process, and with `--nproc 2` launching torchrun), its DeepSpeed config handling, and the
metrics it reports: the TFLOPS formula, warm-up exclusion, the console line, JSONL and the loss-curve PNG."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from fzero import cli
from fzero.commands import train as train_command
from fzero.examples.gpt import GPT, GPTConfig
from fzero.host.hostmem import VARIABLE
from fzero.metrics import Monitor, Throughput, format_line, plot_loss_curve, read_jsonl, transformer_flops

pytestmark = pytest.mark.usefixtures("keep_threads")  # they run commands in this process


@pytest.fixture(autouse=True)
def _huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fzero train` asks for huge pages for its process (sets the variable): restore the environment after."""
    monkeypatch.setenv(VARIABLE, os.environ.get(VARIABLE, "1"))


TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch", "2", "--threads", "1",
        "--no-progress"]  # fmt: skip
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("layers", [1, 4])
def test_tflops_formula_is_the_gpt_count(layers):
    """`(2 c P s + 4 c L h s^2) B` with c = 3 is the example GPT's own count, 6 N + 12 L d T per token."""
    model = GPT(GPTConfig(n_layer=layers, d_model=64, n_head=2, seq_len=32))
    params = sum(p.numel() for p in model.parameters())
    assert transformer_flops(params, layers, 64, 32, batch=5) == model.flops_per_token() * 32 * 5
    assert transformer_flops(params, layers, 64, 32, 5, activation_checkpointing=True) == pytest.approx(
        model.flops_per_token() * 32 * 5 * 4 / 3
    )


def test_monitor_excludes_warmup_and_derives_rates(tmp_path):
    lines: list[str] = []
    flops = transformer_flops(1e6, 2, 64, 16, batch=1)
    monitor = Monitor(32, world=2, steps_per_print=2, jsonl=tmp_path / "m.jsonl", warmup_steps=1, seq_length=16,
                      flops_per_sample=flops, printer=lines.append)  # fmt: skip
    for step, seconds in enumerate([9.0, 0.5, 0.3, 0.1], 1):
        monitor.record(step, seconds, loss=4.0 - step, lr=1e-3, loss_scale=1.0, skipped=step == 3, grad_norm=1.0)
    monitor.close()
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [r["timed"] for r in records] == [False, True, True, True]
    assert records[1]["samples_per_s"] == 64.0 and records[1]["tokens_per_s"] == 64.0 * 16
    assert records[1]["tflops"] == pytest.approx(64.0 / 2 * flops / 1e12)  # per rank
    # the first line's window holds the warm-up step only as untimed: its time is the timed step's
    assert "500.0 ms/step" in lines[0] and "200.0 ms/step" in lines[1] and "skipped 1" in lines[1]
    s = monitor.summary()
    assert (s["timed_steps"], s["skipped"], s["first_loss"]) == (3, 1, 3.0)
    assert s["step_time"] == pytest.approx(0.3) and s["tokens_per_s"] == pytest.approx(32 / 0.3 * 16)
    t = Throughput(warmup_steps=2)
    assert [t.add(x) for x in (1, 2, 3)] == [False, False, True] and t.mean() == 3


def test_console_line_and_loss_curve(tmp_path):
    line = format_line({"step": 3, "loss": 1.5, "lr": 2e-4, "loss_scale": 1024.0, "skipped": 2, "grad_norm": None,
                        "step_time": 0.25, "tokens_per_s": 12345.6, "tflops": 0.0123})  # fmt: skip
    assert line == (
        "step 3 | loss 1.5000 | lr 2.000e-04 | scale 1024 | skipped 2 | grad norm - | 250.0 ms/step | "
        "12,346 tokens/s | 0.012 TFLOPS"
    )
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 3.0 / i, "skipped": i == 2}) + "\n" for i in (1, 2, 3))
                    + '{"step": 4, "lo')  # a run killed mid-line  # fmt: skip
    assert len(read_jsonl(path)) == 3
    png = plot_loss_curve(path, tmp_path / "curve" / "loss.png", title="test")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000


# --------------------------------------------------------------------------------------------------- the command
def test_build_config_from_flags_and_file(tmp_path):
    cfg = train_command.build_config(_args("--stage", "1", "--precision", "bf16", "--accumulate", "2", "--out", "o"))
    assert cfg["zero_optimization"] == {"stage": 1} and cfg["bf16"] == {"enabled": True}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 2)
    assert cfg["scheduler"]["type"] == "WarmupLR" and cfg["optimizer"]["type"] == "AdamW"
    assert cfg["fzero_metrics"]["jsonl"] == os.path.join("o", "metrics.jsonl")
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                              "fp16": {"enabled": True, "initial_scale_power": 8},
                              "zero_optimization": {"stage": 1, "overlap_comm": True},
                              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))  # fmt: skip
    only_file = train_command.build_config(_args("--config", str(ds)))
    assert only_file["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    assert only_file["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}} and "scheduler" not in only_file
    assert only_file["train_batch_size"] == 8 and only_file["fp16"]["enabled"]
    flags = train_command.build_config(
        _args("--config", str(ds), "--stage", "3", "--precision", "bf16", "--batch", "2")
    )
    assert flags["zero_optimization"]["stage"] == 3 and flags["zero_optimization"]["overlap_comm"]
    assert not flags["fp16"]["enabled"] and flags["bf16"]["enabled"]
    assert "train_batch_size" not in flags and flags["train_micro_batch_size_per_gpu"] == 2


def test_train_single_process_learns(tmp_path, capsys, retained):
    out = tmp_path / "run"
    code = cli.main(["train", "--steps", "30", "--stage", "2", "--out", str(out), "--print-every", "10", *TINY])
    assert code == 0
    assert retained  # the process keeps its freed memory (recorded by the fixture, tests/conftest.py)
    stdout = capsys.readouterr().out
    assert "ZeRO-2, fp32, 1 rank(s) over SimRank(rank=0 of SimMesh(world=1))" in stdout and "done: loss" in stdout
    assert stdout.count("step ") >= 3 and "tokens/s" in stdout and "TFLOPS" in stdout
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0  # from ln(256) = 5.5 towards the corpus' byte statistics
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "config.json").read_text())["zero_optimization"]["stage"] == 2


def test_train_with_a_deepspeed_config(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}))  # fmt: skip
    code = cli.main(["train", "--config", str(ds), "--steps", "3", "--out", str(tmp_path / "run"), *TINY[:8],
                     "--threads", "1", "--no-progress"])  # fmt: skip
    assert code == 0
    stdout = capsys.readouterr().out
    assert "ZeRO-1, bf16" in stdout and "accumulate 2" in stdout and f"config {ds}" in stdout


def test_train_errors_exit_2(tmp_path, capsys):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 5}}))
    assert cli.main(["train", "--config", str(ds), "--out", str(tmp_path), *TINY]) == 2
    assert "zero_optimization.stage: expected an integer in [0, 3], got 5" in capsys.readouterr().err
    ds.write_text(json.dumps({"train_batch_size": 8, "comms_config": {"timeout": -1}}))
    assert cli.main(["train", "--config", str(ds), "--out", str(tmp_path), *TINY]) == 2
    assert "comms_config.timeout: expected a finite number > 0, got -1" in capsys.readouterr().err


BAD_FLAGS = [
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["--steps", "-3"], "argument --steps: expected an integer >= 1, got -3"),
    (["--steps", "2.5"], "argument --steps: expected an integer >= 1, got '2.5'"),
    (["--heads", "3"], "--d-model 128 is not a multiple of --heads 3"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 is not a multiple of --heads 4"),
    (["--heads", "0"], "argument --heads: expected an integer >= 1, got 0"),
    (["--threads", "-1"], "argument --threads: expected an integer >= 0, got -1"),
    (["--warmup", "-5"], "argument --warmup: expected an integer >= 0, got -5"),
    (["--nproc", "0"], "argument --nproc: expected an integer >= 1, got 0"),
    (["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
    (["--batch", "x"], "argument --batch: expected an integer >= 1, got 'x'"),
    (["--accumulate", "0"], "argument --accumulate: expected an integer >= 1, got 0"),
    (["--lr=-1e-3"], "argument --lr: expected a finite number > 0, got '-1e-3'"),
    (["--lr", "nan"], "argument --lr: expected a finite number > 0, got 'nan'"),
    (["--layers", "0"], "argument --layers: expected an integer >= 1, got 0"),
    (["--d-model", "0"], "argument --d-model: expected an integer >= 1, got 0"),
    (["--seq-len", "0"], "argument --seq-len: expected an integer >= 1, got 0"),
    (["--seq-len", "10000000"], "--seq-len 10000000 does not fit the bundled corpus"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["--seed", str(2**60)], "--seed must be below 2**53"),
    (["--print-every", "0"], "argument --print-every: expected an integer >= 1, got 0"),
    (["--timeout", "0"], "argument --timeout: expected a finite number > 0, got '0'"),
    (["--timeout", "inf"], "argument --timeout: expected a finite number > 0, got 'inf'"),
    (["--stage", "4"], "argument --stage: invalid choice: 4"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--config", "nope.json"], "--config nope.json: no such file"),
    (["--out", "FILE"], "--out FILE: exists and is not a directory"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_are_usage_errors(tmp_path, capsys, flags, message):
    """Every flag is checked before anything runs: argparse's usage line, the message naming the flag, exit 2."""
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    message = message.replace("FILE", str(tmp_path / "FILE"))
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fzero train") and f"fzero train: error: {message}" in err, err


def test_an_unknown_accelerator_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--steps", "1"])
    assert info.value.code == 2
    assert "fzero train: error: DS_ACCELERATOR='xpu': fzero runs on cpu or cuda" in capsys.readouterr().err


def test_timeout_flag_and_config(tmp_path):
    """`--timeout` (default 300 s) becomes `comms_config.timeout`; a config file's own value stays unless the flag
    is given."""
    assert train_command.build_config(_args())["comms_config"] == {"timeout": 300.0}
    assert train_command.build_config(_args("--timeout", "20"))["comms_config"] == {"timeout": 20.0}
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "comms_config": {"timeout": 45}}))
    assert train_command.build_config(_args("--config", str(ds)))["comms_config"] == {"timeout": 45}
    assert train_command.build_config(_args("--config", str(ds), "--timeout", "9"))["comms_config"] == {"timeout": 9.0}
    assert "--timeout 9.0" in " ".join(train_command._relaunch_argv(_args("--timeout", "9")))


@pytest.mark.timeout(600)
def test_train_two_processes_under_torchrun(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fzero.cli", "train", "--nproc", "2", "--stage", "3", "--steps", "4", "--out",
           str(out), "--timeout", "120", *TINY]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    mesh = "DistMesh(world=2, rank=0, backend=gloo) (collective timeout 120 s)"  # --timeout reached the mesh
    assert f"ZeRO-3, fp32, 2 rank(s) over {mesh}" in done.stdout
    assert "done: loss" in done.stdout and done.stdout.count("fzero train:") == 1  # rank 0 speaks
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_offload_flag(tmp_path, capsys):
    code = cli.main(["train", "--offload", "--steps", "2", "--stage", "2", "--out", str(tmp_path), *TINY])
    assert code == 0 and "optimizer offload" in capsys.readouterr().out
    assert torch.get_num_threads() >= 1


def test_train_with_the_nvme_tier(tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir()
    flags = ["--offload-optimizer", "nvme", "--nvme-path", str(swap)]
    code = cli.main(["train", "--steps", "3", "--out", str(tmp_path / "run"), *flags, *TINY])
    assert code == 0
    assert "ZeRO-3, fp32, optimizer offload to nvme, 1 rank(s)" in capsys.readouterr().out
    zero = json.loads((tmp_path / "run" / "config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(swap)}
    assert list(swap.iterdir()) == []  # the run's swap files are removed at its end
    assert cli.main(["train", "--offload-param", "nvme", "--out", str(tmp_path / "p"), *TINY]) == 2
    assert "offload_param" in capsys.readouterr().err

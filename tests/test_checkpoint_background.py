"""Background saves (`fzero.save(..., blocking=False)`) in one process: the files hold the state at the call while
donated steps overwrite it, resuming from them is bitwise the uninterrupted run, one save in flight per root,
failures reach the caller, and a process killed in mid-write leaves the previous checkpoint. (Over 2 gloo
processes: `tests/test_checkpoint_dist.py`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fzero
from fzero.checkpoint import CheckpointError, SaveHandle, named_leaves
from tests.support import lm_batches, lm_loss, tiny_gpt
from tests.test_checkpoint import assert_same

ROOT = Path(__file__).resolve().parents[1]


def setup(world: int = 2):
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.adamw(1e-2))
    mesh = fzero.SimMesh(world)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True)
    return model, tx, mesh, step, lm_batches(model, world, 1, 2, 6, 3)


def snapshot(state) -> dict:
    return named_leaves(state)  # (copies: the donated steps cannot change it)


def test_background_save_holds_the_state_at_the_call_and_resumes_bitwise(tmp_path):
    model, tx, mesh, step, data = setup()
    state = fzero.init(model, tx, mesh)
    for batch in data[:2]:
        state, _ = step(state, batch)
    at_call = snapshot(state)
    handle = fzero.save(state, tmp_path, data_position=2, blocking=False)
    assert isinstance(handle, SaveHandle) and handle.path == tmp_path / "step2"
    # what the copy takes: every leaf of both simulated ranks (the generator states are not counted)
    assert handle.staged_bytes == sum(x.numel() * x.element_size() for x in fzero.checkpoint.tree.flatten_state(
        state).leaves)  # fmt: skip
    for batch in data[2:5]:  # donated: each step overwrites the buffers the save was called with
        state, _ = step(state, batch)
    assert handle.wait(timeout=120) == tmp_path / "step2" and handle.done()
    assert "done" in repr(handle)

    loaded, extra = fzero.load(tmp_path, fzero.init(model, tx, mesh))
    assert extra["data_position"] == 2 and extra["tag"] == "step2"
    assert_same(named_leaves(loaded), at_call)  # bitwise the state at the call
    for batch in data[2:5]:
        loaded, _ = step(loaded, batch)
    assert_same(named_leaves(loaded), snapshot(state))  # resumed: bitwise the uninterrupted run


def test_one_save_in_flight_per_root_and_failures_reach_the_caller(tmp_path, capsys):
    model, tx, mesh, *_ = setup()
    state = fzero.init(model, tx, mesh)
    first = fzero.save(state, tmp_path, tag="a", blocking=False)
    second = fzero.save(state, tmp_path, tag="b", blocking=False)  # waits for the first before it starts
    assert first.done()
    assert second.wait(timeout=120) == tmp_path / "b"
    assert fzero.checkpoint.read_latest(tmp_path) == "b"

    # a failure is raised by wait ...
    failed = fzero.save(state, tmp_path, tag="a", blocking=False)  # exists, no overwrite
    with pytest.raises(CheckpointError, match="already exists"):
        failed.wait(timeout=120)
    # ... and one nobody waited for by the next save (or load) of the root, once; it was printed when it happened
    fzero.save(state, tmp_path, tag="a", blocking=False)
    with pytest.raises(CheckpointError, match=r"the background save of .*a failed .*already exists"):
        fzero.save(state, tmp_path, tag="c")
    assert "the background save of" in capsys.readouterr().err
    fzero.save(state, tmp_path, tag="c", blocking=False)
    _, extra = fzero.load(tmp_path, fzero.init(model, tx, mesh))  # waits for "c" in flight
    assert extra["tag"] == "c"


def test_nvme_offloaded_state_is_refused(tmp_path):
    model = tiny_gpt(0)
    (tmp_path / "swap").mkdir()
    tx = fzero.zero3(fzero.adamw(1e-2), offload=fzero.Offload("nvme", path=str(tmp_path / "swap")))
    state = fzero.init(model, tx, fzero.SimMesh(2))
    with pytest.raises(ValueError, match=r"blocking=False\): leaf .* is offloaded to NVMe .*blocking=True"):
        fzero.save(state, tmp_path / "ckpt", blocking=False)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.timeout(300)
def test_sigkill_during_background_save_leaves_the_previous_checkpoint(tmp_path):
    """A process saving in the background over and over is killed with SIGKILL in mid-write: `latest` names a
    complete checkpoint, one the process had finished (or was finishing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for delay in (0.2,):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ckpt_worker", "save-loop", str(tmp_path), "background"],
            stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        first = proc.stdout.readline()
        assert first.startswith(b"saved"), first
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = [int(first.split()[1])] + [
            int(line.split()[1]) for line in proc.stdout.read().decode().splitlines() if line.startswith("saved")
        ]
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
        like = fzero.init(model, fzero.zero2(fzero.adamw(1e-3)), fzero.SimMesh(2))
        state, extra = fzero.load(tmp_path, like)  # verifies every checksum
        # the last save reported finished, or the one in flight (killed after its rename)
        assert extra["data_position"] in (done[-1], done[-1] + 1), (extra["data_position"], done)
        assert torch.equal(state.params, torch.full_like(state.params, float(extra["data_position"])))


def test_engine_decoupled_writer_resumes_bitwise(tmp_path):
    """DeepSpeed's ``checkpoint.writer.decoupled``: `save_checkpoint` returns after the copy, the engine trains on
    (its state donated, updated in place) while it writes; a fresh engine resumes from it to the same run."""
    from fzero.config import ConfigError
    from tests.engine_ckpt_worker import batches, config, engine, train

    writer = {"type": "fast", "decoupled": True, "io_buffer_size": 2**20, "data_parallel": "replica"}
    cfg, data = config(3, "bf16", 2, checkpoint={"writer": writer}), batches(10)
    a = engine(cfg, seed=0)
    train(a, data, 0, 4)
    assert a.save_checkpoint(tmp_path, client_state={"epoch": 1}) is True
    assert isinstance(a.pending_checkpoint, SaveHandle)
    losses = train(a, data, 4, 10)  # while it writes
    assert a.wait_for_checkpoint() == tmp_path / "global_step2" and a.pending_checkpoint is None

    b = engine(cfg, seed=1)
    assert b.load_checkpoint(tmp_path)[1] == {"epoch": 1}
    assert train(b, data, 4, 10) == losses

    b.save_checkpoint(tmp_path, tag="global_step2", overwrite=False)  # exists: fails in the background ...
    with pytest.raises(CheckpointError, match="already exists"):
        b.destroy()  # ... raised by the engine's next checkpoint call or destroy
    with pytest.raises(ConfigError, match=r"checkpoint\.writer\.type.*MOCK writer"):
        engine(config(0, checkpoint={"writer": {"type": "mock"}}))

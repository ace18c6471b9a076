"""The main job runs as the README runs it: torchrun, 2 processes, gloo, ZeRO-3; and in one plain process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fzero.examples import train_gpt

pytestmark = pytest.mark.usefixtures("keep_threads")  # they run commands in this process

SMALL = ["--steps", "4", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch", "2",
         "--log-every", "2"]  # fmt: skip


@pytest.mark.timeout(600)
def test_main_job_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "fzero.examples.train_gpt", "--stage", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd + SMALL, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 rank(s) over DistMesh(world=2, rank=0, backend=gloo)" in out.stdout
    assert "tokens/s" in out.stdout and "done: loss" in out.stdout


def test_main_job_single_process_learns():
    summary = train_gpt.main([*SMALL[:1], "30", *SMALL[2:], "--stage", "2", "--threads", "1"])
    assert summary["final_loss"] < summary["first_loss"] - 1.0

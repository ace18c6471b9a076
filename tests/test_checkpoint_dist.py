"""Checkpoints over a real gloo group of 2 processes: save-resume is bitwise the uninterrupted run (each rank's
own generator restored, a stage-1 save in the middle of an accumulation included), a checkpoint of world 3 loads
into world 2 and trains as a `SimMesh(2)` does, a 2-process checkpoint loads in one process, and an error on one
rank (a damaged file only it verifies, a tag only rank 0 sees exists) is raised on both; a background save holds the
state at its call while donated steps run, and resumes to the same state."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import fzero
from fzero.checkpoint import named_leaves
from tests import ckpt_worker
from tests.ckpt_worker import CASES, batches, train
from tests.spawn import spawn
from tests.support import lm_batches, lm_loss, tiny_gpt
from tests.test_checkpoint import assert_same

WORLD = 2


@pytest.mark.timeout(600)
def test_dist_resume_and_reshard(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul's reduction order may depend on the thread count
    try:
        # the world-3 checkpoint the workers load at world 2 (stage 2 -> stages 1 and 3), at micro-step 2 of 6
        model = tiny_gpt(0)
        tx3 = fzero.zero2(fzero.adamw(1e-2), accumulate=2)
        state3 = fzero.init(model, tx3, fzero.SimMesh(3))
        step3 = fzero.train_step(model, lm_loss(model), tx3, fzero.SimMesh(3))
        state3 = train(state3, step3, batches(3, 2)[:2], 0, None)
        fzero.save(state3, tmp_path / "from3", data_position=2)

        spawn(ckpt_worker.resume, (WORLD, str(tmp_path)), WORLD)

        for preset, micro, _ in CASES:
            got = load_file(tmp_path / f"{preset}.st")
            names = [k.removeprefix("straight/") for k in got if k.startswith("straight/")]
            for name in names:  # resumed from the files, each rank's generator restored: bitwise the same run
                assert torch.equal(got[f"straight/{name}"], got[f"resumed/{name}"]), (preset, name)

            # what the two processes did with the world-3 checkpoint, SimMesh(2) does bitwise (2-rank gloo sums
            # are rank-ordered sums)
            tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
            mesh = fzero.SimMesh(WORLD)
            sim, extra = fzero.load(tmp_path / "from3", fzero.init(model, tx, mesh))
            sim = train(sim, fzero.train_step(model, lm_loss(model), tx, mesh), batches(WORLD, micro), 2, None)
            dist_saved, _ = fzero.load(tmp_path / f"moved-{preset}", fzero.init(model, tx, mesh))
            assert_same(named_leaves(dist_saved), named_leaves(sim), preset)
            assert extra["data_position"] == 2
            # and the files the 2 processes wrote consolidate to the same parameters in one process
            consolidated = fzero.consolidate(tmp_path / f"moved-{preset}")
            assert_same(consolidated, fzero.state_dict(sim), f"{preset} consolidated")

        for rank in range(WORLD):  # a failure on one rank is raised on every rank (nobody waits forever)
            lines = (tmp_path / f"outcomes-{rank}.txt").read_text().splitlines()
            assert len(lines) == 2, lines
            assert lines[0].startswith("CheckpointError:") and "moved-zero3/step6 already exists" in lines[0]
            assert lines[1].startswith("CorruptCheckpointError:")
            assert "rank-00001-of-00002.safetensors: checksum mismatch" in lines[1]
        # the background save the workers took while 3 donated steps ran: the state at the call, bitwise, and
        # resuming from it in one process gives the workers' state after the steps (a SimMesh(2) is their run)
        got = load_file(tmp_path / "background.st")
        tx = fzero.zero3(fzero.adamw(1e-2))
        mesh = fzero.SimMesh(WORLD)
        resumed, extra = fzero.load(tmp_path / "background", fzero.init(model, tx, mesh))
        assert extra["data_position"] == 2
        at_call, after = strip(got, "at_call"), strip(got, "after")
        params = fzero.state_dict(resumed)
        assert_same({k: params[k] for k in at_call}, at_call)
        data = lm_batches(model, WORLD, 1, 2, 5, 3)
        resumed = train(resumed, fzero.train_step(model, lm_loss(model), tx, mesh), data, 2, None)
        params = fzero.state_dict(resumed)
        assert_same({k: params[k] for k in after}, after)
    finally:
        torch.set_num_threads(threads)


def strip(got: dict, prefix: str) -> dict:
    return {k.removeprefix(f"{prefix}/"): v for k, v in got.items() if k.startswith(f"{prefix}/")}

"""Checkpoints under damage, with real files: a save killed with SIGKILL leaves the previous checkpoint loadable;
truncated, bit-flipped and missing shards, a manifest of another model, a newer format: each a clear error naming
the file, with nothing loaded; and loading never unpickles anything."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import optree
import pytest
import torch

import fzero
from fzero.checkpoint import (
    VERSION,
    CheckpointNotFoundError,
    CheckpointVersionError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from tests.support import mlp

ROOT = Path(__file__).resolve().parent.parent


def make(world: int = 2, widths=(4, 8, 3), seed: int = 0):
    model = mlp(list(widths), seed)
    tx = fzero.zero2(fzero.adamw(1e-2))
    state = fzero.init(model, tx, fzero.SimMesh(world))
    return model, tx, state.replace(params=state.params + 0.25)


@pytest.fixture
def saved(tmp_path):
    model, tx, state = make()
    path = fzero.save(state, tmp_path, data_position=3)
    return tmp_path, path, model, tx, state


def rewrite_manifest(path: Path, m: dict | str) -> None:
    """Replace a checkpoint's manifest and its digest consistently (as a buggy tool or a deliberate edit would):
    what the checks after the digest must catch."""
    data = (m if isinstance(m, str) else json.dumps(m)).encode()
    (path / "manifest.json").write_bytes(data)
    (path / "manifest.json.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


def shard(path: Path, rank: int = 1) -> Path:
    return path / f"rank-{rank:05d}-of-00002.safetensors"


def expect_nothing_loaded(root, like, error, match):
    """`load` raises `error` matching `match`, restores no generator state and leaves `like` as it was."""
    before = [x.clone() for x in optree.tree_leaves(like, namespace="fzero")]
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    with pytest.raises(error, match=match):
        fzero.load(root, like, restore_rng=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves(like, namespace="fzero"), strict=True))


def test_truncated_shard(saved):
    root, path, _, _, like = saved
    f = shard(path)
    f.write_bytes(f.read_bytes()[:-10])
    expect_nothing_loaded(root, like, CorruptCheckpointError, rf"{f}: truncated: \d+ bytes, the manifest records")


def test_bit_flipped_shard(saved):
    root, path, _, _, like = saved
    f = shard(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    expect_nothing_loaded(root, like, CorruptCheckpointError, rf"{f}: checksum mismatch .* altered or damaged")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        fzero.consolidate(root)


def test_damaged_header_without_verification(saved):
    root, path, _, _, like = saved
    f = shard(path, 0)
    data = bytearray(f.read_bytes())
    data[7] = 0x7F  # the header length: now absurd
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{f}: not a readable safetensors file"):
        fzero.load(root, like, verify=False)


def test_missing_shard(saved):
    root, path, _, _, like = saved
    shard(path).unlink()
    expect_nothing_loaded(root, like, CorruptCheckpointError, rf"{shard(path)}: missing \(rank 1's shard")


def test_missing_or_unreadable_manifest(saved):
    root, path, _, _, like = saved
    (path / "manifest.json").write_text('{"format": "fzero-checkpoint", "version": 1, "layo')
    expect_nothing_loaded(root, like, CorruptCheckpointError, r"manifest.json: checksum mismatch .* altered or damaged")
    rewrite_manifest(path, '{"format": "fzero-checkpoint", "version": 1, "layo')
    expect_nothing_loaded(root, like, CorruptCheckpointError, r"manifest.json: not valid JSON")
    (path / "manifest.json").unlink()
    expect_nothing_loaded(root, like, CorruptCheckpointError, r"manifest.json: missing; .* save did not finish")
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        fzero.load(root / "elsewhere", like)
    (root / "latest").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no 'latest' pointer"):
        fzero.load(root, like)


def test_newer_format_version(saved):
    root, path, _, _, like = saved
    m = json.loads((path / "manifest.json").read_text())
    m["version"], m["fzero_version"] = VERSION + 1, "9.0"
    rewrite_manifest(path, m)
    expect_nothing_loaded(root, like, CheckpointVersionError, rf"manifest.json: written in checkpoint format version "
                          rf"{VERSION + 1} \(by fzero 9.0\); this fzero \(.*\) reads versions up to {VERSION}. Upgrade "
                          "fzero")  # fmt: skip


def test_checkpoint_of_another_model(saved, tmp_path_factory):
    root, path, _, _, like = saved
    other_model, other_tx, _ = make(widths=(4, 9, 3))
    other = fzero.init(other_model, other_tx, fzero.SimMesh(2))
    expect_nothing_loaded(root, other, IncompatibleCheckpointError,
                          r"checkpoint from another model: parameter '0.weight' has shape \(8, 4\) in the checkpoint, "
                          r"\(9, 4\) in the model")  # fmt: skip
    # another model's manifest planted beside these files: it is checked against the state before any file
    elsewhere = tmp_path_factory.mktemp("other")
    other_path = fzero.save(other, elsewhere)
    (path / "manifest.json").write_bytes((other_path / "manifest.json").read_bytes())
    expect_nothing_loaded(root, like, CorruptCheckpointError, r"manifest.json: checksum mismatch")
    (path / "manifest.json.sha256").write_bytes((other_path / "manifest.json.sha256").read_bytes())
    expect_nothing_loaded(root, like, IncompatibleCheckpointError, r"another model: parameter '0.weight' has shape \(9")
    # and its records do not match these files
    with pytest.raises(CorruptCheckpointError, match=rf"{shard(path, 0)}: (truncated|longer than written)"):
        fzero.consolidate(root)


def test_manifest_cannot_point_outside(saved):
    root, path, _, _, like = saved
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0]["name"] = "../../etc/passwd"
    rewrite_manifest(path, m)
    expect_nothing_loaded(root, like, CorruptCheckpointError, r"malformed manifest: field files\[0\].name: expected "
                          r"rank-NNNNN-of-NNNNN.safetensors, got '../../etc/passwd'")  # fmt: skip


class Planted:
    """Unpickling this creates a marker file: proof that something unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_planted_pickle_is_never_unpickled(saved, tmp_path_factory, how):
    root, path, _, _, like = saved
    marker = tmp_path_factory.mktemp("marker") / "unpickled"
    f = shard(path, 0)
    if how == "pickle":
        f.write_bytes(pickle.dumps({"params": Planted(str(marker))}))
    else:
        torch.save({"params": Planted(str(marker))}, f)
    with pytest.raises(CorruptCheckpointError, match=rf"{f}: (truncated|longer than written|checksum mismatch)"):
        fzero.load(root, like)
    # an attacker who also rewrites the manifest's records (and its digest) gets no further: the file is parsed as
    # safetensors (padded to the size the manifest's leaves need, which is checked before any file is read)
    data = f.read_bytes() + bytes(4096)
    f.write_bytes(data)
    m = json.loads((path / "manifest.json").read_text())
    m["files"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptCheckpointError, match="manifest.json: checksum mismatch"):
        fzero.load(root, like)
    rewrite_manifest(path, m)
    with pytest.raises(CorruptCheckpointError, match=rf"{f}: not a readable safetensors file"):
        fzero.load(root, like)
    with pytest.raises(CorruptCheckpointError, match=rf"{f}: not a readable safetensors file"):
        fzero.consolidate(root)
    assert not marker.exists()


def test_the_healthy_path_never_calls_pickle(saved, monkeypatch):
    root, _, _, _, like = saved

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load reached pickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _, extra = fzero.load(root, like)
    assert extra["data_position"] == 3
    fzero.consolidate(root)


def test_leftovers_of_interrupted_saves(saved):
    root, _, _, _, like = saved
    (root / ".step0.tmp").mkdir()
    (root / ".step0.tmp" / "rank-00000-of-00002.safetensors").write_bytes(b"half a file")
    assert fzero.load(root, like)[1]["tag"] == "step0"  # temporaries are never read
    fzero.save(like, root, tag="step0", overwrite=True)  # and a save of that tag clears them
    assert not (root / ".step0.tmp").exists()
    # an overwrite stopped between its two renames: the old checkpoint is still found
    os.rename(root / "step0", root / ".step0.old")
    assert fzero.load(root, like)[1]["tag"] == "step0"


def _read_saved(proc: subprocess.Popen) -> list[int]:
    return [int(line.split()[1]) for line in proc.stdout.read().decode().splitlines() if line.startswith("saved")]


@pytest.mark.timeout(300)
def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    """A process saving a 17 MB state over and over is killed with SIGKILL at random moments; each time `latest`
    names a complete checkpoint, equal to the last save that finished (or the one finishing), and the next run
    saves over the leftovers."""
    rng = random.Random(0)
    like = None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ckpt_worker", "save-loop", str(tmp_path)],
            stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )  # fmt: skip
        first = proc.stdout.readline()  # one save finished: from here on a checkpoint must always be there
        assert first.startswith(b"saved"), first
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = [int(first.split()[1]), *_read_saved(proc)]
        if like is None:
            model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
            like = fzero.init(model, fzero.zero2(fzero.adamw(1e-3)), fzero.SimMesh(2))
        state, extra = fzero.load(tmp_path, like)  # verifies every checksum
        assert extra["data_position"] in (done[-1], done[-1] + 1), (extra["data_position"], done)
        assert torch.equal(state.params, torch.full_like(state.params, float(extra["data_position"])))

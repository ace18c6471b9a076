"""A save either succeeds or leaves everything as it was: out of space on the `latest` pointer (a real full tmpfs)
or on a shard (RLIMIT_FSIZE), a tag that is a symbolic link replaced with `overwrite=True`; leftovers of
interrupted saves are cleaned by the next save of any tag; shards linked out of the checkpoint directory are
refused; errors never repeat a file's contents."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fzero
from fzero.checkpoint import CheckpointError, CorruptCheckpointError
from tests.support import mlp

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t: do not print"


def make(value: float = 0.25):
    model = mlp([4, 8, 3], 0)
    state = fzero.init(model, fzero.zero2(fzero.adamw(1e-2)), fzero.SimMesh(2))
    return state.replace(params=torch.full_like(state.params, value))


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _worker(mode: str, tmp_path: Path, *prefix: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*prefix, sys.executable, "-m", "tests.diskfull_worker", mode, str(tmp_path)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)


def _as_it_was(seen: dict, error: str) -> None:
    assert seen["outcome"].startswith(f"CheckpointError: {error}"), seen["outcome"]
    assert seen["outcome"].endswith("nothing was changed")
    assert seen["unchanged"] and seen["space_back"], seen  # no temporary left, every byte given back
    assert (seen["latest"], seen["loaded_tag"], seen["loaded_value"]) == ("a\n", "a", 1.0)


@pytest.mark.timeout(300)
def test_disk_full_on_latest_changes_nothing(tmp_path):
    """A 4 MiB tmpfs, in a private mount namespace, filled so that the new checkpoint's files fit and the `latest`
    pointer does not: the save fails before anything visible changed; once space is back, the next save succeeds
    and removes other saves' leftovers."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a private tmpfs")
    done = _worker("tmpfs", tmp_path, "unshare", "--mount", "--propagation", "private")
    if done.returncode != 0 and ("Operation not permitted" in done.stderr or done.returncode == 77):
        pytest.skip(f"cannot mount a private tmpfs here (needs CAP_SYS_ADMIN): {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    _as_it_was(seen["full"], "writing ")
    assert "/latest failed (OSError: No space left on device)" in seen["full"]["outcome"]
    after = seen["after"]
    assert after["outcome"] == "saved" and after["latest"] == "b\n" and after["loaded_value"] == 3.0
    assert [p for p in after["tree"] if "/" not in p] == ["a", "b", "latest"]  # .latest.tmp99999 and .c.tmp gone


@pytest.mark.timeout(300)
def test_disk_full_on_a_shard_changes_nothing(tmp_path):
    """RLIMIT_FSIZE makes the first shard write fail (EFBIG), for real, with no privilege needed."""
    done = _worker("fsize", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])["full"]
    _as_it_was(seen, "writing the shard files of ")
    assert "File too large" in seen["outcome"]


def test_overwriting_a_symlinked_tag_replaces_the_link_only(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    target = fzero.save(make(1.0), elsewhere, tag="kept")
    kept = {p: p.read_bytes() for p in target.iterdir()}
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "best").symlink_to(target, target_is_directory=True)
    with pytest.raises(CheckpointError, match="best already exists; pass overwrite=True"):
        fzero.save(make(2.0), root, tag="best")
    path = fzero.save(make(2.0), root, tag="best", overwrite=True)
    assert path.is_dir() and not path.is_symlink()
    assert listing(root) == ["best", *(f"best/{p.name}" for p in sorted(target.iterdir())), "latest"]
    assert {p: p.read_bytes() for p in target.iterdir()} == kept  # the link's target is never touched
    assert fzero.load(root, make())[0].params.flatten()[0] == 2.0
    # a dangling link is replaced as well
    (root / "gone").symlink_to(tmp_path / "nowhere")
    fzero.save(make(3.0), root, tag="gone", overwrite=True)
    assert (root / "gone").is_dir() and fzero.load(root, make())[0].params.flatten()[0] == 3.0


def test_leftovers_of_interrupted_saves_are_cleaned_by_any_save(tmp_path):
    fzero.save(make(1.0), tmp_path, tag="a")
    fzero.save(make(1.5), tmp_path, tag="c")
    os.rename(tmp_path / "c", tmp_path / ".c.old")  # an overwrite of c stopped between its two renames
    shutil.copytree(tmp_path / "a", tmp_path / ".a.old")  # one stopped after its second rename
    (tmp_path / ".a.tmp").mkdir()  # a save of a killed while writing
    (tmp_path / ".latest.tmp4242").write_text("a\n")  # one killed while writing the pointer
    (tmp_path / "notes.txt").write_text("mine")  # not fzero's: kept
    assert fzero.load(tmp_path, make(), tag="c")[0].params.flatten()[0] == 1.5  # found through .c.old
    fzero.save(make(2.0), tmp_path, tag="b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "latest", "notes.txt"]
    assert fzero.load(tmp_path, make(), tag="c")[0].params.flatten()[0] == 1.5


def test_shards_linked_out_of_the_directory_are_refused(tmp_path):
    root = tmp_path / "ckpts"
    path = fzero.save(make(), root)
    outside = tmp_path / "outside.safetensors"
    shard = path / "rank-00001-of-00002.safetensors"
    shutil.copy(shard, outside)  # the same bytes: every size and checksum would match
    shard.unlink()
    shard.symlink_to(outside)
    for run in (lambda: fzero.load(root, make()), lambda: fzero.consolidate(root),
                lambda: fzero.load(root, make(), verify=False)):  # fmt: skip
        with pytest.raises(CorruptCheckpointError, match=f"{shard}: a symbolic link out of the checkpoint"):
            run()
    shard.unlink()
    shutil.copy(outside, path / "copy.safetensors")
    shard.symlink_to("copy.safetensors")  # a link inside the directory is a file of the checkpoint
    assert fzero.load(root, make())[0].params.flatten()[0] == 0.25
    manifest = path / "manifest.json"
    shutil.move(manifest, tmp_path / "manifest.json")
    manifest.symlink_to(tmp_path / "manifest.json")
    with pytest.raises(CorruptCheckpointError, match=f"{manifest}: a symbolic link out of the checkpoint"):
        fzero.load(root, make())


def test_errors_never_repeat_file_contents(tmp_path):
    root = tmp_path / "ckpts"
    path = fzero.save(make(), root)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    for pointer in ("text", "link"):
        (root / "latest").unlink()
        if pointer == "text":
            (root / "latest").write_text(SECRET + "\n")
        else:
            (root / "latest").symlink_to(secret)
        expected = "does not hold a checkpoint tag" if pointer == "text" else "a symbolic link out of the"
        with pytest.raises(CheckpointError, match=f"latest: {expected}") as info:
            fzero.load(root, make())
        assert SECRET not in str(info.value)
    (root / "latest").unlink()
    (root / "latest").write_text("step0\n")
    shard = path / "rank-00000-of-00002.safetensors"
    shard.write_text(SECRET * 100)
    for run in (lambda: fzero.load(root, make()), lambda: fzero.load(root, make(), verify=False)):
        with pytest.raises(CorruptCheckpointError) as info:
            run()
        assert SECRET not in str(info.value) and str(shard) in str(info.value)
    (path / "manifest.json").write_text(SECRET)
    with pytest.raises(CorruptCheckpointError) as info:
        fzero.load(root, make())
    assert SECRET not in str(info.value)

"""Worker for `tests/test_checkpoint_atomic.py`: saves that run out of space, for real.

    python -m tests.diskfull_worker tmpfs DIR    # in a private mount namespace (unshare --mount): a small tmpfs
    python -m tests.diskfull_worker fsize DIR    # RLIMIT_FSIZE: any file write past a few KiB fails (EFBIG)

``tmpfs`` fills a 4 MiB tmpfs so that exactly the next checkpoint's directory fits and the ``latest`` pointer does
not; ``fsize`` lets the first shard file fail. Either way a checkpoint ``a`` was saved before, and the failing save
of ``b`` must leave everything as it was. Prints one JSON line of what it saw; exits 77 when the tmpfs cannot be
mounted (no privilege), for the test to skip.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

import fzero
from fzero.checkpoint import CheckpointError


def make(value: float):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    state = fzero.init(model, fzero.zero2(fzero.adamw(1e-3)), fzero.SimMesh(2))
    return state.replace(params=torch.full_like(state.params, value))


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def free_blocks(path: Path) -> int:
    """Free blocks of the file system at `path`: only for a file system this worker owns (its private tmpfs)."""
    return os.statvfs(path).f_bavail


def used_blocks(root: Path) -> int:
    """512-byte blocks allocated to `root` and everything under it: what this worker's saves own, whatever the rest of
    a shared disk is doing."""
    return sum(p.lstat().st_blocks for p in [root, *root.rglob("*")])


def attempt(root: Path, state, space=used_blocks) -> dict:
    """Save `state` as tag b; what happened and what is left (`space(root)`: the blocks to compare before and
    after)."""
    before, free = tree(root), space(root)
    try:
        fzero.save(state, root, tag="b", fsync=True)
        outcome = "saved"
    except CheckpointError as e:
        outcome = f"CheckpointError: {e}"
    except Exception as e:  # anything else is a failure of the test: report it
        outcome = f"{type(e).__name__}: {e}"
    loaded, extra = fzero.load(root, make(0.0))
    return {
        "outcome": outcome,
        "unchanged": tree(root) == before,
        "tree": tree(root),
        "space_back": space(root) == free,
        "latest": (root / "latest").read_text(),
        "loaded_tag": extra["tag"],
        "loaded_value": float(loaded.params.flatten()[0]),
    }


def on_tmpfs(base: Path) -> dict:
    mnt = base / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        sys.exit(77)
    root = mnt / "ckpts"
    fzero.save(make(1.0), root, tag="a")
    # a dry run elsewhere on the same file system: the blocks the new directory takes, latest excluded
    free = free_blocks(mnt)
    fzero.save(make(2.0), mnt / "dry", tag="b", latest=False)
    need = free - free_blocks(mnt)
    shutil.rmtree(mnt / "dry")
    with open(mnt / "filler", "wb") as f:  # leave exactly `need` blocks free
        f.write(bytes((free_blocks(mnt) - need) * os.statvfs(mnt).f_frsize))
    full = attempt(root, make(2.0), free_blocks)  # the tmpfs is ours: also catches unlinked-but-open files
    os.unlink(mnt / "filler")
    (root / ".latest.tmp99999").write_text("b\n")  # leftovers of other interrupted saves
    (root / ".c.tmp").mkdir()
    after = attempt(root, make(3.0), free_blocks)
    return {"full": full, "after": after}


def on_fsize(base: Path) -> dict:
    root = base / "ckpts"
    fzero.save(make(1.0), root, tag="a")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return {"full": attempt(root, make(2.0))}


if __name__ == "__main__":
    mode, base = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    print(json.dumps({"tmpfs": on_tmpfs, "fsize": on_fsize}[mode](base)))

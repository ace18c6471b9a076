"""Making a checkpoint visible all at once, or not at all.

A save writes into ``ROOT/.TAG.tmp``, flushes every file and the directory to the disk, then renames the directory
to ``ROOT/TAG`` (a rename within one file system is atomic) and flushes ``ROOT``; the ``ROOT/latest`` pointer (a
text file holding the tag) is replaced the same way, by writing a temporary file and renaming it over the old one.
A crash at any point leaves either the previous checkpoint and pointer, or the new ones: never a directory that
looks complete but is not. A leftover ``.TAG.tmp`` is removed by the next save of that tag, and never read.

Replacing an existing tag (`overwrite=True`) takes two renames (old out of the way, new in place); a crash between
them leaves the old checkpoint as ``ROOT/.TAG.old``, which `resolve` falls back to.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .errors import CheckpointError, CheckpointNotFoundError

__all__ = ["LATEST", "MANIFEST", "check_tag", "commit", "fsync_dir", "prepare", "read_latest", "resolve"]

LATEST = "latest"
MANIFEST = "manifest.json"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")


def check_tag(tag: object, where: str = "tag") -> str:
    """A tag is a plain directory name: letters, digits and ``_ . + = -``, not starting with a dot (those names
    are the temporaries'), at most 200 characters, and not ``latest``."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == LATEST:
        raise CheckpointError(
            f"{where} {tag!r} is not a valid checkpoint tag: use letters, digits and _ . + = - (not starting with "
            f"a dot, at most 200 characters, not {LATEST!r})"
        )
    return tag


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (new, renamed or removed files) to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows) order renames themselves
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.tmp"


def old_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.old"


def prepare(root: str | os.PathLike[str], tag: str, overwrite: bool) -> Path:
    """Create ``ROOT/.TAG.tmp`` afresh (removing a leftover of an interrupted save) and return it.

    Raises:
      CheckpointError: ``ROOT/TAG`` exists and `overwrite` is False.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / tag
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it, or choose another tag")
    tmp = temp_dir(root, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(root: str | os.PathLike[str], tag: str, latest: bool) -> Path:
    """Make ``ROOT/.TAG.tmp`` (its files already flushed) visible as ``ROOT/TAG``, then point ``latest`` at it."""
    root = Path(root)
    tmp, final, old = temp_dir(root, tag), root / tag, old_dir(root, tag)
    fsync_dir(tmp)
    replaced = final.exists()
    if replaced:
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    if replaced:
        shutil.rmtree(old)
    if latest:
        write_latest(root, tag)
    return final


def write_latest(root: Path, tag: str) -> None:
    """Point ``ROOT/latest`` at `tag`, atomically."""
    tmp = root / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: str | os.PathLike[str]) -> str | None:
    """The tag ``ROOT/latest`` names, or None without a pointer."""
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    return check_tag(path.read_text().strip(), where=f"{path} names")


def resolve(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The checkpoint directory meant by `path` and `tag`.

    `path` is either a checkpoint directory itself (it holds ``manifest.json``) or a root of tagged checkpoints;
    in a root, `tag` picks one and None means the one ``latest`` names.

    Raises:
      CheckpointNotFoundError: nothing there; the message says what was looked for.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such checkpoint directory")
    if tag is None:
        if (root / MANIFEST).is_file():
            return root
        tag = read_latest(root)
        if tag is None:
            unfinished = sorted(p.name for p in root.glob(".*.tmp"))
            hint = f" (only unfinished saves: {', '.join(unfinished)})" if unfinished else ""
            raise CheckpointNotFoundError(
                f"{root}: not a checkpoint (no {MANIFEST}) and no {LATEST!r} pointer to one{hint}; pass tag= to "
                "pick a checkpoint in it"
            )
    check_tag(tag)
    final = root / tag
    if final.is_dir():
        return final
    if old_dir(root, tag).is_dir():  # an overwrite stopped between its two renames: the old one is complete
        return old_dir(root, tag)
    raise CheckpointNotFoundError(f"{final}: no such checkpoint")

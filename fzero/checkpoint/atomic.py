"""Making a checkpoint visible all at once, or not at all.

A save writes into ``ROOT/.TAG.tmp`` and flushes every file and the directory to the disk. Then `commit` writes
the new ``latest`` pointer (a text file holding the tag) as ``ROOT/.latest.tmp<PID>`` and flushes it: everything
that needs disk space is written before anything visible changes, so a full disk fails the save with the previous
checkpoints and pointer untouched. Only renames follow (a rename within one file system is atomic): the new
directory to ``ROOT/TAG``, the temporary pointer over ``ROOT/latest``; if one of them fails, the ones done are
undone. A crash at any point leaves either the previous checkpoint and pointer, or the new ones: never a directory
that looks complete but is not.

Replacing an existing tag (`overwrite=True`) moves the old one to ``ROOT/.TAG.old`` first; a crash between the
renames leaves it there, and `resolve` falls back to it. A tag that is a symbolic link is replaced as a link: the
link goes, its target is never touched.

Leftovers of interrupted saves (``.TAG.tmp`` directories, ``.latest.tmp<PID>`` files, ``.TAG.old`` beside a
complete ``TAG``) are removed by the next save into the root, whatever its tag; a ``.TAG.old`` without ``TAG`` is
renamed back to ``TAG``. One process saves into a root at a time (on a `DistMesh`, rank 0 commits).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "LATEST",
    "MANIFEST",
    "check_tag",
    "clean_leftovers",
    "commit",
    "fsync_dir",
    "prepare",
    "read_latest",
    "resolve",
]

LATEST = "latest"
MANIFEST = "manifest.json"
_MAX_POINTER = 256  # bytes: a tag is at most 200 characters
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


def _latest_tmp(root: Path) -> Path:
    return root / f".{LATEST}.tmp{os.getpid()}"


def _remove(path: Path) -> None:
    """Remove a file, a directory tree, or a symbolic link (never what it points to); errors are ignored: a
    leftover is removed again by the next save."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


_LEFTOVER = re.compile(rf"\.(?P<tag>{_TAG.pattern})\.(?P<kind>tmp|old)|\.{LATEST}\.tmp\d+")


def clean_leftovers(root: str | os.PathLike[str]) -> None:
    """Remove what interrupted saves left in `root` (see the module docstring); best effort, never raises."""
    root = Path(root)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        m = _LEFTOVER.fullmatch(name)
        if m is None:
            continue
        path = root / name
        if m.group("kind") == "old" and not os.path.lexists(root / m.group("tag")):
            try:  # an overwrite stopped between its renames: the old checkpoint is the complete one
                os.rename(path, root / m.group("tag"))
                continue
            except OSError:
                pass
        _remove(path)
    fsync_dir(root)


def prepare(root: str | os.PathLike[str], tag: str, overwrite: bool) -> Path:
    """Clean the leftovers of interrupted saves, create ``ROOT/.TAG.tmp`` afresh and return it.

    Raises:
      CheckpointError: ``ROOT/TAG`` exists and `overwrite` is False.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(root)
    final = root / tag
    if os.path.lexists(final) and not overwrite:
        raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it, or choose another tag")
    tmp = temp_dir(root, tag)
    _remove(tmp)
    tmp.mkdir()
    return tmp


def commit(root: str | os.PathLike[str], tag: str, latest: bool) -> Path:
    """Make ``ROOT/.TAG.tmp`` (its files already flushed) visible as ``ROOT/TAG``, and point ``latest`` at it;
    on failure, everything visible is as it was and the temporaries are gone.

    Raises:
      CheckpointError: naming the step that failed (the cause is chained); nothing changed.
    """
    root = Path(root)
    tmp, final, old = temp_dir(root, tag), root / tag, old_dir(root, tag)
    pointer = _latest_tmp(root)
    fsync_dir(tmp)
    if latest:
        try:
            _write_pointer(pointer, tag)
        except OSError as e:
            _remove(pointer)
            _remove(tmp)
            raise CheckpointError(
                f"writing {root / LATEST} failed ({type(e).__name__}: {e.strerror or e}); nothing was changed"
            ) from e
    done: list[tuple[Path, Path]] = []  # renames made, to undo in reverse
    try:
        if os.path.lexists(final):
            _remove(old)
            os.rename(final, old)
            done.append((final, old))
        os.rename(tmp, final)
        done.append((tmp, final))
        if latest:
            os.replace(pointer, root / LATEST)
        fsync_dir(root)
    except OSError as e:
        for source, target in reversed(done):
            try:
                os.rename(target, source)
            except OSError:
                pass
        _remove(pointer)
        _remove(tmp)
        fsync_dir(root)
        raise CheckpointError(
            f"making {final} visible failed ({type(e).__name__}: {e.strerror or e}); nothing was changed"
        ) from e
    _remove(old)  # committed: what is left of the replaced checkpoint is only removed, never raised about
    return final


def _write_pointer(path: Path, tag: str) -> None:
    # O_EXCL | O_NOFOLLOW: a planted file or symbolic link is never written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())


def inside(path: Path, directory: Path) -> bool:
    """Whether `path`, its symbolic links followed, stays inside `directory`."""
    try:
        return path.resolve().is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # a loop of links
        return False


def read_latest(root: str | os.PathLike[str]) -> str | None:
    """The tag ``ROOT/latest`` names, or None without a pointer.

    Raises:
      CheckpointError: the pointer holds no valid tag (its contents are not repeated in the message), or is a
        symbolic link out of the root.
    """
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    if not inside(path, Path(root)):
        raise CheckpointError(f"{path}: a symbolic link out of the checkpoint root; refused")
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
        text = raw.decode("utf-8").strip() if len(raw) <= _MAX_POINTER else ""
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__})") from None
    if not _TAG.fullmatch(text) or text == LATEST:
        raise CheckpointError(f"{path}: does not hold a checkpoint tag (it is damaged, or not fzero's pointer)")
    return text


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

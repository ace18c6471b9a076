"""This process's scratch directory for swap files, and the cleanup of those crashed runs left behind.

Swap files are large (the offloaded state of the whole model) and worthless once their process is gone, so they
live in one directory per process, `<root>/fzero-<hostname>-<pid>-<8 hex chars>/`, removed when the run ends,
however it ends short of a kill. A run killed outright leaves its directory behind: the next run on the same host
removes every such directory whose process no longer exists, so crashed runs' files do not fill the device.

The hostname is in the name because `root` may be a shared filesystem: a pid means nothing on another host, so
other hosts' directories are never touched. Random hex tells apart two directories of one process, and a
directory of an earlier process that had the same pid.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import secrets
import shutil
import socket
import weakref
from typing import TypeVar

from .errors import StoragePathError, storage_error

__all__ = ["Closing", "ScratchDir"]

C = TypeVar("C", bound="Closing")


class Closing:
    """A context manager that closes itself on exit (`ScratchDir`, `SwapFile`, `IOPool`, checkpoint readers)."""

    def close(self) -> None:
        """Releases what the object holds; idempotent (each subclass's own)."""
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host() -> str:
    # a hostname could hold a '/' or worse; keep it a single, readable path component. A '-' stays: the name
    # still parses, as the pid and the hex after it must be exactly the last two '-'-separated fields
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would signal our process group: never a pid we wrote
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _remove_dead(root: pathlib.Path, host: str) -> None:
    """Removes `fzero-<host>-<pid>-<hex>` directories in root whose process is gone."""
    pattern = re.compile(rf"fzero-{re.escape(host)}-(\d+)-[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False) or _alive(int(m.group(1))):
            continue
        # best effort: another run may be removing it at the same moment
        shutil.rmtree(entry.path, ignore_errors=True)


def _remove(path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class ScratchDir(Closing):
    """This process's scratch directory `<root>/fzero-<hostname>-<pid>-<8 hex chars>/` for swap files.

    Created at construction; removed on `close()`, on `__exit__` and at interpreter exit. Creating one first
    removes the directories in `root` that this host's dead processes left.

    Args:
        root: an existing, writable directory (the offload path); it is not created, so a mistyped path fails
            here rather than filling whichever disk the new directory would land on.

    Raises:
        StoragePathError: root is missing, not a directory, or not writable.
        StorageFullError: no space for even the directory.
    """

    root: pathlib.Path
    path: pathlib.Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(root)
        if not self.root.exists():
            raise StoragePathError(f"{self.root}: the offload directory does not exist (it is not created for you)")
        if not self.root.is_dir():
            raise StoragePathError(f"{self.root}: the offload path is not a directory")
        host = _host()
        _remove_dead(self.root, host)
        self.path = self.root / f"fzero-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.path.mkdir(mode=0o700)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):
                why = errno.errorcode.get(e.errno or 0, str(e.errno))
                raise StoragePathError(
                    f"{self.root}: the offload directory is not writable: {why} ({e.strerror})"
                ) from e
            raise storage_error(e, self.path, "create the directory") from e
        self._closed = False
        self._finalizer = weakref.finalize(self, _remove, self.path)

    def file(self, name: str) -> pathlib.Path:
        """The path of a file in the scratch directory.

        Args:
            name: a plain file name (no '/', not '.' or '..').

        Returns:
            `path / name` (not created).
        """
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise ValueError(f"ScratchDir.file: {name!r} is not a plain file name (in {self.path})")
        if self._closed:
            raise ValueError(f"ScratchDir.file: {self.path} is closed")
        return self.path / name

    def close(self) -> None:
        """Removes the directory and everything in it. Idempotent."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return f"ScratchDir({str(self.path)!r}{', closed' if self._closed else ''})"

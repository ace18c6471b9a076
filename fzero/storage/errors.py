"""The storage layer's errors, and the one place where an `OSError` becomes one of them.

Offload files fail in a few ways a trainer must tell apart: a full disk (the run needs a bigger or emptier
`nvme_path`, retrying will not help), a bad offload directory (a configuration mistake), bytes that came back
different from what was written (the device or the file was damaged: the step's state is lost), and everything
else the kernel can say (EIO and friends). Each message names the file, so a failure on one of several NVMe
devices points at the right one; the original `OSError` stays attached as `__cause__`.
"""

from __future__ import annotations

import errno
import os

__all__ = ["StorageError", "StorageFullError", "StoragePathError", "SwapCorruptError", "errno_name", "storage_error"]


class StorageError(RuntimeError):
    """Base: an offload file could not be used (the message names the file)."""


class StorageFullError(StorageError):
    """ENOSPC, EDQUOT or EFBIG while allocating or writing (names file, bytes wanted, errno name)."""


class SwapCorruptError(StorageError):
    """A swap file was truncated (short read) or its bytes do not match the checksum written (names file, byte
    offset, expected vs got)."""


class StoragePathError(StorageError):
    """The offload directory is missing, not a directory, or not writable."""


# EFBIG: the file would pass RLIMIT_FSIZE or the filesystem's largest file; to the user it is the same "no room"
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# What opening a file in a bad directory gives: the directory, not the file or the device, is at fault
_PATH = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS})


def errno_name(e: OSError) -> str:
    """The symbolic name of an OSError's errno.

    Args:
        e: the error.

    Returns:
        "ENOSPC", "EIO", ...; "errno N" for a number without a name, "no errno" when there is none.
    """
    if e.errno is None:
        return "no errno"
    return errno.errorcode.get(e.errno, f"errno {e.errno}")


def storage_error(
    e: OSError,
    path: str | os.PathLike[str],
    action: str,
    *,
    offset: int | None = None,
    nbytes: int | None = None,
    opening: bool = False,
) -> StorageError:
    """The storage error for an OSError from open, fallocate, pwrite or pread (raise it `from e`).

    Args:
        e: what the system call raised.
        path: the file (or directory) it was about.
        action: what was being done, as a verb phrase: "write", "read", "preallocate", "create".
        offset: the byte offset of the transfer, if any.
        nbytes: the bytes wanted, if any.
        opening: the error came from creating or opening the file, so a missing, unwritable or read-only
            directory is a `StoragePathError`.

    Returns:
        `StorageFullError` for ENOSPC, EDQUOT and EFBIG; `StoragePathError` for ENOENT, ENOTDIR, EACCES, EPERM
        and EROFS when `opening`; `StorageError` otherwise. The message names the file, the errno and where.
    """
    name = errno_name(e)
    why = f"{name} ({e.strerror})" if e.strerror else name
    size = f" {nbytes} bytes" if nbytes is not None else ""
    at = f" at byte offset {offset}" if offset is not None else ""
    if e.errno in _FULL:
        return StorageFullError(f"{os.fspath(path)}: no space to {action}{size}{at}: {why}")
    if opening and e.errno in _PATH:
        return StoragePathError(f"{os.fspath(path)}: cannot {action} the file here: {why}")
    return StorageError(f"{os.fspath(path)}: could not {action}{size}{at}: {why}")

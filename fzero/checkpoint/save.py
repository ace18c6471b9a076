"""`save(state, directory)`: every rank writes its own shard file, rank 0 the manifest, and the checkpoint appears
all at once (see `fzero.checkpoint.atomic`), now or in the background (`blocking=False`).

On a `DistMesh` every rank calls `save` with its state and the mesh; each writes its file in parallel with the
others; the directory must be one file system that all ranks see (a shared or a local disk). On a `SimMesh` the
one process writes every rank's file.
"""

from __future__ import annotations

import os
from typing import Any

from . import background
from .writer import make_job, write

__all__ = ["save"]


def save(
    state: Any,
    directory: str | os.PathLike[str],
    *,
    mesh: Any = None,
    tag: str | None = None,
    data_position: int | None = None,
    user_state: Any = None,
    config: Any = None,
    latest: bool = True,
    overwrite: bool = False,
    fsync: bool = True,
    blocking: bool = True,
) -> Any:
    """Save a training state as a sharded, checksummed checkpoint ``DIRECTORY/TAG``.

    Every leaf of the state is saved, whatever its fields (the parameters, the optimizer state with its step count
    and hence the learning-rate schedule's position, the loss scale, the accumulation counters, frozen parameters,
    buffers), with this process's random generators, so that `load` resumes bitwise where the save was taken.

    Args:
      state: a `TrainState` (all ranks of a `SimMesh`, or this rank's of a `DistMesh`).
      directory: the root that holds tagged checkpoints and the ``latest`` pointer (created if needed).
      mesh: the `DistMesh` of a distributed state (every rank must call `save`); not needed on a `SimMesh`. A hybrid
        state (`DistMesh(shape=...)`) is saved as its first shard group's world-S state: replica 0's ranks write,
        every rank takes part (`fzero.checkpoint.hybrid`).
      tag: the checkpoint's name; default ``step{N}`` with `N` the state's micro-step count.
      data_position: where the data loader stands (e.g. samples consumed), returned by `load`.
      user_state: anything JSON-serialisable to keep with the checkpoint (DeepSpeed's `client_state`).
      config: the run's configuration (JSON-serialisable), recorded in the manifest.
      latest: point ``DIRECTORY/latest`` at this checkpoint.
      overwrite: replace an existing checkpoint of the same tag (else that is an error).
      fsync: flush files and directories to the disk (leave on unless the disk is a scratch space).
      blocking: False: copy the state to host memory and return at once, writing in a background thread while
        training goes on (`fzero.checkpoint.background`: the files hold the state at the call, bitwise; the host
        memory taken is one copy of this process's part of the state until the write ends).

    Returns:
      The checkpoint's directory; with ``blocking=False`` a `SaveHandle` (`.wait()` returns the directory or raises
      the save's error, `.done()`).

    Raises:
      CheckpointError: the tag exists (without `overwrite`), or a rank failed to write; nothing becomes visible.
      ValueError: a hybrid state whose replicas differ (a local accumulator mid-window): it names the leaf.
    """
    background.wait_pending(directory)  # at most one save in flight per root: this one waits for the last
    job = make_job(state, directory, mesh, tag, data_position, user_state, config, latest, overwrite, fsync)
    if not blocking:
        return background.start(job, mesh)
    return write(job)

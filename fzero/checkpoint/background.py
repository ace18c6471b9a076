"""`save(..., blocking=False)`: the state copied to host memory at the call, then written by a background thread
while training goes on.

    handle = fzero.save(state, "ckpts", blocking=False)   # returns after the copy (the "staging")
    state, metrics = train(state, batch)                   # the next steps run while it writes
    handle.wait()                                          # the checkpoint's directory, or the save's error

**What is written** is the state at the call, bitwise: every leaf this process writes is copied (a CUDA leaf into
pinned host memory) before `save` returns, so steps that update the state in place (`donate=True`) cannot reach
the files; the process's random generators are captured at the call too.

**Host memory.** One copy of this process's part of the state (the bytes of its shard files, less the generator
states: `SaveHandle.staged_bytes`), taken at the call and freed when the write ends. A state with leaves offloaded
to NVMe is refused (its swap files change at the next step, and copying it would take the memory offload saves).

**Atomic as the blocking save.** The thread runs the same write (`fzero.checkpoint.writer.write`): shard files in a
temporary directory, the manifest last, one rename. A process killed in mid-write leaves the previous checkpoint
loadable and no partial one visible.

**One save in flight per root.** A `save` or `load` of a root waits for the background save to it in flight.
A failure is raised by `SaveHandle.wait`; one nobody waited for is printed to stderr when it happens and raised
by the next `save` or `load` of that root, so no failed checkpoint goes unnoticed. The interpreter waits for the
writes at exit (the thread is not a daemon).

**On a `DistMesh`** the ranks agree on each phase of the write as in a blocking save, over a second gloo process
group made once for the purpose (every rank's first background save creates it, collectively), so that these
messages never interleave with the training's collectives. It needs the mesh to span every process.

**The thread runs at the lowest CPU priority** (`nice` 19, Linux), so that on a machine whose cores the training
keeps busy the write takes their idle time instead of slowing the steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..storage import Offloaded
from .coord import Coordinator
from .errors import CheckpointError
from .hybrid import GroupCoordinator
from .sources import MemorySource
from .writer import Job, write

__all__ = ["SaveHandle", "start", "wait_pending"]

_NICE = 19  # the writer's priority below the training's: the lowest (Linux `nice`)


class SaveHandle:
    """A background save: `wait()` for its checkpoint directory (or its error), `done()` to poll.

    Attributes:
      path: the checkpoint directory it is writing (``root/tag``), visible once the write commits.
      staged_bytes: the host memory this process's copy of the state takes until the write ends.
    """

    def __init__(self, path: Path, staged_bytes: int) -> None:
        self.path = path
        self.staged_bytes = staged_bytes
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._seen = False  # whether the error reached the caller

    def done(self) -> bool:
        """Whether the write has ended (committed or failed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the write to end.

        Returns:
          The checkpoint's directory.

        Raises:
          TimeoutError: still writing after `timeout` seconds.
          CheckpointError: the save failed (as `save` would have raised it); nothing became visible.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} is still writing after {timeout} s")
        if self._error is not None:
            self._seen = True
            raise self._error
        return self.path

    def _run(self, job: Job) -> None:
        try:
            if hasattr(os, "setpriority"):
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
                except OSError:  # (a sandbox may forbid it: the write just competes with the steps)
                    pass
            write(job)
        except BaseException as e:
            self._error = e
            print(f"fzero: the background save of {self.path} failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            self._finished.set()  # (the thread's end drops `job`, and with it the staged copy)

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error is not None else "done")
        return f"SaveHandle({str(self.path)!r}, {state}, staged {self.staged_bytes / 2**20:.1f} MiB)"


_pending: dict[str, SaveHandle] = {}
_lock = threading.Lock()
_side_groups: dict[tuple[int, ...], Any] = {}


def _key(root: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(root))


def wait_pending(root: str | os.PathLike[str]) -> None:
    """Wait for the background save to `root` (a root, or the checkpoint directory) in flight, if any; raise its
    failure if nobody has seen it.

    Raises:
      CheckpointError: that save failed and its handle's `wait` was never called.
    """
    key = _key(root)
    with _lock:  # (`root` may also be the checkpoint directory itself, as `load` takes it)
        found = [k for k, h in _pending.items() if key in (k, _key(h.path))]
        handle = _pending.pop(found[0]) if found else None
    if handle is None:
        return
    handle._finished.wait()
    if handle._error is not None and not handle._seen:
        handle._seen = True
        raise CheckpointError(
            f"the background save of {handle.path} failed ({type(handle._error).__name__}: {handle._error}); "
            "that checkpoint was not written"
        ) from handle._error


def _copy(x: Tensor) -> Tensor:
    """`x` in host memory of its own (pinned for a CUDA tensor: the copy then runs at the link's speed)."""
    if x.device.type == "cpu":
        return x.detach().clone(memory_format=torch.contiguous_format)
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x.detach(), non_blocking=True)


def _stage(source: MemorySource, ranks: list[int]) -> tuple[MemorySource, int]:
    """A `MemorySource` over copies of the leaves the files of `ranks` hold, and those copies' bytes."""
    flat, leaves, staged = source.flat, [], 0
    for entry, x in zip(flat.entries, flat.leaves, strict=True):
        stored = source.entries[entry.key]
        if not any(stored.in_file(r) for r in ranks):
            leaves.append(x.new_empty(0) if isinstance(x, Tensor) else x)  # never read: not kept alive
            continue
        if isinstance(x, Offloaded):
            raise ValueError(
                f"save(blocking=False): leaf {entry.key!r} is offloaded to NVMe ({x.store.scratch.root}); its swap "
                "files change at the next step and copying it to memory would take the memory offload saves: save "
                "it with blocking=True"
            )
        copy = _copy(x)
        staged += copy.numel() * copy.element_size()
        leaves.append(copy)
    if any(x.device.type == "cuda" for x in flat.leaves if isinstance(x, Tensor)):
        torch.cuda.synchronize()  # the non-blocking copies have landed before the caller's next step writes
    copied = dataclasses.replace(flat, leaves=tuple(leaves))
    storage = {key: e.storage for key, e in source.entries.items()}
    return MemorySource(copied, storage, rank=source.rank), staged


class _SideMesh:
    """What a `Coordinator` needs of a mesh, over the background saves' own gloo group (host tensors)."""

    def __init__(self, mesh: Any, group: Any) -> None:
        self.local_ranks, self.world, self.group = mesh.local_ranks, mesh.world, group

    def all_gather(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.cpu(), group=self.group)
        return torch.cat(parts)


def _side_coordinator(coord: Coordinator | GroupCoordinator, mesh: Any) -> Coordinator | GroupCoordinator:
    """`coord` speaking over the side group (created here, collectively, on the first call)."""
    if not coord.distributed:
        return coord
    ranks = tuple(dist.get_process_group_ranks(mesh.group)) if mesh.group is not None else None
    if ranks is not None and len(ranks) != dist.get_world_size():
        raise ValueError(
            f"save(blocking=False) on a DistMesh of {len(ranks)} of the {dist.get_world_size()} processes: the "
            "background writes agree over a process group of every process; save this mesh with blocking=True"
        )
    ranks = ranks or tuple(range(dist.get_world_size()))
    if ranks not in _side_groups:
        _side_groups[ranks] = dist.new_group(backend="gloo", timeout=getattr(mesh, "_timeout", None))
    side = _SideMesh(mesh, _side_groups[ranks])
    if isinstance(coord, GroupCoordinator):
        return GroupCoordinator(side, coord.group_world, "cpu", saving=True)
    return Coordinator(side, distributed=True, world=coord.world, device="cpu")


def start(job: Job, mesh: Any) -> SaveHandle:
    """Stage `job`'s state and write it in a background thread (every rank of a `DistMesh` calls it)."""
    source, staged = _stage(job.source, job.coord.ranks)
    job = dataclasses.replace(job, source=source, coord=_side_coordinator(job.coord, mesh))
    handle = SaveHandle(job.root / job.tag, staged)
    with _lock:
        _pending[_key(job.root)] = handle
    threading.Thread(target=handle._run, args=(job,), name=f"fzero-save-{job.tag}", daemon=False).start()
    return handle

"""Keeping the ranks of a `DistMesh` in step while they save or load: each phase ends with every rank telling the
others whether it succeeded, so all of them raise the same error together instead of some waiting forever in the
next collective. In a single process (a `SimMesh`, or world 1) there is nobody to tell."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import errors
from .errors import CheckpointError

__all__ = ["Coordinator"]

_MESSAGE = 2048  # bytes of an error message sent to the other ranks
_KINDS = {
    cls.__name__: cls
    for cls in (
        errors.CheckpointError,
        errors.CheckpointNotFoundError,
        errors.CorruptCheckpointError,
        errors.IncompatibleCheckpointError,
        errors.CheckpointVersionError,
    )
}


class Coordinator:
    """The ranks one process speaks for, and how to reach the others.

    Args:
      mesh: the state's mesh: a `DistMesh` when the state is one rank's (not simulated) and the world is above 1;
        otherwise unused.
      distributed: whether the state is a `DistMesh` rank's.
      world: the state's world size.
      device: where the messages travel (the state's device: NCCL moves CUDA tensors only).
    """

    def __init__(self, mesh: Any, distributed: bool, world: int, device: torch.device | str = "cpu") -> None:
        self.mesh = mesh
        self.device = torch.device(device)
        self.distributed = distributed and world > 1
        if self.distributed:
            if mesh is None or len(mesh.local_ranks) != 1:
                raise TypeError(f"a DistMesh state of world {world} needs its mesh: pass mesh=fzero.DistMesh()")
            if mesh.world != world:
                raise ValueError(f"the mesh has world {mesh.world}, the state world {world}")
            self.rank = mesh.local_ranks[0]
        else:
            self.rank = 0
        self.world = world

    @property
    def ranks(self) -> list[int]:
        """The ranks whose values this process holds."""
        return [self.rank] if self.distributed else list(range(self.world))

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's `x` stacked (`[world, ...]`); in one process, `x[None]`."""
        if not self.distributed:
            return x.unsqueeze(0)
        flat = self.mesh.all_gather(x.reshape(-1).contiguous().to(self.device))
        return flat.view(self.world, *x.shape).cpu()

    def exchange(self, text: str) -> list[str]:
        """Every rank's `text` (at most 2 KiB of UTF-8 each)."""
        if not self.distributed:
            return [text]
        data = text.encode("utf-8")[:_MESSAGE]
        buf = torch.zeros(_MESSAGE, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        every = self.all_gather(buf)
        return [bytes(row.tolist()).rstrip(b"\0").decode("utf-8", "replace") for row in every]

    def agree(self, error: BaseException | None, what: str) -> None:
        """End a phase: raise on every rank if it failed on any (the failing rank re-raises its own error; the
        others raise the same class with its message)."""
        texts = self.exchange("" if error is None else f"{type(error).__name__}\n{error}")
        if error is not None:
            raise error
        for rank, text in enumerate(texts):
            if text:
                kind, _, message = text.partition("\n")
                raise _KINDS.get(kind, CheckpointError)(f"{what} failed on rank {rank}: {message}")

"""The ranks agree, once per step, that they ran the same step, before any of them applies it.

Collectives pair by order alone: a rank that skips a step, runs one more, or abandons one halfway (an exception in
its forward, caught by a "skip the bad batch" loop) leaves its collectives paired with the wrong ones of the
others, which then train on mixed-up gradients, until a size mismatch aborts the process. So every step of a
`DistMesh` exchanges a 256-byte fingerprint after its gradients are reduced and before the optimizer runs:

    micro-step count | collectives issued this step | failed | what failed (text)

On any difference, or if any rank failed, every rank raises `DesyncError` in that step, before any update: after
a failure the ranks are still in step (the failed rank completed the step's collectives with zero gradients, see
`fzero.sharding.units`), so a loop that catches the error on every rank can go on; after a difference in steps they are
not, and training must stop. Cost: one all-gather of 256 bytes per rank per step (a `SimMesh` runs its ranks in one
process and needs none).
"""

from __future__ import annotations

import struct

import torch

from .protocol import Mesh

__all__ = ["DesyncError", "agree"]

_SIZE = 256
_HEADER = struct.Struct("<qqq")  # micro-step count, collectives, failed


class DesyncError(RuntimeError):
    """The ranks did not run the same step: a rank failed in it, or they are at different steps or ran different
    collectives. Raised on every rank, in the same step, before any update.

    Attributes:
      failures: `{rank: "ExceptionType: message"}` for the ranks whose forward or backward raised.
      fingerprints: per rank, `(micro-step count, collectives this step, failed)`.
      in_step: whether the ranks are still in step (True when every rank reached the same point and only some
        failed: the step was abandoned everywhere and training may go on).
    """

    def __init__(self, message: str, failures: dict[int, str], fingerprints: list[tuple[int, ...]]) -> None:
        super().__init__(message)
        self.failures, self.fingerprints = failures, fingerprints
        self.in_step = len({f[:2] for f in fingerprints}) == 1


DesyncError.__module__ = "fzero.mesh"  # (its public name, in tracebacks: `fzero.mesh.DesyncError`)


def _pack(step: int, calls: int, failure: BaseException | None) -> torch.Tensor:
    text = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[: _SIZE - _HEADER.size]
    raw = _HEADER.pack(step, calls, failure is not None) + text
    return torch.frombuffer(bytearray(raw.ljust(_SIZE, b"\0")), dtype=torch.uint8)


def agree(mesh: Mesh, step: int, calls: int, failure: BaseException | None) -> None:
    """Exchange this rank's fingerprint; raise `DesyncError` (from `failure`, if this rank's) on every rank unless
    all ran the same step without failure. A no-op where this process runs every rank (a `SimMesh`, one rank).

    Args:
      mesh: the step's mesh.
      step: the state's micro-step count.
      calls: the collectives this rank issued in this step so far.
      failure: the exception this rank's forward or backward raised (the step's collectives were completed).
    """
    if len(mesh.local_ranks) == mesh.world:  # one process runs every rank: they run every step together
        if failure is not None:
            raise failure
        return
    rows = mesh.exchange(_pack(step, calls, failure))
    prints = [_HEADER.unpack(bytes(r[: _HEADER.size].tolist())) for r in rows]
    failures = {
        r: bytes(row[_HEADER.size :].tolist()).rstrip(b"\0").decode(errors="replace")
        for r, (row, p) in enumerate(zip(rows, prints, strict=True)) if p[2]
    }  # fmt: skip
    if not failures and len(set(prints)) == 1:
        return
    me = mesh.local_ranks[0]
    if failures and len({p[:2] for p in prints}) == 1:
        who = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
        message = (
            f"rank {me} of {mesh.world}: step {step} was abandoned on every rank because the forward or backward "
            f"of {len(failures)} rank(s) raised ({who}). No rank applied it, and the ranks are still in step: a "
            "loop that catches this error on every rank may go on with the next batch."
        )
    else:
        table = ", ".join(f"rank {r}: micro-step {p[0]}, {p[1]} collectives" for r, p in enumerate(prints))
        message = (
            f"rank {me} of {mesh.world}: the ranks are out of step ({table}). Every rank must call the step the same "
            "number of times with the same units running in the same order; a rank that skipped or repeated a step "
            "(e.g. a data loader that dropped a batch on one rank, an exception caught outside the step) "
            "exchanged parameters and gradients with another step's. No rank applied this step; stop and resume "
            "from a checkpoint."
        )
    raise DesyncError(message, failures, prints) from failure

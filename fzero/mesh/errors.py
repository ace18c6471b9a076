"""`CollectiveError`: a `DistMesh` collective that failed, told in words: which rank, which collective, the timeout,
and the rank that stopped answering where it can be told."""

from __future__ import annotations

import datetime
import re

from torch import Tensor

__all__ = ["CollectiveError", "collective_error"]


class CollectiveError(RuntimeError):
    """A collective of a `DistMesh` failed on this rank: it waited longer than the timeout for another rank, or a
    peer closed its connection, or the backend refused it.

    Attributes:
      rank, world: this rank and the group's size.
      collective: ``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"`` or ``"broadcast"``.
      elements, dtype: the size and dtype of this rank's input.
      timeout: the timeout in seconds (from the backend's message, else the mesh's), None if unknown.
      timed_out: whether the backend reported a timeout.
      peer: the rank that stopped answering or closed its connection, None when the backend does not tell (gloo
        names no rank: it is told in a group of two, where only one other rank exists).
      backend_message: the backend's own message.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world: int,
        collective: str,
        elements: int,
        dtype: str,
        timeout: float | None,
        timed_out: bool,
        peer: int | None,
        backend_message: str,
    ) -> None:
        super().__init__(message)
        self.rank, self.world, self.collective, self.elements, self.dtype = rank, world, collective, elements, dtype
        self.timeout, self.timed_out, self.peer, self.backend_message = timeout, timed_out, peer, backend_message


CollectiveError.__module__ = "fzero.mesh"  # (its public name, in tracebacks: `fzero.mesh.CollectiveError`)


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_TIMEOUT_MS = re.compile(r"Timed out waiting (\d+)\s*ms|Timeout\(ms\)=(\d+)")
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused", re.IGNORECASE)
_SOURCE = re.compile(r"^\s*\[[^\]]*\.(cc|cpp|h):\d+\]\s*")  # gloo's "[.../unbound_buffer.cc:78] " prefix
_HINT = (
    "Every rank must issue the same collectives in the same order: a rank that hangs, stops, crashes or skips one "
    "leaves the others waiting. Set the limit with DistMesh(timeout=SECONDS), the config's comms_config.timeout, or "
    "fzero train --timeout."
)


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    return None if timeout is None else timeout.total_seconds()


def collective_error(
    err: BaseException, *, rank: int, world: int, collective: str, x: Tensor, timeout: float | None
) -> CollectiveError:
    """The `CollectiveError` for a backend's exception `err` raised by `collective` on tensor `x` (see the class)."""
    backend = _SOURCE.sub("", str(err)).strip()
    timed_out = bool(_TIMED_OUT.search(backend))
    m = _TIMEOUT_MS.search(backend)
    if m:
        timeout = int(m.group(1) or m.group(2)) / 1000
    gone = bool(_PEER_GONE.search(backend))
    peer = 1 - rank if world == 2 and (timed_out or gone) else None
    what = f"{collective} of {x.numel()} {str(x.dtype).removeprefix('torch.')} elements"
    limit = "" if timeout is None else f" after {timeout:g} s"
    if timed_out:
        head = f"rank {rank} of {world} timed out{limit} in {what}"
    else:
        head = f"rank {rank} of {world} failed in {what}"
    if peer is not None:
        how = "stopped answering" if timed_out else "closed its connection (it crashed or was killed)"
        who = f": rank {peer} {how} (the only other rank of the group)"
    elif timed_out or gone:
        how = "stopped answering" if timed_out else "closed its connection"
        who = f": the backend does not say which of the other {world - 1} ranks {how}"
    else:
        who = ""
    message = f"{head}{who}. {_HINT} Backend: {backend}"
    return CollectiveError(
        message, rank=rank, world=world, collective=collective, elements=x.numel(),
        dtype=str(x.dtype).removeprefix("torch."), timeout=timeout, timed_out=timed_out, peer=peer,
        backend_message=backend,
    )  # fmt: skip

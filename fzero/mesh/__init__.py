"""The mesh layer: who am I, how many are we, and the collectives, with a ledger of what they move.

`SimMesh` simulates W ranks in one process (per-rank values on a leading `[W, ...]` axis), `DistMesh` is a
`torch.distributed` process group (gloo on CPU, NCCL on GPU); both implement `Mesh`. How a process runs its ranks'
code (`ranks`) and the per-step agreement of the ranks (`agreement`) live here too: nothing outside this package
asks which kind of mesh it runs on. May import: `fzero.host`, `fzero.layout`.
"""

from .agreement import DesyncError, agree
from .meshes import (
    AllOf,
    CollectiveError,
    DistMesh,
    Ledger,
    Mesh,
    Pending,
    Ready,
    ReduceOp,
    SimMesh,
    Work,
    collective_error,
    completed,
    done,
    progress,
)

__all__ = [
    "AllOf",
    "CollectiveError",
    "DesyncError",
    "DistMesh",
    "Ledger",
    "Mesh",
    "Pending",
    "Ready",
    "ReduceOp",
    "SimMesh",
    "Work",
    "agree",
    "collective_error",
    "completed",
    "done",
    "progress",
]

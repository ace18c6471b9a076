"""The mesh layer: who am I, how many are we, and the collectives, with a ledger of what they move.

`SimMesh` simulates W ranks in one process (per-rank values on a leading `[W, ...]` axis), `DistMesh` is a
`torch.distributed` process group (gloo on CPU, NCCL on GPU); both implement `Mesh`. How a process runs its ranks'
code (`ranks`) and the per-step agreement of the ranks (`agreement`) live here too: nothing outside this package
asks which kind of mesh it runs on. Code written for one rank runs on every rank through `Mesh.run`
(`lockstep`: a `SimMesh`'s ranks take turns at each collective).

May import: `fzero.host`, `fzero.layout`.
"""

from .agreement import DesyncError, agree
from .dist import DistMesh
from .errors import CollectiveError, collective_error
from .handles import AllOf, Pending, Ready, ReduceOp, Work, completed, done, progress
from .ledger import Ledger
from .lockstep import MismatchError
from .protocol import Mesh, RankMesh
from .sim import SimMesh

__all__ = [
    "AllOf",
    "CollectiveError",
    "DesyncError",
    "DistMesh",
    "Ledger",
    "Mesh",
    "MismatchError",
    "Pending",
    "RankMesh",
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

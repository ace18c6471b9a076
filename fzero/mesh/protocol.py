"""Who am I, how many are we, and the collectives, with a ledger of what they move.

(Over 500 lines: the two implementations of one protocol, `SimMesh` and `DistMesh`, sit side by side so that their
arithmetic, rank-ordered sums divided by `world`, reads the same: the suite holds them bitwise equal.)

Every collective fzero issues goes through a `Mesh`. Values are *per-rank*:

- on `DistMesh` a per-rank value is this process's tensor;
- on `SimMesh(world=W)` it is a tensor with a leading `[W, ...]` axis, row `r` being rank `r`'s value, so W ranks
  run exactly in one process. Reductions add the ranks' rows in rank order, so results are deterministic.

Collectives act on the last dimension, split into `world` equal chunks (the chunk `r` belongs to rank `r`):

=================  ==========================  =============================================
collective         per-rank input              per-rank output
=================  ==========================  =============================================
`all_reduce`       `[..., n]`                  `[..., n]`, the sum (or mean) over ranks
`reduce_scatter`   `[..., world * s]`          `[..., s]`, chunk `rank` of the sum (or mean)
`all_gather`       `[..., s]`                  `[..., world * s]`, every rank's chunk in rank order
`broadcast`        `[...]`                     `[...]`, rank `src`'s value
`local_shard`      `[..., world * s]`          `[..., s]`, chunk `rank` of the rank's own value
=================  ==========================  =============================================

`all_reduce_start` and `reduce_scatter_start` (over every rank, or a named `axis`) start the same reductions and
return a handle whose `wait()` gives the result and whose `is_completed()` says, without blocking, whether `wait()`
would: a `DistMesh`'s backend works on it meanwhile (stages reduce each unit's gradient this way while the backward
goes on; a hybrid reduction chains an axis's reduce-scatter and the other's all-reduce), a `SimMesh` has computed it
already.

A collective never writes the caller's tensor, except an all-reduce given `inplace=True` (the caller hands `x`
over, e.g. a gradient it has just cast: a `DistMesh` then reduces in it instead of in a copy; a `SimMesh` computes a
new tensor either way). A mean is the rank-ordered sum divided by `world` on every implementation, so `SimMesh` and
`DistMesh` agree bitwise wherever the backend's sum does (always for two ranks).

The ledger (`Mesh.record()`) counts, per collective, calls, the logical element count of the operation
(`elements`: the full buffer size for reduce-scatter and all-gather, twice it for an all-reduce: the ZeRO paper's
accounting) and the elements each rank sends and receives with a bandwidth-optimal ring algorithm
(`(world - 1) / world` of those).

**Named axes.** `SimMesh(shape={"replicate": R, "shard": S})` and `DistMesh(shape=...)` arrange `R * S` ranks
row-major on a grid (rank `i * S + j` sits at `replicate=i, shard=j`), and every collective takes the `axis` it
runs over: `reduce_scatter(x, "mean", axis="shard")` reduces within each group of ranks that differ only in their
`shard` coordinate (the group's ranks in coordinate order play the ranks of a 1-D mesh of size S, with the same
arithmetic, so results stay bitwise reproducible); `axis=None` (the default) runs over every rank, exactly as on a
1-D mesh. `size(axis)` is the group's size and `index(axis)` each rank's coordinate. The ledger records named-axis
collectives under `"{collective}:{axis}"` with the axis's own size in the ring factor, and, there only, `bytes`:
the payload per rank (elements times element size, of the full buffer), so `ledger.on("replicate")` shows what
crossed the slow axis (docs/hybrid.md).

A `DistMesh` collective that fails (it waited longer than the mesh's `timeout` for another rank, or a peer closed
its connection) raises `CollectiveError` on the ranks still running, naming this rank, the collective, its size,
the timeout and, where it can be told, the rank that stopped answering; an async handle's `wait()` does the same.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from .handles import Pending, Ready, ReduceOp, Work
from .ledger import Ledger

__all__ = ["Mesh", "RankMesh"]


@runtime_checkable
class Mesh(Protocol):
    """The ranks of a data-parallel run as the process holding some of them sees them (see the module docstring).

    Per-rank values: each rank has its own value of a per-rank tensor (a gradient, a shard); this process holds
    those of `local_ranks`, and `pick` / `stack` convert between that representation and each rank's own value
    (a `SimMesh` holds every rank's on a leading `[world, ...]` axis; a `DistMesh` holds its own rank's, unstacked).
    Code written for one rank runs through `run(fn, ...)`, which calls `fn(rank_mesh, ...)` once per local rank
    with that rank's values and a `RankMesh` (`rank` an int, collectives on that rank's own values); the same
    function gives the same result on every kind of mesh. The collectives below act on per-rank values directly.
    """

    world: int
    shape: dict[str, int]

    @property
    def axes(self) -> tuple[str, ...]: ...

    def size(self, axis: str | None = None) -> int: ...

    @property
    def local_ranks(self) -> tuple[int, ...]: ...

    def pick(self, x: Any, rank: int) -> Any: ...

    def stack(self, values: Sequence[Any]) -> Any: ...

    def map(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def set_timeout(self, timeout: float | datetime.timedelta) -> None: ...

    def exchange(self, x: Tensor) -> Tensor: ...

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor: ...

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor: ...

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready | Pending: ...

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready | Pending: ...

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False, axis: str | None = None) -> Work: ...

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor: ...

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor: ...

    def replicate(self, x: Tensor) -> Tensor: ...

    def unreplicate(self, x: Tensor) -> Tensor: ...

    def record(self) -> contextlib.AbstractContextManager[Ledger]: ...

    def account(self, kind: str, full: int, axis: str | None = None, itemsize: int = 4) -> None: ...


@runtime_checkable
class RankMesh(Mesh, Protocol):
    """A mesh seen from one rank (a `DistMesh`; a `SimMesh`'s rank inside `SimMesh.run`): per-rank values are this
    rank's own, and it knows which rank it is."""

    @property
    def rank(self) -> int: ...

    def index(self, axis: str | None = None) -> int: ...

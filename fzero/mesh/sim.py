"""`SimMesh`: `world` ranks simulated in one process, on a leading `[world, ...]` axis; deterministic."""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from .base import MeshBase, _check_chunks, _finish, _shape, coordinate
from .handles import Ready, ReduceOp, Work, done
from .ledger import Ledger
from .lockstep import run_stacked, stack_ranks

__all__ = ["SimMesh"]


class SimMesh(MeshBase):
    """`world` ranks simulated in one process on a leading `[world, ...]` axis; deterministic.

    Args:
      world: number of simulated ranks (a 1-D mesh).
      shape: instead of `world`, named axes and their sizes, outermost first, e.g. `{"replicate": 2, "shard": 2}`:
        `world` is their product and rank `r` sits at the row-major coordinates of `r` (see the module docstring).

    Example:
      >>> import torch
      >>> mesh = SimMesh(world=2)
      >>> mesh.reduce_scatter(torch.tensor([[1., 2.], [10., 20.]]))
      tensor([[11.],
              [22.]])
      >>> grid = SimMesh(shape={"replicate": 2, "shard": 2})
      >>> grid.all_reduce(torch.tensor([[1.], [2.], [3.], [4.]]), axis="replicate").flatten()  # ranks 0+2, 1+3
      tensor([4., 6., 4., 6.])
    """

    def __init__(self, world: int | None = None, *, shape: Mapping[str, int] | None = None) -> None:
        if shape is not None:
            self.shape = _shape(shape, "SimMesh(shape=...)")
            n = math.prod(self.shape.values())
            if world is not None and world != n:
                raise ValueError(f"SimMesh: world={world!r} but shape {self.shape} has {n} ranks; give one of them")
            world = n
        else:
            self.shape = {}
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"SimMesh(world=...) needs an int >= 1, got {world!r}")
        self.world = world
        self._ledgers: list[Ledger] = []
        # one 1-D mesh per axis does each group's arithmetic: the same code, so the same bits, as SimMesh(size)
        self._sub = {name: SimMesh(n) for name, n in self.shape.items()}

    def __repr__(self) -> str:
        if self.shape:
            return f"SimMesh(shape={self.shape})"
        return f"SimMesh(world={self.world})"

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Nothing to do: the simulated ranks run in one process and cannot wait for one another."""

    def exchange(self, x: Tensor) -> Tensor:
        """Every rank's `x` (`[world, ...]`), as `DistMesh.exchange` gives each rank: here, `x` itself."""
        return x

    def coords(self, axis: str | None = None) -> Tensor:
        """Each simulated rank's coordinate along `axis` (its rank for None), on the world axis."""
        return torch.tensor([coordinate(self.shape, r, axis) for r in range(self.world)])

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks of `rank`'s group along `axis`, in coordinate order."""
        n = self.size(axis)
        inner = math.prod(list(self.shape.values())[list(self.shape).index(axis) + 1 :])
        base = rank - (rank // inner % n) * inner
        return [base + k * inner for k in range(n)]

    def _grouped(self, x: Tensor, axis: str, fn: Callable[[SimMesh, Tensor], Tensor]) -> Tensor:
        """`fn(sub, y)` on `y = [n, groups, ...]`: the `n` ranks of each group along `axis` in coordinate order (a
        1-D mesh `sub` of size n acting on every group at once), its result moved back to the world axis."""
        self.size(axis)  # an unknown axis: say which exist
        sizes = list(self.shape.values())
        k = list(self.shape).index(axis)
        grid = x.reshape(*sizes, *x.shape[1:]).movedim(k, 0)  # [n, other axes..., ...]
        others = grid.shape[1 : len(sizes)]
        y = grid.reshape(sizes[k], math.prod(others), *x.shape[1:])
        out = fn(self._sub[axis], y)  # [n, groups, ...]
        out = out.reshape(sizes[k], *others, *out.shape[2:]).movedim(0, k)
        return out.reshape(self.world, *out.shape[len(sizes) :])

    def _rows(self, x: Tensor, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != self.world:
            raise ValueError(
                f"{what}: {self!r} expects a leading world axis of size {self.world}, got shape {tuple(x.shape)}"
            )

    def _sum(self, x: Tensor) -> Tensor:
        total = x[0]
        for r in range(1, self.world):  # rank order, as the docstring promises
            total = total + x[r]
        return total

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor:
        if axis is not None:
            self._rows(x, "all_reduce")
            self._log("all_reduce", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.all_reduce(y, op))
        self._rows(x, "all_reduce")
        self._log("all_reduce", x[0].numel(), None, x.element_size())
        if self.world == 1:
            return _finish(x, op, 1)
        return _finish(self._sum(x), op, self.world).expand_as(x)

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor:
        # (`out`: a DistMesh's; simulated ranks' results are stacked, so they keep buffers of their own)
        if axis is not None:
            self._rows(x, "reduce_scatter")
            _check_chunks(x, self.size(axis), "reduce_scatter")
            self._log("reduce_scatter", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.reduce_scatter(y, op))
        self._rows(x, "reduce_scatter")
        _check_chunks(x, self.world, "reduce_scatter")
        self._log("reduce_scatter", x[0].numel(), None, x.element_size())
        if self.world == 1:
            return _finish(x, op, 1)
        total = _finish(self._sum(x), op, self.world)  # [..., world * s]
        return total.unflatten(-1, (self.world, -1)).movedim(-2, 0).contiguous()

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready:
        """`all_reduce` (over `axis`), as a handle (simulated ranks reduce at once)."""
        return Ready(self.all_reduce(x, op, axis=axis))

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready:
        """`reduce_scatter` (over `axis`), as a handle (simulated ranks reduce at once)."""
        return Ready(self.reduce_scatter(x, op, axis=axis))

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "all_gather")
            self._log("all_gather", x[0].numel() * self.size(axis), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.all_gather(y))
        self._rows(x, "all_gather")
        self._log("all_gather", x.numel(), None, x.element_size())
        full = x.movedim(0, -2).flatten(-2)
        return full.expand(self.world, *full.shape).contiguous()

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor:
        """Each rank's `[..., n * s]` split into `n` chunks, chunk `k` sent to the group's rank `k`: per rank, the
        `[n, ..., s]` chunks received, row `k` from the group's rank `k` (no arithmetic)."""
        self._rows(x, "all_to_all")
        n = self.size(axis)
        _check_chunks(x, n, "all_to_all")  # (SimMesh.all_to_all)
        self._log("all_to_all", x[0].numel(), axis, x.element_size())
        if axis is not None:
            return self._grouped(x, axis, lambda m, y: m._exchange(y).movedim(1, 2))  # [to, groups, from, ...]
        return self._exchange(x)

    def _exchange(self, x: Tensor) -> Tensor:
        chunks = x.unflatten(-1, (self.world, -1))  # [world (from), ..., world (to), s]
        return chunks.movedim(-2, 0).contiguous()  # [to, from, ..., s]

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False, axis: str | None = None) -> Work:
        """`all_gather(x, axis)` written into the per-rank `out` (`[world, n * s]` for `x` of `[world, s]`);
        synchronous, the returned handle is already complete."""
        out.copy_(self.all_gather(x, axis))
        return done

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "broadcast")
            self._log("broadcast", x[0].numel(), axis, x.element_size())
            return self._grouped(x, axis, lambda m, y: m.broadcast(y, src))
        self._rows(x, "broadcast")
        self._log("broadcast", x[0].numel(), None, x.element_size())
        return x[src].expand_as(x).contiguous()

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            self._rows(x, "local_shard")
            _check_chunks(x, self.size(axis), "local_shard")
            return self._grouped(x, axis, lambda m, y: m.local_shard(y))
        self._rows(x, "local_shard")
        _check_chunks(x, self.world, "local_shard")
        chunks = x.unflatten(-1, (self.world, -1))  # [world, ..., world, s]
        return torch.stack([chunks[r, ..., r, :] for r in range(self.world)]).contiguous()

    def replicate(self, x: Tensor) -> Tensor:
        """The per-rank value whose every rank holds `x` (no communication)."""
        return x.expand(self.world, *x.shape).contiguous()

    def unreplicate(self, x: Tensor) -> Tensor:
        """Rank 0's value of a per-rank value that every rank holds alike (after an all-reduce, say)."""
        return x[0]

    # ------------------------------------------------------------------------------------------- per-rank values
    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks whose values this process holds: every one, row `r` of a per-rank value being rank `r`'s."""
        return tuple(range(self.world))

    def pick(self, x: Any, rank: int) -> Any:
        """Rank `rank`'s value of a per-rank pytree (every tensor leaf's row `rank`; other leaves as they are)."""
        return optree.tree_map(lambda t: t[rank] if isinstance(t, Tensor) else t, x)

    def stack(self, values: Sequence[Any]) -> Any:
        """The per-rank pytree whose rank `r`'s value is `values[r]` (tensors stacked on a leading world axis; other
        leaves must be equal on every rank)."""
        return stack_ranks(values)

    def map(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn` on each rank's slice of `args` (pytrees of per-rank values), in rank order, in this thread, the results
        stacked: for per-rank code that issues no collective (a forward and backward). A Python loop rather than
        `vmap`, so each rank runs exactly the kernels a real process would and the results are bitwise those of
        `DistMesh`."""
        return self.stack([fn(*self.pick(args, r)) for r in range(self.world)])

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(rank_mesh, *args_r)` for every rank, the results stacked: per-rank code that may issue collectives on
        `rank_mesh` (`fzero.mesh.lockstep.SimRank`: this rank's values, `rank` an int), run in lockstep, so it gives
        what each process of a `DistMesh` would (`fzero.mesh.lockstep`)."""
        return run_stacked(self, fn, args)

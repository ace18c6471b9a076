"""How a process runs its ranks' code: the one place where a `SimMesh` and a `DistMesh` differ beyond collectives.

A step's per-rank code (a forward and backward, stage 3's unit-by-unit gathering and reduction) runs, on a
`DistMesh`, once, for this process's rank; on a `SimMesh`, once per simulated rank, one after another. A collective
whose inputs every rank has up front (the all-gather of parameter shards) can be simulated at once; one whose inputs
the ranks produce as they run (the reduction of a unit's gradient during each rank's backward) can only be done once
every rank has produced its part. `ranks_of(mesh)` gives the strategy object that hides this:

    ranks.indices                       the ranks this process runs
    ranks.pick(x, r) / ranks.stack(xs)  rank r's value of a per-rank value / the per-rank value of each rank's
    ranks.gather_into(out, shards, piece, r, async_op)
                                        rank r's all-gather of `piece` of every rank's shard into `out`
    ranks.reduction(fn, layout, budget) per-unit reductions: `add(unit, rank, grads)` as each rank's unit gradient
                                        completes, `result()` this process's reduced gradient shard(s): a DistMesh
                                        reduces at once (freeing the unit's gradient; with a `budget`, a reduction
                                        `fn` started asynchronously stays in flight, at most `budget` elements at
                                        once), a SimMesh once every rank's part is in (the same arithmetic and
                                        ledger as the real run)

Example:
    >>> import torch, fzero
    >>> ranks = ranks_of(fzero.SimMesh(world=2))
    >>> ranks.indices, ranks.pick(torch.tensor([[1.0], [2.0]]), 1)
    ((0, 1), tensor([2.]))
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import optree
import torch
from torch import Tensor

from ..host import scratch
from ..layout import Layout
from ..layout.int8 import dequantize, quantize
from ..layout.pieces import Pieces, takes_pieces, whole
from .dist import DistMesh
from .handles import AllOf, Pending, Work, completed, done, progress
from .lockstep import SimRank
from .protocol import Mesh, RankMesh
from .sim import SimMesh

__all__ = ["Ranks", "Reduction", "check_batch", "one_rank", "rank_view", "ranks_of", "regroup", "stacks"]

ReduceFn = Callable[..., "Tensor | Work"]
"""`fn(grads, unit, place=None)`: a unit's reduction; `place(shape, dtype)`, where given, is its result's place in
the step's gradient, or None (`fzero.transforms.Context.place`). It may also have `landed(unit, grads, piece)`,
called with each unit's reduced gradients (a view of the result) as soon as piece `piece` of them is in (a
speculative update starts there: `fzero.transforms.speculate`)."""


def _landed(fn: ReduceFn) -> Callable[[int, Tensor, int], None] | None:
    return getattr(fn, "landed", None)


def _value(x: Tensor | Work) -> Tensor:
    """A reduction's result, waited for if it was started as a handle."""
    return x if isinstance(x, Tensor) else cast(Tensor, x.wait())  # a reduction's handle yields its tensor


class Reduction(Protocol):
    peak: int  # the most gradient elements whose reduction was in flight at once

    def add(self, unit: int, rank: int, grads: Tensor | Pieces) -> None: ...

    def result(self) -> Tensor: ...


class Ranks(Protocol):
    @property
    def mesh(self) -> Mesh: ...  # (read-only: a `SimRanks` holds a `SimMesh`)

    @property
    def indices(self) -> tuple[int, ...]: ...

    def pick(self, x: Any, rank: int) -> Any: ...

    def stack(self, values: Sequence[Any]) -> Any: ...

    def gather_into(
        self,
        out: Tensor,
        shards: Tensor,
        piece: slice,
        rank: int,
        async_op: bool,
        axis: str | None = None,
        block: int | None = None,
    ) -> Work: ...

    def secondary(self, full: Tensor, axis: str) -> Tensor: ...

    def reduction(self, fn: ReduceFn, layout: Layout, budget: int | None = None, reuse: bool = False) -> Reduction: ...


def _assemble(layout: Layout, parts: Sequence[Tensor | None]) -> Tensor:
    """Concatenate per-unit reduced pieces in unit order, zeros for units no gradient reached. A piece is a unit's
    shard (reduce-scatter) or the whole unit (all-reduce); the present ones say which."""
    i, like = next((i, p) for i, p in enumerate(parts) if p is not None)
    whole = like.shape[-1] == layout.units[i].size

    def zeros(unit: int) -> Tensor:
        size = layout.units[unit].size
        return like.new_zeros(*like.shape[:-1], size if whole else size // layout.world)

    return torch.cat([p if p is not None else zeros(u) for u, p in enumerate(parts)], -1)


class _DistReduction:
    """Reduce each unit's gradient as it arrives, into this rank's gradient shard (added: a second backward through
    the graph accumulates, as autograd would). With a `budget`, the reduction may return a handle (it was started
    and the backward goes on); before starting one that would put more than `budget` elements in flight, the
    oldest are waited on; `result()` waits for the rest.

    A handle may chain collectives (a hybrid reduction's all-reduce over the replicate axis starts once its
    reduce-scatter over the shard axis has completed). gloo pairs a group's collectives by the order they are issued
    in, so every rank must start those second collectives in the same (unit) order: as each unit's gradient arrives
    (and after each wait), the handles in flight are advanced oldest first, stopping at the first that cannot
    advance yet; waits go oldest first too. A handle counts its unit's `n` gradient elements against the budget
    until it is waited on, whichever of its collectives is running.

    Each unit's result is copied into the shard as soon as it has landed (its pieces summed in arrival order), so
    the shard and the reductions in flight are all that is held: never every unit's piece and their concatenation
    at once (twice the gradient shard, which an NVMe-offloaded run would otherwise keep as its peak).

    With `reuse`, the result is a buffer kept from one step to the next (`fzero.scratch`), resident between steps
    (`fzero.sharding.units` asks for it wherever the units are in memory); without, it is fresh each step, its pages
    faulted in unit by unit as the backward reaches them (the NVMe tier's: less memory through the forward, a page
    fault per 4 KiB of the shard every step)."""

    def __init__(self, fn: ReduceFn, layout: Layout, budget: int | None, reuse: bool = False) -> None:
        self.fn, self.layout, self.budget, self.reuse = fn, layout, budget, reuse
        self.pieces: dict[int, list[Tensor | Work | None]] = {}  # None: folded into the shard (freed)
        self.folded: dict[int, int] = {}
        self.flight: collections.deque[tuple[int, int, int]] = collections.deque()  # (unit, its piece, elements)
        self.elements = self.peak = 0
        self.out: Tensor | None = None
        self.whole = False
        self.landed = _landed(fn)

    def add(self, unit: int, rank: int, grads: Tensor | Pieces) -> None:
        if not takes_pieces(self.fn):
            grads = whole(grads)
        n = grads.numel()
        while self.flight and self.budget is not None and self.elements + n > self.budget:
            self._land()
        pieces = self.pieces.setdefault(unit, [])
        # the unit's first piece may go straight to its place in the result: no buffer of its own, no copy
        like = grads.like if isinstance(grads, Pieces) else grads
        pieces.append(self.fn(grads, unit, place=None if pieces else functools.partial(self._place, unit, like)))
        if not isinstance(pieces[-1], Tensor):
            self.flight.append((unit, len(pieces) - 1, n))
            self.elements += n
            self.peak = max(self.peak, self.elements)
            self._advance()
        self._fold(unit, pieces)

    def _advance(self) -> None:
        """Start what the reductions in flight can start now (`fzero.mesh.progress`), oldest first, stopping at the
        first that cannot: so every rank starts them in unit order. Then land those that have completed, oldest
        first (without blocking): their units' gradients are freed as soon as they can be, not when the budget or
        the end of the backward says so."""
        for unit, i, _ in self.flight:
            if not progress(self.pieces[unit][i]):
                break
        while self.flight and completed(cast(Work, self.pieces[self.flight[0][0]][self.flight[0][1]])):
            self._land(advance=False)

    def _land(self, advance: bool = True) -> None:
        """Wait for the oldest reduction in flight (which starts what it has not started yet: it is the oldest),
        then advance the others."""
        unit, i, n = self.flight.popleft()
        pieces = self.pieces[unit]
        pieces[i] = _value(cast(Work, pieces[i]))
        self.elements -= n
        self._fold(unit, pieces)
        if advance:
            self._advance()

    def _dest(self, unit: int) -> Tensor:
        """The unit's place in the result (which exists)."""
        lay, out = self.layout, cast(Tensor, self.out)
        return out[..., lay.unit_slice(unit) if self.whole else lay.unit_shard_slice(unit)]

    def _create(self, shape: tuple[int, ...], dtype: torch.dtype, like: Tensor, unit: int) -> None:
        """The result, for a first piece of `shape` and `dtype`: shards (reduce-scatter) or whole units (all-reduce)."""
        self.whole = shape[-1] == self.layout.units[unit].size
        size = self.layout.numel if self.whole else self.layout.shard_numel
        like = like.new_empty(0, dtype=dtype)
        shape = (*shape[:-1], size)
        self.out = scratch.new_empty("gradient", like, shape) if self.reuse else like.new_empty(shape)

    def _place(self, unit: int, grads: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        """The place of unit `unit`'s first piece of `shape` and `dtype` in the result (created, on `grads`'
        device, by the first one asked for), or None where the result's shape or dtype is another's."""
        if self.out is None:
            self._create(tuple(shape), dtype, grads, unit)
        dest = self._dest(unit)
        return dest if dest.shape == tuple(shape) and dest.dtype == dtype else None

    def _fold(self, unit: int, pieces: list[Tensor | Work | None]) -> None:
        """Add the unit's landed pieces, in arrival order up to the first still in flight, into the shard."""
        while self.folded.get(unit, 0) < len(pieces) and isinstance(pieces[self.folded.get(unit, 0)], Tensor):
            k = self.folded.get(unit, 0)
            piece = cast(Tensor, pieces[k])
            pieces[k] = None
            self.folded[unit] = k + 1
            if self.out is None:
                self._create(tuple(piece.shape), piece.dtype, piece, unit)
            dest = self._dest(unit)
            if k:
                dest.add_(piece)
            elif piece.data_ptr() != dest.data_ptr():  # (a piece reduced in its place is there already)
                dest.copy_(piece)
            if self.landed is not None:
                self.landed(unit, dest, k)

    def result(self) -> Tensor:
        while self.flight:
            self._land()
        if self.out is None:
            return _assemble(self.layout, [None] * len(self.layout.units))
        for unit in range(len(self.layout.units)):  # zeros for units no gradient reached
            if not self.folded.get(unit):
                self._dest(unit).zero_()
        return self.out


class _SimReduction:
    """Keep each rank's unit gradients; reduce every unit once all ranks' are in, rank-ordered."""

    def __init__(self, fn: ReduceFn, layout: Layout, world: int) -> None:
        self.fn, self.layout, self.world = fn, layout, world
        self.grads: dict[int, dict[int, Tensor]] = {}
        self.peak = 0  # nothing in flight: the simulated ranks reduce at once

    def add(self, unit: int, rank: int, grads: Tensor | Pieces) -> None:
        grads = whole(grads)
        mine = self.grads.setdefault(unit, {})
        mine[rank] = grads if rank not in mine else mine[rank] + grads

    def result(self) -> Tensor:
        parts: list[Tensor | None] = []
        for i in range(len(self.layout.units)):
            per_rank = self.grads.get(i)
            parts.append(
                None if per_rank is None else _value(self.fn(torch.stack([per_rank[r] for r in range(self.world)]), i))
            )
        out = _assemble(self.layout, parts)
        landed = _landed(self.fn)
        if landed is not None:  # (the simulated ranks' backwards are over: every unit lands now)
            lay = self.layout
            for i, part in enumerate(parts):
                if part is not None:
                    whole = part.shape[-1] == lay.units[i].size
                    landed(i, out[..., lay.unit_slice(i) if whole else lay.unit_shard_slice(i)], 0)
        return out


class _Ranks:
    """What every strategy shares: the mesh's own ranks and its per-rank representation."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.indices = mesh.local_ranks

    def pick(self, x: Any, rank: int) -> Any:
        return None if x is None else self.mesh.pick(x, rank)

    def stack(self, values: Sequence[Any]) -> Any:
        return None if values[0] is None else self.mesh.stack(values)


class SimRanks(_Ranks):
    """Every simulated rank, in turn (values carry a leading world axis)."""

    mesh: SimMesh

    def gather_into(self, out: Tensor, shards: Tensor, piece: slice, rank: int, async_op: bool,
                    axis: str | None = None, block: int | None = None) -> Work:  # fmt: skip
        # from the ranks of this rank's group along the axis, or from every rank
        rows = shards[self.mesh.group(rank, axis), piece] if axis is not None else shards[:, piece]
        if block is None:
            out.copy_(rows.reshape(-1))
            if rank == 0:  # the simulated ranks gather together: count the collective once
                self.mesh.account("all_gather", out.numel(), axis, out.element_size())
            return done
        q, scales = quantize(rows, block)
        out.copy_(dequantize(q, scales, block, rows.shape[-1]).reshape(-1))
        if rank == 0:
            self.mesh.account("all_gather", q.numel(), axis, 1)
            self.mesh.account("all_gather", scales.numel(), axis, scales.element_size())
        return done

    def secondary(self, full: Tensor, axis: str) -> Tensor:
        """Every rank's hpZ secondary chunk of a gathered unit (`full`, the same on every rank), `[world, n / S]`:
        rank r's is chunk `coords(axis)[r]` of the `S = size(axis)` chunks."""
        return full.view(self.mesh.size(axis), -1)[self.mesh.coords(axis)]

    def reduction(self, fn: ReduceFn, layout: Layout, budget: int | None = None, reuse: bool = False) -> Reduction:
        return _SimReduction(fn, layout, self.mesh.world)


class DistRanks(_Ranks):
    """This process's own rank (of a `DistMesh`, or a `SimMesh`'s rank in `SimMesh.run`: any `RankMesh`)."""

    mesh: RankMesh

    def gather_into(self, out: Tensor, shards: Tensor, piece: slice, rank: int, async_op: bool,
                    axis: str | None = None, block: int | None = None) -> Work:  # fmt: skip
        mesh = self.mesh
        if block is None:
            return mesh.all_gather_into(out, shards[piece].detach(), async_op=async_op, axis=axis)
        n = mesh.size(axis)
        q, scales = quantize(shards[piece].detach(), block)
        gq, gs = q.new_empty(n * q.numel()), scales.new_empty(n * scales.numel())
        works = [mesh.all_gather_into(gq, q, async_op=async_op, axis=axis),
                 mesh.all_gather_into(gs, scales, async_op=async_op, axis=axis)]  # fmt: skip
        m = shards[piece].shape[-1]

        def finish() -> Tensor:
            out.copy_(dequantize(gq.view(n, -1), gs.view(n, -1), block, m).reshape(-1))
            return out

        return Pending(AllOf(works), finish, q, scales, gq, gs)

    def secondary(self, full: Tensor, axis: str) -> Tensor:
        """This rank's hpZ secondary chunk of a gathered unit: chunk `index(axis)` of `size(axis)` (a copy)."""
        return full.view(self.mesh.size(axis), -1)[self.mesh.index(axis)].clone()

    def reduction(self, fn: ReduceFn, layout: Layout, budget: int | None = None, reuse: bool = False) -> Reduction:
        return _DistReduction(fn, layout, budget, reuse)


def ranks_of(mesh: Mesh) -> SimRanks | DistRanks:
    """The strategy for `mesh` (see the module docstring)."""
    return SimRanks(mesh) if isinstance(mesh, SimMesh) else DistRanks(mesh)


def one_rank(mesh: RankMesh) -> DistRanks:
    """The strategy for a process that runs one rank imperatively, unit by unit (the engine): its own values."""
    return DistRanks(mesh)


def rank_view(mesh: Mesh) -> RankMesh:
    """`mesh` as the one rank this process runs sees it: a `DistMesh` itself; a one-rank `SimMesh` its rank 0 (a
    `RankMesh` of world 1: values unstacked, every collective the identity, no process group).

    Raises:
      ValueError: `mesh` holds several ranks in this process (a `SimMesh` of world above 1).
    """
    if isinstance(mesh, SimMesh):
        if mesh.world != 1:
            raise ValueError(f"one rank per process, but {mesh!r} holds {mesh.world}: use a DistMesh under torchrun, "
                             "or SimMesh(1)")  # fmt: skip
        return SimRank(mesh, 0, None)
    if not isinstance(mesh, RankMesh):
        raise TypeError(f"expected a mesh (fzero.SimMesh(1) or fzero.DistMesh), got {type(mesh).__name__}")
    return mesh


def check_batch(mesh: Mesh, batch: Any) -> None:
    """Check that `batch` is a per-rank value of `mesh`: on a `SimMesh` every leaf a tensor with a leading world
    axis (each rank's batch stacked); on a process's own rank anything goes.

    Raises:
      TypeError, ValueError: naming the leaf's path and what was expected.
    """
    if not isinstance(mesh, SimMesh):
        return
    for path, leaf in zip(*optree.tree_flatten_with_path(batch)[:2], strict=False):
        where = "batch" + "".join(f"[{p!r}]" for p in path)
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{where} is a {type(leaf).__name__}; on a SimMesh every batch leaf must be a tensor")
        if leaf.ndim == 0 or leaf.shape[0] != mesh.world:
            raise ValueError(
                f"{where} has shape {tuple(leaf.shape)}, but {mesh!r} needs a leading world axis of "
                f"{mesh.world}: shape [{mesh.world}, per-rank batch, ...]"
            )


def stacks(mesh: Mesh) -> bool:
    """Whether `mesh` keeps per-rank values on a leading world axis (a `SimMesh`, all ranks in one process): what a
    state built on it looks like, which the state records (`fzero.Plan.stacked`) to be read without a mesh."""
    return isinstance(mesh, SimMesh)


def regroup(mesh: Mesh, shape: dict[str, int]) -> Mesh:
    """The ranks of `mesh` arranged on the named axes `shape` (row-major, `prod(shape) == mesh.world`): a `DistMesh`
    over the same process group (its sub-groups made on every rank alike), or a `SimMesh` of that shape."""
    if isinstance(mesh, DistMesh):
        return DistMesh(mesh.group, shape=shape)
    if isinstance(mesh, SimMesh):
        return SimMesh(shape=shape)
    raise TypeError(f"regroup: {mesh!r} is one rank's view of a mesh; regroup the mesh itself")

"""Per-rank code on a `SimMesh`: each simulated rank runs it as a process would, in lockstep with the others.

`SimMesh.run(fn, *args)` calls `fn(mesh_r, *args_r)` for every rank `r`, where `args_r` is rank `r`'s slice of the
per-rank arguments and `mesh_r` a `SimRank`: the mesh as rank `r` sees it, with `rank == r` and collectives that
take and return rank `r`'s own values, as a `DistMesh` does in a process. The ranks run in threads of their own, but
never two at once: rank 0 runs until it reaches a collective, then rank 1 until it reaches its own, and so on; the
last rank's arrival completes the collective for every rank (the `SimMesh`'s arithmetic on the stacked inputs,
counted once in the ledger), and rank 0 resumes. So the same code gives the same result on a `SimMesh` and on a
`DistMesh`, bitwise wherever their collectives agree, and runs in the same order every time: no draw, no counter,
no cache a rank touches is raced by another.

The ranks must issue the same collectives in the same order, as real processes must: a rank that calls another
collective, or returns while the others wait in one, fails the run with `MismatchError` naming both (a
`DistMesh` would hang until its timeout). An exception in one rank ends every rank and is raised by `run`.

Example:
    >>> import torch, fzero
    >>> mesh = fzero.SimMesh(world=2)
    >>> def scaled_by_rank(m, x):                 # written for one rank: `x` is this rank's row
    ...     return m.all_reduce(x * (m.rank + 1))
    >>> mesh.run(scaled_by_rank, torch.tensor([[1.0], [2.0]]))   # 1*1 + 2*2 on both ranks
    tensor([[5.],
            [5.]])
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch
from torch import Tensor

from .base import OwnRank, _check_chunks, coordinate
from .handles import Ready, ReduceOp, Work, done
from .protocol import Mesh

__all__ = ["MismatchError", "SimRank", "run_ranks", "run_stacked", "stack_ranks"]


class MismatchError(RuntimeError):
    """The simulated ranks of a `SimMesh.run` did not issue the same collectives: a real run would hang."""


MismatchError.__module__ = "fzero.mesh"  # (its public name, in tracebacks: `fzero.mesh.MismatchError`)


class _Abort(BaseException):
    """Ends a rank's thread when another rank failed (a BaseException: a rank's own `except Exception` lets it
    through)."""


_FINISHED = object()


class _Arrival:
    """What a rank brought to a round: a collective (`key` names it and its arguments, `x` its input)."""

    def __init__(self, key: tuple, x: Any, compute: Callable[[list[Any]], list[Any]]) -> None:
        self.key, self.x, self.compute = key, x, compute


class _Lockstep:
    """The turn-taking of `world` rank threads (see the module docstring)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cv = threading.Condition()
        self.turn = 0
        self.arrivals: list[Any] = [None] * world
        self.results: list[Any] = [None] * world
        self.error: BaseException | None = None

    def _wait_for_turn(self, rank: int) -> None:
        """Block until it is `rank`'s turn (call with `cv` held)."""
        while self.turn != rank and self.error is None:
            self.cv.wait()
        if self.error is not None:
            raise _Abort

    def start(self, rank: int) -> None:
        with self.cv:
            self._wait_for_turn(rank)

    def arrive(self, rank: int, arrival: Any) -> Any:
        """Rank `rank` reached a collective (`_Arrival`) or returned (`_FINISHED`) in the current round; the
        collective's result for it, once every rank has arrived."""
        with self.cv:
            self.arrivals[rank] = arrival
            if rank + 1 < self.world:
                self.turn = rank + 1
            else:
                self._complete()
            self.cv.notify_all()
            if arrival is _FINISHED:
                return None
            self._wait_for_turn(rank)
            result, self.results[rank] = self.results[rank], None
            return result

    def _complete(self) -> None:
        """Every rank has arrived: run the round's collective for all of them (or find that they all returned)."""
        arrivals, self.arrivals = self.arrivals, [None] * self.world
        if all(a is _FINISHED for a in arrivals):
            self.turn = -1
            return
        first = next(a for a in arrivals if a is not _FINISHED)
        for r, a in enumerate(arrivals):
            if a is _FINISHED or a.key != first.key:
                what = "returned" if a is _FINISHED else f"called {_describe(a.key)}"
                r0 = arrivals.index(first)
                raise MismatchError(f"SimMesh.run: rank {r} {what} while rank {r0} called {_describe(first.key)}: "
                                    "every rank must issue the same collectives in the same order (on a DistMesh "
                                    "the ranks would wait for each other until the timeout)")  # fmt: skip
        self.results = first.compute([a.x for a in arrivals])
        self.turn = 0

    def fail(self, error: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = error
            self.cv.notify_all()


def _describe(key: tuple) -> str:
    name, *args = key
    shown = ", ".join(str(a) for a in args if a is not None)
    return f"{name}({shown})"


def run_ranks(sim: Mesh, fn: Callable[..., Any], per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
    """`fn(SimRank(sim, r), *per_rank[r])` for every rank, in lockstep (see the module docstring); the results in
    rank order. Grad mode is the caller's in every rank."""
    world = sim.world
    if world == 1:  # one rank: nothing to take turns with
        return [fn(SimRank(sim, 0, None), *per_rank[0])]
    lock = _Lockstep(world)
    outs: list[Any] = [None] * world
    grad = torch.is_grad_enabled()

    def body(rank: int) -> None:
        try:
            lock.start(rank)
            with torch.set_grad_enabled(grad):
                outs[rank] = fn(SimRank(sim, rank, lock), *per_rank[rank])
            lock.arrive(rank, _FINISHED)
        except _Abort:
            pass
        except BaseException as e:  # (raised by `run_ranks` in the caller's thread)
            lock.fail(e)

    threads = [threading.Thread(target=body, args=(r,), name=f"fzero-rank-{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if lock.error is not None:
        raise lock.error
    return outs


def run_stacked(sim: Mesh, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """`SimMesh.run`: `run_ranks` on each rank's slice of `args` (tensor leaves' rows; other leaves as they are), the
    results stacked (`stack_ranks`). An output that is rank `r`'s own slice of an input, on every rank, is that input
    itself (a value passed through costs no copy)."""
    sliced: dict[int, tuple[Tensor, int]] = {}  # id(row view) -> (the stacked input, its row)
    keep: list[Tensor] = []  # (the views, alive while their ids are keys)

    def slice_of(t: Any, r: int) -> Any:
        if not isinstance(t, Tensor):
            return t
        view = t[r]
        sliced[id(view)] = (t, r)
        keep.append(view)
        return view

    per_rank = [tuple(optree.tree_map(lambda t, r=r: slice_of(t, r), list(args))) for r in range(sim.world)]  # type: ignore[arg-type]
    outs = run_ranks(sim, fn, per_rank)
    return stack_ranks(outs, sliced)


def stack_ranks(values: Sequence[Any], sliced: dict[int, tuple[Tensor, int]] | None = None) -> Any:
    """The per-rank pytree of `values` (rank `r`'s value `values[r]`): tensor leaves stacked on a leading world
    axis (or, where every rank's is its row of one stacked tensor of `sliced`, that tensor); other leaves must be
    equal on every rank (a value every rank uses alike), else `MismatchError` names the leaf."""
    paths, first, spec = optree.tree_flatten_with_accessor(values[0])
    leaves = [first] + [spec.flatten_up_to(v) for v in values[1:]]
    out = []
    for i, path in enumerate(paths):
        column = [row[i] for row in leaves]
        if isinstance(column[0], Tensor):
            out.append(_stacked(column, sliced))
            continue
        for r, x in enumerate(column[1:], 1):
            if not _same(x, column[0]):
                where = path.codify("") or "the value"
                raise MismatchError(f"per-rank code returned {where} = {column[0]!r} on rank 0 but {x!r} on rank {r}: "
                                    "a value that is not a tensor must be the same on every rank (return a tensor, "
                                    "which is kept per rank, or agree on it with a collective)")  # fmt: skip
        out.append(column[0])
    return optree.tree_unflatten(spec, out)


def _stacked(column: list[Tensor], sliced: dict[int, tuple[Tensor, int]] | None) -> Tensor:
    if sliced:
        src = [sliced.get(id(t)) for t in column]
        if all(s is not None and s[0] is src[0][0] and s[1] == r for r, s in enumerate(src)):  # type: ignore[index]
            return src[0][0]  # type: ignore[index]
    return torch.stack(column)


def _same(a: Any, b: Any) -> bool:
    """Equal, or both nan (a statistic every rank found to be nan)."""
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # (an object whose == is not a truth value is not the same)
        return False


class SimRank(OwnRank):
    """Rank `rank` of a `SimMesh`, as per-rank code sees it inside `SimMesh.run`: its values are its own (no
    world axis), `rank` and `index(axis)` are ints, and each collective waits for every rank's turn (see the module
    docstring). A one-rank mesh's collectives need no turns: they are the `SimMesh`'s own on one row."""

    def __init__(self, sim: Mesh, rank: int, lock: _Lockstep | None) -> None:
        self._sim, self._rank, self._lock = sim, rank, lock
        self.world, self.shape = sim.world, sim.shape

    def __repr__(self) -> str:
        return f"SimRank(rank={self._rank} of {self._sim!r})"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def axes(self) -> tuple[str, ...]:
        return self._sim.axes

    def size(self, axis: str | None = None) -> int:
        return self._sim.size(axis)

    def index(self, axis: str | None = None) -> int:
        """This rank's coordinate along `axis` (its rank for None)."""
        self._sim.size(axis)  # (an unknown axis: say which exist)
        return coordinate(self.shape, self._rank, axis)

    def record(self) -> Any:
        return self._sim.record()

    def set_timeout(self, timeout: Any) -> None:
        """Nothing to do: the simulated ranks cannot wait for one another."""

    def account(self, kind: str, full: int, axis: str | None = None, itemsize: int = 4) -> None:
        if self._rank == 0:  # (every rank accounts alike: the collective is counted once)
            self._sim.account(kind, full, axis, itemsize)

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor:
        n = self.size(axis)
        s = _check_chunks(x, n, "local_shard")
        i = self.index(axis)
        return x[..., i * s : (i + 1) * s].clone()

    # ---------------------------------------------------------------------------------------------- collectives
    def _collective(self, key: tuple, x: Any, simulate: Callable[[Any], Any]) -> Any:
        """Rank `rank`'s result of the collective `simulate` computes on every rank's input stacked (`[world, ...]`)."""

        def compute(xs: list[Any]) -> list[Any]:
            _same_shapes(key, xs)
            out = simulate(optree.tree_map(lambda *t: torch.stack(t), *xs))
            return [optree.tree_map(lambda t, r=r: t[r], out) for r in range(self.world)]

        if self._lock is None:
            return compute([x])[0]
        return self._lock.arrive(self._rank, _Arrival(key, x, compute))

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor:
        return self._collective(("all_reduce", op, axis), x, lambda xs: self._sim.all_reduce(xs, op, axis))

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor:
        result = self._collective(("reduce_scatter", op, axis), x, lambda xs: self._sim.reduce_scatter(xs, op, axis))
        return result if out is None else out.copy_(result)

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready:
        return Ready(self.all_reduce(x, op, axis, inplace))

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready:
        return Ready(self.reduce_scatter(x, op, axis, out))

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor:
        return self._collective(("all_gather", axis), x, lambda xs: self._sim.all_gather(xs, axis))

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor:
        return self._collective(("all_to_all", axis), x, lambda xs: self._sim.all_to_all(xs, axis))

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False, axis: str | None = None) -> Work:
        out.copy_(self.all_gather(x.reshape(-1), axis))
        return done

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor:
        return self._collective(("broadcast", src, axis), x, lambda xs: self._sim.broadcast(xs, src, axis))

    def exchange(self, x: Tensor) -> Tensor:
        """Every rank's 1-D `x` (`[world, n]`), not counted in the ledger (`fzero.mesh.agreement`)."""
        return self._collective(("exchange",), x, lambda xs: xs.expand(self.world, *xs.shape))


def _same_shapes(key: tuple, xs: list[Any]) -> None:
    """Every rank's input to one collective has the same shape and dtype (else `MismatchError`, naming them)."""
    shapes = [tuple((tuple(t.shape), t.dtype) for t in optree.tree_leaves(x)) for x in xs]
    if any(s != shapes[0] for s in shapes):
        seen = ", ".join(f"rank {r}: {cast(Any, s)}" for r, s in enumerate(shapes))
        raise MismatchError(f"SimMesh.run: the ranks' inputs to {_describe(key)} differ in shape or dtype ({seen}): "
                            "every rank must give a collective the same shape and dtype")  # fmt: skip

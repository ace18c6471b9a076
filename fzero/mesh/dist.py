"""`DistMesh`: the ranks of a `torch.distributed` process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..host import accelerator, process_group, scratch
from .base import MeshBase, OwnRank, _check_chunks, _finish, _shape
from .errors import CollectiveError, _seconds, collective_error
from .handles import AllOf, Guarded, Pending, Ready, ReduceOp, Work, done
from .ledger import Ledger

__all__ = ["DistMesh"]


class DistMesh(OwnRank, MeshBase):
    """The ranks of a `torch.distributed` process group (gloo on CPU, NCCL on GPU).

    Args:
      group: the process group; default the world group. If `torch.distributed` is not initialised yet, it is,
        from the `torchrun` environment variables, with `backend` (default: NCCL where CUDA sees a GPU, else gloo;
        `DS_ACCELERATOR=cpu` forces gloo: `fzero.host.accelerator`) and `timeout`; the group is then shut down before
        the interpreter exits (`fzero.host.process_group`). Over NCCL, a host tensor handed to a collective is copied to
        the current GPU (`torch.cuda.set_device`) and the result back.
      backend: the backend for that initialisation.
      timeout: seconds (or a `datetime.timedelta`) a collective may wait for the other ranks before it fails with
        `CollectiveError`; set on the group, so it applies to everything that uses the group. Default: the
        group's own (torch's default is 30 minutes for gloo).
      shape: named axes and their sizes, outermost first (e.g. `{"replicate": 2, "shard": 2}`), whose product is
        the group's size: every rank makes one sub-group per line of the grid (`torch.distributed.new_group`, a
        collective: call it on every rank alike), and collectives with `axis=` run on this rank's sub-group.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        backend: str | None = None,
        timeout: float | datetime.timedelta | None = None,
        *,
        shape: Mapping[str, int] | None = None,
    ) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        delta = None if timeout is None else process_group.as_timedelta(timeout, "DistMesh(timeout=...)")
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "DistMesh() needs an initialised process group or the torchrun environment "
                    "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); start the script with torchrun, "
                    "or use SimMesh(world=...) in a single process"
                )
            process_group.init_process_group(backend or accelerator.backend(), timeout=delta)
        elif delta is not None:
            process_group.set_timeout(delta, group)
        process_group.shutdown_at_exit()
        self.group = group
        self.stacked = False
        self.world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._timeout = delta
        self._ledgers: list[Ledger] = []
        # gloo's reduce-scatter runs 1.4-2.8x slower than an all-to-all of the chunks summed here (summing in rank order
        # also makes the result SimMesh's, bitwise, at any world size), and its all-gather 1.6-6x slower than one
        # broadcast per rank (benchmarks/collectives.py): on gloo the mesh runs those exchanges instead
        used = dist.get_backend(group)
        self._exchange = used == "gloo"
        # NCCL moves GPU memory only: a host tensor handed to a collective (a seed, an agreement message, an
        # offloaded shard) is staged through the current GPU (`_to_comm`) and the result copied back
        self._nccl = used == "nccl"
        self._global = [dist.get_global_rank(group, r) if group else r for r in range(self.world)]
        self.shape = {} if shape is None else _shape(shape, "DistMesh(shape=...)")
        self._sub: dict[str, DistMesh] = {}
        if self.shape:
            if math.prod(self.shape.values()) != self.world:
                raise ValueError(f"DistMesh(shape={self.shape}) has {math.prod(self.shape.values())} ranks, but the "
                                 f"process group has {self.world}")  # fmt: skip
            self._sub = self._subgroups(delta)

    def _subgroups(self, timeout: datetime.timedelta | None) -> dict[str, DistMesh]:
        """This rank's sub-mesh along every axis; every rank creates every group, in the same order, as
        `new_group` requires."""
        grid = torch.arange(self.world).reshape(*self.shape.values())
        subs = {}
        for k, name in enumerate(self.shape):
            lines = grid.movedim(k, -1).reshape(-1, self.shape[name])
            for line in lines.tolist():
                g = dist.new_group([self._global[r] for r in line], timeout=timeout)
                if self._rank in line:
                    subs[name] = DistMesh(g)
        return subs

    def _axis(self, axis: str) -> DistMesh:
        sub = self._sub.get(axis)
        if sub is None:
            self.size(axis)  # raises, naming the axes
            raise AssertionError(axis)  # (unreachable: size raised)
        return sub

    def index(self, axis: str | None = None) -> int:
        """This rank's coordinate along `axis` (its rank for None)."""
        return self._rank if axis is None else self._axis(axis).rank

    @property
    def timeout(self) -> float | None:
        """The collectives' timeout in seconds, if this mesh set one."""
        return _seconds(self._timeout)

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Set the timeout (seconds or a `timedelta`) of every later collective of the mesh's group."""
        self._timeout = process_group.set_timeout(timeout, self.group)
        for sub in self._sub.values():
            sub.set_timeout(timeout)

    def _error(self, collective: str, x: Tensor, err: BaseException) -> CollectiveError:
        return collective_error(
            err, rank=self._rank, world=self.world, collective=collective, x=x, timeout=self.timeout
        )

    def _to_comm(self, x: Tensor) -> Tensor:
        """`x` where the backend can read it: `x` itself, or for NCCL a host tensor's contiguous copy on the current
        GPU (the one the caller's `torch.cuda.set_device` chose when the collective runs)."""
        if not self._nccl or x.device.type != "cpu":
            return x
        return torch.empty(x.shape, dtype=x.dtype, device=torch.device("cuda", torch.cuda.current_device())).copy_(x)

    def _run(self, collective: str, x: Tensor, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise self._error(collective, x, e) from e

    def __repr__(self) -> str:
        grid = f"shape={self.shape}, " if self.shape else ""
        return f"DistMesh({grid}world={self.world}, rank={self._rank}, backend={dist.get_backend(self.group)})"

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce(self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False) -> Tensor:
        return self.all_reduce_start(x, op, axis, inplace).wait()

    def reduce_scatter(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Tensor:
        return self.reduce_scatter_start(x, op, axis, out).wait()

    def all_reduce_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, inplace: bool = False
    ) -> Ready | Pending:
        """Start `all_reduce` (over `axis`: on this rank's group along it): the handle's `wait()` returns the
        result (the backend works meanwhile); `inplace`: reduce in `x` itself (the caller hands it over), not in a
        copy."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_reduce", x.numel(), axis, x.element_size())
            return sub.all_reduce_start(x, op, inplace=inplace)
        self._log("all_reduce", x.numel(), None, x.element_size())
        if self.world == 1:
            return Ready(_finish(x, op, 1))
        out = self._to_comm(x)
        if out is x:  # the backend reduces in place: never in the caller's own buffer unless handed over
            out = x if inplace and x.is_contiguous() else x.clone()
        work = self._run("all_reduce", x, dist.all_reduce, out, dist.ReduceOp.SUM, group=self.group, async_op=True)

        def finish() -> Tensor:
            total = _finish(out, op, self.world)
            if total.device == x.device:
                return total
            return x.copy_(total) if inplace else total.to(x.device)

        return Pending(self._guard(work, "all_reduce", x), finish, out)

    def reduce_scatter_start(
        self, x: Tensor, op: ReduceOp = "sum", axis: str | None = None, out: Tensor | None = None
    ) -> Ready | Pending:
        """Start `reduce_scatter` (over `axis`: on this rank's group along it): the handle's `wait()` returns the
        result (the backend works meanwhile); `out`: a contiguous buffer of the result's shape and dtype to put it
        in (the result is then `out` unless the group has one rank, bitwise what it would be in its own buffer)."""
        if axis is not None:
            sub = self._axis(axis)
            _check_chunks(x, sub.world, "reduce_scatter")
            self._log("reduce_scatter", x.numel(), axis, x.element_size())
            return sub.reduce_scatter_start(x, op, out=out)
        s = _check_chunks(x, self.world, "reduce_scatter")
        self._log("reduce_scatter", x.numel(), None, x.element_size())
        if self.world == 1:
            return Ready(_finish(x, op, 1))
        chunks = x.unflatten(-1, (self.world, s)).movedim(-2, 0).contiguous()  # [world, ..., s]
        if out is not None and (out.shape != chunks.shape[1:] or out.dtype != x.dtype or not out.is_contiguous()):
            raise ValueError(f"reduce_scatter: out= must be a contiguous {x.dtype} buffer of shape "
                             f"{tuple(chunks.shape[1:])}, got {out.dtype} {tuple(out.shape)}")  # fmt: skip
        if self._exchange:
            # the first and the last rank send and receive only the others' chunks, one contiguous run of them: gloo's
            # all-to-all copied a rank's own chunk to itself first (on 2 ranks both are: the exchange 1.24-1.37x faster)
            lo, hi = int(self._rank == 0), self.world - int(self._rank == self.world - 1)
            # received[r - lo]: rank r's chunk of this part
            received = scratch.new_empty("received", chunks, (hi - lo, *chunks.shape[1:]), passing=True)
            sizes = [chunks[0].numel() if lo <= r < hi else 0 for r in range(self.world)]
            work = self._run("reduce_scatter", x, dist.all_to_all_single, received.view(-1), chunks[lo:hi].view(-1),
                             sizes, sizes, group=self.group, async_op=True)  # fmt: skip
            rows = [chunks[r] if r == self._rank else received[r - lo] for r in range(self.world)]

            def finish() -> Tensor:
                # rank order, as SimMesh sums: the same value, bitwise, at any world
                total = torch.add(rows[0], rows[1], out=out)
                for r in range(2, self.world):
                    total.add_(rows[r])
                return _finish(total, op, self.world)

            return Pending(self._guard(work, "reduce_scatter", x), finish, chunks, received)
        given, chunks = out, self._to_comm(chunks)
        if out is None or out.device != chunks.device:
            out = torch.empty_like(chunks[0])
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = self._run("reduce_scatter", x, fn, out.view(-1), chunks.view(-1), op=dist.ReduceOp.SUM,
                         group=self.group, async_op=True)  # fmt: skip

        def finish_into() -> Tensor:
            total = _finish(out, op, self.world)
            if given is not None and given is not out:  # staged: the caller's buffer gets the result
                return given.copy_(total)
            return total.to(x.device)  # (itself unless staged)

        return Pending(self._guard(work, "reduce_scatter", x), finish_into, chunks, out)

    def _guard(self, work: object, collective: str, x: Tensor) -> Guarded:
        # `work` is what torch.distributed returns for async_op=True: a Work (typed Optional there)
        return Guarded(cast(Work, work), lambda e: self._error(collective, x, e))

    def all_gather(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_gather", x.numel() * sub.world, axis, x.element_size())
            return sub.all_gather(x)
        src = x.contiguous()
        out = torch.empty(self.world * src.numel(), dtype=src.dtype, device=src.device)
        self.all_gather_into(out, src.reshape(-1))
        return out.view(self.world, *src.shape).movedim(0, -2).flatten(-2)

    def all_to_all(self, x: Tensor, axis: str | None = None) -> Tensor:
        """`x`'s last dimension split into `n` chunks (n: the group's size), chunk `k` sent to the group's rank
        `k`: the `[n, ..., s]` chunks received, row `k` from the group's rank `k`."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_to_all", x.numel(), axis, x.element_size())
            return sub.all_to_all(x)
        s = _check_chunks(x, self.world, "all_to_all")
        self._log("all_to_all", x.numel(), None, x.element_size())
        chunks = x.unflatten(-1, (self.world, s)).movedim(-2, 0).contiguous()  # [world, ..., s]
        if self.world == 1:
            return chunks
        chunks = self._to_comm(chunks)
        received = torch.empty_like(chunks)
        self._run("all_to_all", x, dist.all_to_all_single, received.view(-1), chunks.view(-1), group=self.group)
        return received.to(x.device)

    def all_gather_into(self, out: Tensor, x: Tensor, async_op: bool = False, axis: str | None = None) -> Work:
        """All-gather the 1-D `x` into the preallocated 1-D `out` (`world * x.numel()` elements), in place; with
        `async_op` the returned handle must be waited on before `out` is read."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("all_gather", x.numel() * sub.world, axis, x.element_size())
            return sub.all_gather_into(out, x, async_op)
        self._log("all_gather", x.numel() * self.world, None, x.element_size())
        if self.world == 1:
            out.copy_(x)
            return done
        x, given = self._to_comm(x.contiguous()), out
        if out.device != x.device:
            out = torch.empty(out.shape, dtype=out.dtype, device=x.device)
        if self._exchange:  # each rank broadcasts its chunk straight into the others' `out`
            chunks = out.view(self.world, -1)
            works = [
                self._run("all_gather", x, dist.broadcast, x if r == self._rank else chunks[r],
                          src=self._global[r], group=self.group, async_op=True)
                for r in range(self.world)
            ]  # fmt: skip
            chunks[self._rank].copy_(x)
            work: Work = AllOf(cast(list[Work], works))
        else:
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = cast(Work, self._run("all_gather", x, fn, out, x, group=self.group, async_op=True))
        guarded: Work = self._guard(work, "all_gather", x)
        if out is not given:
            guarded = Pending(guarded, lambda: given.copy_(out), out)
        if not async_op:
            guarded.wait()
            return done
        return guarded

    def exchange(self, x: Tensor) -> Tensor:
        """Every rank's 1-D `x` (`[world, n]`): a control message (`fzero.mesh.agreement`), not in the ledger."""
        src = self._to_comm(x.contiguous())
        out = torch.empty(self.world * x.numel(), dtype=x.dtype, device=src.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run("exchange", x, fn, out, src, group=self.group)
        return out.view(self.world, -1).to(x.device)

    def broadcast(self, x: Tensor, src: int = 0, axis: str | None = None) -> Tensor:
        """Rank `src`'s `x` (for a named `axis`: the group's rank `src`, by coordinate)."""
        if axis is not None:
            sub = self._axis(axis)
            self._log("broadcast", x.numel(), axis, x.element_size())
            return sub.broadcast(x, src)
        self._log("broadcast", x.numel(), None, x.element_size())
        out = self._to_comm(x)
        out = x.clone() if out is x else out
        root = dist.get_global_rank(self.group, src) if self.group else src
        self._run("broadcast", x, dist.broadcast, out, src=root, group=self.group)
        return out.to(x.device)

    def local_shard(self, x: Tensor, axis: str | None = None) -> Tensor:
        if axis is not None:
            return self._axis(axis).local_shard(x)
        s = _check_chunks(x, self.world, "local_shard")
        return x[..., self._rank * s : (self._rank + 1) * s].clone()

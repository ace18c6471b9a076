"""`shard_update(optimizer)`: apply a functional optimizer to this rank's master parameters.

The optimizer's state has the form of the parameters where `shard_update` sits: sharded after `reduce_scatter`
(ZeRO stages 1-3), full after `all_reduce` (stage 0). The gradients owe a factor (`StepInfo.grad_factor`: 1 / loss
scale times the clipping coefficient). With a torch-op optimizer they are cast to the master dtype and multiplied
by it in one pass, then the optimizer runs. An optimizer with fused `features` (`fzero.cpu_adamw`) takes the
factor, low-precision gradients and a low-precision output buffer into its own single pass instead, and then
`shard_update` hands the compute copy to `gather` through `Flow.compute` (a shard, which `gather` all-gathers).
Padding elements have zero gradients and zero values, and every optimizer here maps (0, 0) to 0, so padding stays
zero.

Offload (`offload="cpu"`, ZeRO-Offload): the master parameters and the optimizer state live in CPU memory, pinned
when an accelerator is present. Each step the gradient shard is copied to the host in pieces
(non-blocking), the optimizer runs on each piece as soon as it has arrived, and each piece of the compute copy
goes back to the gradients' device (non-blocking) while the next is computed: the copies overlap the CPU work.
On a CPU-only machine the copies are no-ops and the same loop runs.

`Offload(None | "cpu", params="nvme")` (ZeRO-Infinity's `offload_param` without the optimizer on disk): the update
runs as above, and the compute copy goes to its swap files chunk by chunk instead of into memory
(`fzero.transforms.offload`: `disk_update`, `write_compute`), where stage 3's gathering reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import optree
import torch
from torch import Tensor

from ..layout import Layout
from ..mesh.base import coordinate
from ..optim import Optimizer
from ..optim.groups import ParamGroups, Resolved, Segments, segments
from ..optim.tensors import Tensors, rank_ordered_total, tensors_of
from ..storage import Offloaded
from .base import Context, Does, Flow, Transform
from .offload import (
    COMPUTE,
    Offload,
    RangeUpdate,
    compute_init,
    disk_copy,
    disk_update,
    keep,
    nvme_init,
    nvme_update,
    offload_of,
    take_io,
    write_compute,
)
from .speculate import MemoryTarget, Speculation, StoreTarget, Update

__all__ = ["shard_update"]

_LOW = (torch.bfloat16, torch.float16)


def _pinned() -> bool:
    """Whether host buffers should be page-locked: only useful (and only possible) with an accelerator."""
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def _host(x: Tensor, pin: bool) -> Tensor:
    """A CPU copy of `x` (pinned if asked), or `x` itself when it is on the CPU already."""
    if x.device.type == "cpu":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
    out.copy_(x)
    return out


def shard_update(
    optimizer: Optimizer,
    dtype: torch.dtype | None = None,
    *,
    offload: str | Offload | None = None,
    compute_dtype: torch.dtype | None = None,
    chunk: int = 1 << 22,
) -> Transform:
    """Update the master parameters (kept in `dtype`, default the model's) with `optimizer`.

    Args:
      optimizer: a functional optimizer (`fzero.adamw(...)`, `fzero.cpu_adamw(...)`, ...).
      dtype: the master dtype (the policy's `param_dtype`).
      offload: `"cpu"` keeps the master parameters and the optimizer state in CPU memory and runs the optimizer
        there (use `fzero.cpu_adamw`: the native kernel); `fzero.Offload("nvme", path=...)` keeps them in swap
        files on disk (ZeRO-Infinity; `fzero.transforms.offload`); None keeps them where the gradients are. An
        `Offload` with `params="nvme"` (any `optimizer`) keeps the compute copy of a sharded chain in swap files.
      compute_dtype: the dtype of the compute copy `gather` will make (the policy's `compute_dtype`; must equal
        `gather`'s). When it differs from the master dtype and the optimizer has the `"out"` feature, the
        optimizer writes the copy in its own pass and `gather` only communicates it. Under offload the copy (in
        this dtype, or the master dtype) is what travels back to the gradients' device.
      chunk: elements per pipelined piece under offload (with a donated state; a pure step is one piece).

    Returns:
      The transform. The compute copy becomes stale (None) until gathered, unless this transform made it.

    Example:
      >>> import torch, fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.shard_update(fzero.adamw(), dtype=torch.float32))
      >>> state = fzero.init(torch.nn.Linear(2, 1), tx, fzero.SimMesh(2))
      >>> state.tx_state["shard_update"].exp_avg.shape      # Adam's moments: this rank's shard only
      torch.Size([2, 16])
    """
    _check(optimizer, compute_dtype, chunk)
    policy = offload_of(offload)
    if policy.speculate and "tensors" in optimizer.features:
        raise ValueError("Offload(speculate=True) updates each unit on its own as its gradient is reduced; an "
                         "optimizer that needs whole parameter tensors (Lamb, Muon) cannot")  # fmt: skip
    u = _ShardUpdate(optimizer, dtype, policy, compute_dtype, chunk)
    # the master goes to disk at init, read once chunk by chunk: fzero.init may build it in a file there
    spill = policy.path if policy.optimizer == "nvme" else None
    return Transform(u.init, u.update, "shard_update", does=Does(updates=True, spill=spill),
                     speculate=u.speculate if policy.speculate else None, per_rank=False)  # fmt: skip


def _check(optimizer: Any, compute_dtype: Any, chunk: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        name = type(optimizer).__name__
        raise TypeError(f"shard_update needs an fzero Optimizer (e.g. fzero.adamw(...)), got {name}")
    if compute_dtype is not None and (
        not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point
    ):
        raise TypeError(f"shard_update: compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"shard_update: chunk must be a positive number of elements, got {chunk!r}")


class _ShardUpdate:
    """`shard_update`'s init and update (see it for the arguments)."""

    def __init__(self, optimizer: Optimizer, dtype: Any, offload: Offload, compute_dtype: Any, chunk: int) -> None:
        self.optimizer, self.dtype, self.policy, self.compute_dtype, self.chunk = (
            optimizer, dtype, offload, compute_dtype, chunk,
        )  # fmt: skip
        self.offload = offload.optimizer
        # the compute copy on disk, the master in memory: the update's copy goes to a store of its own
        self.to_disk = offload.params == "nvme" and offload.optimizer != "nvme"

    def init(self, flow: Flow, ctx: Context) -> tuple[Flow, Any]:
        group_segments(self.optimizer, ctx, flow.params, flow.sharded)  # resolve the groups now: errors at init
        params = flow.params if self.dtype is None else flow.params.to(self.dtype)
        if self.policy.params == "nvme" and not flow.sharded:
            raise ValueError("Offload(params='nvme') keeps this rank's shard of the compute parameters on disk; this "
                             "chain does not shard them (stage 0): use stages 1-3")  # fmt: skip
        if self.offload is None:
            compute = self._compute_store(params, ctx, flow.sharded) if self.to_disk else None
            return flow._replace(params=params, compute=compute), self.optimizer.init(params)
        master = _host(params, pin=params.device.type != "cpu" and _pinned())
        if self.offload == "nvme":
            cdt = self.compute_dtype or master.dtype
            handle, state, on_disk = nvme_init(self.optimizer, master, self.policy, _files(ctx, master),
                                               _pieces_of(ctx, master, flow.sharded), cdt)  # fmt: skip
            # the handles stand where the tensors would: only shard_update reads the master, the gathering the
            # compute copy, and what else looks at the state (checkpoints, state_dict, state_bytes) knows handles
            compute = flow.params.to(cdt) if on_disk is None else cast(Tensor, on_disk)
            return flow._replace(params=cast(Tensor, handle), compute=compute), state
        if self.to_disk:
            compute = self._compute_store(master, ctx, flow.sharded)
        else:
            compute = flow.params.to(self.compute_dtype or master.dtype)  # on the parameters' device, in this form
        return flow._replace(params=master, compute=compute), self.optimizer.init(master)

    def _compute_store(self, master: Tensor, ctx: Context, sharded: bool) -> Tensor:
        """`Offload(params="nvme")` beside an optimizer in memory: the compute copy's first version, `master` cast,
        in a store of its own (its handle, which stands where the tensor would)."""
        cdt = self.compute_dtype or master.dtype
        handle = compute_init(master, self.policy, _files(ctx, master), _pieces_of(ctx, master, sharded), cdt)
        return cast(Tensor, handle)

    def prepare(self, grads: Tensor, factor: float, dtype: torch.dtype) -> tuple[Tensor, dict[str, Any]]:
        """The gradients to hand the optimizer, and its keywords: the factor and the cast to the master `dtype`
        fused where the optimizer can take them, done here (one pass, elementwise) where it cannot."""
        features = self.optimizer.features
        kw: dict[str, Any] = {}
        if not ("grad_dtype" in features and grads.dtype in (dtype, *_LOW)):
            grads = grads.to(dtype)
        if factor != 1.0:
            if "grad_scale" in features:
                kw["grad_scale"] = factor
            else:
                grads = grads * factor
        return grads, kw

    def keywords(self, ctx: Context, params: Any, sharded: bool) -> dict[str, Any]:
        """The optimizer's keywords for this layout: the parameter groups' segments, the tensors' table."""
        kw: dict[str, Any] = {}
        segs = group_segments(self.optimizer, ctx, params, sharded)
        if segs is not None:
            kw["segments"] = segs
        if "tensors" in self.optimizer.features:
            kw["tensors"] = tensor_table(ctx, params, sharded)
        return kw

    def speculate(self, params: Any, state: Any, ctx: Context, factor: float, sharded: bool,
                  acc: Tensor | None = None, k: int = 1) -> Speculation:  # fmt: skip
        """Start a speculative update of the input `params` and `state` (`fzero.transforms.speculate`), assuming
        the gradients owe `factor`."""
        pieces = _pieces_of(ctx, params, sharded)
        slices = [slice(sum(pieces[:u]), sum(pieces[: u + 1])) for u in range(len(pieces))]
        dtype = params.dtype
        kw = {**self.keywords(ctx, params, sharded), **self.prepare(torch.zeros(0, dtype=dtype), factor, dtype)[1]}
        cdt = self.compute_dtype or dtype

        def prepare(grads: Tensor) -> Tensor:
            return self.prepare(grads, factor, dtype)[0]

        target: Any
        if self.offload == "nvme":
            compute = None if COMPUTE in params.store.leaves else torch.empty(params.shape, dtype=cdt)
            piece = RangeUpdate(self.optimizer, state, params, kw, cdt, None if compute is None else compute.view(-1))
            target = StoreTarget(piece, prepare, compute)
        elif self.to_disk:  # the compute copy is written to disk once the speculation is taken (`_update`)
            target = _MasterTarget(RangeUpdate(self.optimizer, state, params, kw, dtype, None), prepare, slices)
        else:
            target = MemoryTarget(RangeUpdate(self.optimizer, state, params, kw, cdt, None), prepare, cdt, slices)
        return Speculation(target, params, state, factor, slices, acc, k)

    def update(self, flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
        if flow.info.applied:
            raise ValueError("shard_update: the gradients were applied already (two shard_update()s in one chain?)")
        grads = flow.gradients("shard_update")
        if grads.shape != flow.params.shape:
            raise ValueError(
                f"shard_update: gradients of shape {tuple(grads.shape)} do not match parameters of shape "
                f"{tuple(flow.params.shape)}: put reduce_scatter() (sharded state) or all_reduce() (replicated "
                "state) before shard_update() in the chain"
            )
        with torch.profiler.record_function("fzero.shard_update"):  # named in profiles (the C kernel is no aten op)
            return self._update(flow, state, ctx)

    def _update(self, flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
        speculation = flow.info.speculation
        taken = None if speculation is None else speculation.take(flow, state)
        if taken is not None:  # computed during the backward, and what it assumed holds
            params, state, copy, io = taken
            if self.to_disk:  # the new master is in memory: its compute copy goes to disk now, chunk by chunk
                stored = disk_copy(flow.compute)
                copy, io = write_compute(stored.store, params, stored), take_io(stored.store)
            flow = flow._replace(params=params, compute=copy).with_info(applied=True)
            return (flow if io is None else flow.with_metrics(io={"nvme": io})), state
        grads, kw = self.prepare(flow.gradients("shard_update"), flow.info.grad_factor, flow.params.dtype)
        kw.update(self.keywords(ctx, flow.params, flow.sharded))
        compute: Tensor | None
        if self.to_disk:
            params, state, on_disk, io = self._update_to_disk(flow, grads, state, kw, ctx)
            flow = flow._replace(params=params, compute=cast(Tensor, on_disk)).with_info(applied=True)
            return flow.with_metrics(io={"nvme": io}), state
        if self.offload == "nvme":
            handle = cast(Offloaded, flow.params)
            new, state, copy, io = nvme_update(self.optimizer, grads, state, handle, kw, self.compute_dtype)
            flow = flow._replace(params=cast(Tensor, new), compute=cast(Tensor, copy)).with_info(applied=True)
            return flow.with_metrics(io={"nvme": io}), state
        if self.offload is not None:
            params, state, compute = _offload_update(self.optimizer, grads, state, flow.params, kw, ctx.donate,
                                                     self.compute_dtype, self.chunk)  # fmt: skip
            return flow._replace(params=params, compute=compute).with_info(applied=True), state
        compute, cdt = None, self.compute_dtype
        # a donated step's compute copy (this rank's, as the parameters) is rewritten in place: a fresh buffer of
        # that size would fault in page by page every step
        old = flow.compute
        reuse = ctx.donate and old is not None and old.shape == flow.params.shape and old.dtype == cdt
        fused = cdt is not None and cdt != flow.params.dtype and "out" in self.optimizer.features
        if fused:
            compute = kw["out"] = old if reuse else torch.empty(flow.params.shape, dtype=cdt, device=flow.params.device)
        params, state = self.optimizer.update(grads, state, flow.params, donate=ctx.donate, **kw)
        if reuse and not fused and cdt != params.dtype:
            compute = cast(Tensor, old).copy_(params)  # the rounding `gather`'s cast would make (to nearest even)
        return flow._replace(params=params, compute=compute).with_info(applied=True), state

    def _update_to_disk(self, flow: Flow, grads: Tensor, state: Any, kw: dict[str, Any], ctx: Context
                        ) -> tuple[Tensor, Any, Any, dict[str, int]]:  # fmt: skip
        """The update of a master in memory whose compute copy is on disk (`Offload(None | "cpu", params="nvme")`):
        a donated update on the CPU runs range by range in the copy's write pipeline, each range's copy written as
        it comes out of the optimizer; any other (pure, whole-tensor optimizers, the master on an accelerator) runs
        as in memory, the copy cast from the new master just after it, chunk by chunk.

        Returns:
          The new master and state, the compute copy's new handle, the bytes read and written per rank.
        """
        old = disk_copy(flow.compute)
        params = flow.params
        if ctx.donate and "tensors" not in kw and params.device.type == "cpu":
            return disk_update(self.optimizer, grads, state, params, kw, old)
        if self.offload == "cpu":
            params, state, _ = _offload_update(self.optimizer, grads, state, params, kw, ctx.donate, None,
                                               self.chunk, copy_back=False)  # fmt: skip
        else:
            params, state = self.optimizer.update(grads, state, params, donate=ctx.donate, **kw)
        return params, state, write_compute(old.store, params, old), take_io(old.store)


class _MasterTarget(MemoryTarget):
    """A speculative update of a master in host memory whose compute copy is on disk (`Offload("cpu",
    params="nvme")`): `MemoryTarget`'s new buffers, without a compute copy of its own (the update writes it to disk
    from the new master once the speculation is taken).

    Args:
      piece: the update of one range, its compute dtype the master's (so that the copy is the master itself).
      prepare, slices: as for `MemoryTarget`.
    """

    def __init__(self, piece: RangeUpdate, prepare: Any, slices: Sequence[slice]) -> None:
        super().__init__(piece, prepare, piece.handles["params"].dtype, slices)

    def result(self) -> Update:
        """The new master and state (no copy to the gradients' device)."""
        return Update(self.new["params"], self.piece.state_after(self.new), None, None)


def _files(ctx: Context, params: Tensor) -> tuple[int, ...]:
    """The numbers naming the swap files of the ranks whose rows `params` holds (this process's ranks)."""
    return ctx.mesh.local_ranks


def _pieces_of(ctx: Context, params: Tensor, sharded: bool) -> tuple[int, ...]:
    """Each unit's element count in a row of `params` (this rank's shard, or the full buffer)."""
    div = ctx.layout.world if sharded else 1
    pieces = tuple(u.size // div for u in ctx.layout.units)
    if sum(pieces) != params.shape[-1]:
        raise ValueError(f"shard_update: a row of {params.shape[-1]} elements is not the layout's units "
                         f"({sum(pieces)} elements): this buffer cannot be offloaded unit by unit")  # fmt: skip
    return pieces


def group_segments(optimizer: Optimizer, ctx: Context, params: Tensor, sharded: bool) -> Segments | None:
    """The segment table of `params` (this rank's buffer, or a SimMesh's `[world, n]`) for the optimizer's
    parameter groups, from the layout's names (None without groups). Resolved once per layout (cached)."""
    if optimizer.groups is None:
        return None
    defaults = tuple(sorted(optimizer.defaults.items()))
    resolved = _resolve(optimizer.groups, ctx.layout, defaults, optimizer.check)
    return segments(ctx.layout, resolved, full=not sharded, ranks=_rows(ctx, params))


def tensor_table(ctx: Context, params: Tensor, sharded: bool) -> Tensors:
    """Where each parameter tensor lies in `params` (this rank's buffer, or a SimMesh's `[world, n]`), and how
    its pieces' sums meet: one all-gather over the sharding axis, added in rank order (`fzero.optim.tensors`)."""
    axis, world = ctx.layout.axis, ctx.layout.world
    total = rank_ordered_total(lambda x: ctx.mesh.all_gather(x, axis=axis), world) if sharded and world > 1 else None
    exchange = None
    if axis is None:  # `[rows, world * s] -> [rows, world, s]` on either mesh (a SimMesh's rows are its ranks)

        def exchange(x: Tensor) -> Tensor:
            return ctx.mesh.all_to_all(x) if params.ndim == 2 else ctx.mesh.all_to_all(x[0]).unsqueeze(0)

    return tensors_of(ctx.layout, full=not sharded, ranks=_rows(ctx, params), total=total, exchange=exchange)


def _rows(ctx: Context, params: Tensor) -> Sequence[int]:
    """The ranks whose buffers `params` holds, end to end (this process's ranks): each rank's coordinate along the
    sharding axis."""
    return tuple(coordinate(ctx.mesh.shape, r, ctx.layout.axis) for r in ctx.mesh.local_ranks)


@functools.lru_cache(maxsize=64)
def _resolve(groups: ParamGroups, layout: Layout, defaults: tuple, check: Any) -> Resolved:
    resolved = groups.resolve([leaf.name for leaf in layout.leaves], dict(defaults))
    for overrides in resolved.overrides:
        try:
            check({**dict(defaults), **dict(overrides)})
        except (TypeError, ValueError) as e:
            raise type(e)(f"parameter group {dict(overrides)}: {e}") from None
    return resolved


def _pieces(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)] or [(0, 0)]


def _offload_update(
    optimizer: Optimizer,
    grads: Tensor,
    state: Any,
    params: Tensor,
    kw: dict[str, Any],
    donate: bool,
    compute_dtype: torch.dtype | None,
    chunk: int,
    copy_back: bool = True,
) -> tuple[Tensor, Any, Tensor]:
    """The offloaded update: `params` and `state` on the host, `grads` on their device; returns the new
    parameters, the new state, and the compute copy on the gradients' device (with `copy_back=False`, the new
    parameters themselves, on the host: the caller writes the copy elsewhere).

    With `donate`, the shard is updated in place piece by piece, so each piece's optimizer work overlaps the
    transfers of the others; a pure step runs the optimizer once on the whole shard (its outputs are fresh
    buffers, which pieces could only assemble with one more copy), and so does an optimizer with per-tensor
    reductions (the `tensors` feature: Lamb's norms need whole tensors)."""
    device = grads.device
    remote = device.type != "cpu"
    pin = remote and params.is_pinned()
    n = params.numel()
    cdt = compute_dtype or params.dtype
    fused_out = cdt != params.dtype and "out" in optimizer.features
    # an optimizer that reduces over whole tensors (`tensors`) cannot run on pieces of them
    pieces = _pieces(n, chunk if donate and "tensors" not in kw else max(n, 1))

    host_g, events = _to_host(grads, pieces, pin)
    out = torch.empty(n, dtype=cdt, pin_memory=pin) if fused_out else None
    compute = torch.empty(n, dtype=cdt, device=device) if remote and copy_back else None

    def send(new_params: Tensor, a: int, b: int) -> None:
        """Piece [a, b) of the compute copy to the device (non-blocking; ordered before later device work)."""
        if compute is not None:
            src = out[a:b] if out is not None else new_params.reshape(-1)[a:b].to(cdt)
            compute[a:b].copy_(src, non_blocking=True)

    if len(pieces) == 1:
        if events:
            events[0].synchronize()
        extra = {**kw, "out": out.view(params.shape)} if out is not None else kw
        new_params, new_state = optimizer.update(host_g.view(params.shape), state, params, donate=donate, **extra)
        send(new_params, 0, n)
    else:
        new_state = state
        for i, (a, b) in enumerate(pieces):
            if events:
                events[i].synchronize()
            new_state = _update_piece(optimizer, host_g, state, params, kw, out, a, b)
            send(params, a, b)
        new_params = params
    if compute is None:  # on the CPU: the copy "sent back" is the host tensor itself
        compute = out.view(params.shape) if out is not None else new_params.to(cdt)
    return new_params, new_state, compute.view(params.shape)


def _to_host(grads: Tensor, pieces: list[tuple[int, int]], pin: bool) -> tuple[Tensor, list[Any]]:
    """The gradients on the host: every piece queued now (non-blocking), each with an event the host waits on
    before using it; on the CPU, the gradients themselves."""
    flat_g = grads.reshape(-1)
    if grads.device.type == "cpu":
        return flat_g, []
    host_g, events = torch.empty(flat_g.numel(), dtype=grads.dtype, pin_memory=pin), []
    for a, b in pieces:
        host_g[a:b].copy_(flat_g[a:b], non_blocking=True)
        event = torch.Event(device=grads.device)
        event.record()
        events.append(event)
    return host_g, events


def _update_piece(optimizer: Optimizer, host_g: Tensor, state: Any, params: Tensor, kw: dict[str, Any],
                  out: Tensor | None, a: int, b: int) -> Any:  # fmt: skip
    """Update elements `[a, b)` of the donated shard in place; the state after it."""
    flat_p = params.reshape(-1)
    sub = optree.tree_map(lambda x: x.reshape(-1)[a:b] if _elementwise(x, params) else x, state)
    extra = {**kw, "out": out[a:b]} if out is not None else dict(kw)
    if "segments" in kw:
        extra["segments"] = kw["segments"].slice(a, b)
    p_piece, s_piece = optimizer.update(host_g[a:b], sub, flat_p[a:b], donate=True, **extra)
    keep(flat_p[a:b], p_piece)
    return optree.tree_map(lambda whole, mine, got: _merge(whole, mine, got, params), state, sub, s_piece)


def _elementwise(x: Any, params: Tensor) -> bool:
    """Whether a state leaf is a per-element buffer shaped like the parameters (sliced with them)."""
    return isinstance(x, Tensor) and x.shape == params.shape


def _merge(whole: Any, mine: Any, got: Any, params: Tensor) -> Any:
    """A state leaf after one piece: per-element buffers stay the (updated in place) whole; the rest (the step
    count) is what the piece returned."""
    if _elementwise(whole, params):
        keep(mine, got)
        return whole
    return got

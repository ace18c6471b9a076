"""The state's parameters from a model: sharded construction (DeepSpeed's `zero.Init`) from a `meta`-device model,
one unit at a time, or copies of a model built in memory (`replicated_parameters`, rank 0's values broadcast unit by
unit).

Sharded construction: for each unit, the modules that own its tensors are materialised (`to_empty`) and initialised as
`model.apply(initializer)` would initialise them: the initializer runs, children first, on those modules and their
ancestors (so an initializer that sets a child's parameters from its parent, as GPT-2's scaled `c_proj` init does,
reaches them; on modules not materialised it only touches `meta` tensors, which costs nothing). Every tensor it
leaves uninitialised is an error that names it. Then the unit is flattened, rank 0's values are broadcast (so ranks
agree whatever their random state), each rank keeps its shard, and the modules get their original `meta` tensors
back (the model object is left exactly as it was, ties included). The full model never exists on a rank: at most
one unit (twice: the module's tensors and the unit's flat buffers) on top of the shards.

Modules that own buffers but no parameter are materialised with the first unit.

A model built partitioned (DeepSpeed's `zero.Init`, `fzero.deepspeed.zero`) holds each parameter's values as a
`Partition` (this rank's `ceil(numel / world)` elements of it, DeepSpeed's per-parameter partition) behind an empty
stand-in; `partitioned_parameters` builds the state's shards from those, one unit at a time (`partitioned`,
`shapes_shown`).

Under the NVMe tier (`spill`: its directory) the trainable shard is built in a file there (`fzero.storage.Spill`),
each unit's pages written back and dropped once placed: the store then takes it chunk by chunk, and the shard never
sits in memory. With `release`, each parameter of a model handed over built (or partitioned) is emptied once its unit
is placed, as `fully_shard` releases a module's parameters: the model goes as the state is made.

Example:
    >>> import torch, fzero
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> mesh = fzero.SimMesh(world=2)
    >>> state = fzero.init(model, fzero.zero3(fzero.adamw()), mesh, initializer=lambda m: None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: sharded construction: the initializer left 4 tensors of unit '<root>' uninitialised (0.weight, ...
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from ..host.heap import HeapRelease
from ..layout import Layout, dtype_of, flatten
from ..mesh import Mesh, RankMesh
from ..storage.spill import Spill

__all__ = [
    "Partition",
    "broadcast_tensors",
    "external_parameters",
    "gather_partitions",
    "partition_of",
    "partitioned",
    "partitioned_parameters",
    "replicated_parameters",
    "shapes_shown",
    "sharded_parameters",
]

PARTITION = "_fzero_partition"  # the attribute of a parameter that holds its `Partition`
CUT_CHUNK_BYTES = 256 << 10
"""`Partition.cut` broadcasts a parameter's values this many bytes at a time (see there why)."""
EXTERNAL = "_external_params"  # DeepSpeed's: a module's {id: parameter} it uses without owning them


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module, children before their parent, in `model.apply`'s order."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, module))

    visit("", model)
    return out


def _owners(model: nn.Module, layout: Layout) -> list[list[str]]:
    """For each unit, the names of the modules owning (directly) one of its parameters, or buffers of a module that
    owns no parameter (those go with the first unit)."""
    unit_of = {leaf.name: leaf.unit for lay in (layout, layout.frozen_layout) if lay is not None for leaf in lay.leaves}
    groups: list[list[str]] = [[] for _ in layout.units]
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        units = sorted({unit_of[n] for n in names if n in unit_of})
        if not units and list(module.named_buffers(recurse=False)):
            units = [0]
        for u in units:
            groups[u].append(prefix)
    return groups


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return ["", *(".".join(parts[:k]) for k in range(1, len(parts)))]


class _Untouched:
    """Marks freshly materialised tensors, to tell afterwards which ones the initializer never wrote: floating
    tensors are filled with NaN, integer tensors with their dtype's minimum; others (bool) are checked by their
    version counter."""

    def __init__(self) -> None:
        self.marked: list[tuple[str, Tensor, int]] = []

    def mark(self, name: str, t: Tensor) -> None:
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
        self.marked.append((name, t, t._version))

    def missed(self) -> list[str]:
        out = []
        for name, t, version in self.marked:
            if t.is_floating_point() or t.is_complex():
                bad = bool(torch.isnan(t).any())
            elif t.dtype != torch.bool:
                bad = bool((t == torch.iinfo(t.dtype).min).any())
            else:
                bad = t._version == version
            if bad:
                out.append(name)
        return out


class _Shards:
    """The shards a construction fills unit by unit, one per space (trainable, frozen): in memory, or the trainable
    one in a file (`spill`: `fzero.storage.Spill` under that directory, each unit's pages written back and dropped
    once placed, so the shard never sits in memory: the NVMe tier's store takes it from there)."""

    def __init__(self, spaces: Sequence[Layout], spill: str | os.PathLike[str] | None) -> None:
        self.spaces, self.spill = spaces, spill
        self.shards: list[Tensor | None] = [None for _ in spaces]
        self.file: Spill | None = None

    def place(self, space: int, unit_index: int, piece: Tensor) -> None:
        """Put `piece`, this rank's part of unit `unit_index` of space `space`, in its place."""
        lay = self.spaces[space]
        if self.shards[space] is None:
            shape = (*piece.shape[:-1], lay.shard_numel)
            if space == 0 and self.spill is not None and piece.device.type == "cpu":
                self.file = Spill(self.spill, shape, piece.dtype)
                self.shards[space] = self.file.tensor
            else:
                self.shards[space] = piece.new_empty(shape)
        where = lay.unit_shard_slice(unit_index)
        cast(Tensor, self.shards[space])[..., where].copy_(piece)
        if space == 0 and self.file is not None:
            self.file.written(where.stop)

    def result(self) -> tuple[Tensor, Tensor | None]:
        assert all(x is not None for x in self.shards)  # (a layout has units)
        if self.file is not None:
            self.file.close()  # (the mapping stays with the tensor)
        return cast(Tensor, self.shards[0]), self.shards[1] if len(self.shards) > 1 else None


def _release(param: Tensor) -> int:
    """Empty `param` (its values are in the state now), and drop the partition it was built in: the bytes freed."""
    part: Partition | None = param.__dict__.pop(PARTITION, None)
    freed = 0
    with torch.no_grad():
        if part is not None:
            freed += part.shard.numel() * part.shard.element_size()
            # (the same tensor emptied: DeepSpeed's `ds_tensor` attribute refers to it too)
            part.shard.data = torch.empty(0, dtype=part.shard.dtype, device=part.shard.device)
        if not param.is_meta and param.untyped_storage().nbytes():
            freed += param.untyped_storage().nbytes()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return freed


def sharded_parameters(
    model: nn.Module,
    layout: Layout,
    mesh: Mesh,
    initializer: Callable[[nn.Module], None] | None,
    device: torch.device | str = "cpu",
    *,
    spill: str | os.PathLike[str] | None = None,
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """Each rank's shard of the trainable and of the frozen parameters, and the buffers, of a `meta` model.

    Args:
      model: a module on the `meta` device (left unchanged).
      layout: its layout (`fzero.layout.from_module`).
      mesh: the mesh (rank 0's values are broadcast unit by unit).
      initializer: `initializer(module)` initialises, in place, tensors of the module (usually those it owns; an
        ancestor may set its descendants'), e.g. a Hugging Face model's `model._init_weights`, or
        `lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None` for torch's own layers.
      device: where the shards live.
      spill: a directory (the NVMe tier's): the trainable shard is built in a file there (`fzero.storage.Spill`),
        each unit's pages dropped once written, rather than in memory.

    Returns:
      `(shard, frozen, buffers)`: the trainable shard per rank (`[shard_numel]`, or `[world, shard_numel]` on a
      SimMesh, in the layout's dtype), the frozen shard likewise (None without frozen parameters), and the
      buffers by name (full, per rank).

    Raises:
      ValueError: the initializer left a parameter or buffer (or part of one) uninitialised; it names them.
    """
    if initializer is None:
        raise ValueError(
            "init: the model is on the meta device; pass initializer=fn, where fn(module) initialises the tensors a "
            "module owns, run on every module children first as model.apply(fn) would (for a Hugging Face model: "
            "initializer=model._init_weights)"
        )
    spaces = [lay for lay in (layout, layout.frozen_layout) if lay is not None]
    # each unit's piece goes straight into its place: the shards and one unit are all that exist at once
    shards = _Shards(spaces, spill)

    buffers: dict[str, Tensor] = {}
    buffer_names = {s.name for s in layout.buffers}
    modules = dict(model.named_modules())
    order = _post_order(model)
    for unit_index, owners in enumerate(_owners(model, layout)):
        targets = set(owners).union(*(_ancestors(n) for n in owners))
        originals = [(modules[n], dict(modules[n]._parameters), dict(modules[n]._buffers)) for n in owners]
        untouched = _Untouched()
        named: dict[str, Tensor] = {}
        with torch.no_grad():
            for prefix in owners:
                m = modules[prefix]
                m.to_empty(device=device, recurse=False)
                for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                    named[f"{prefix}.{n}" if prefix else n] = t
                    untouched.mark(f"{prefix}.{n}" if prefix else n, t)
            for prefix, m in order:
                if prefix in targets:
                    initializer(m)
        missed = untouched.missed()
        if missed:
            for m, params, bufs in originals:
                m._parameters.update(params)
                m._buffers.update(bufs)
            shown = ", ".join(missed[:8]) + (", ..." if len(missed) > 8 else "")
            raise ValueError(
                f"sharded construction: the initializer left {len(missed)} tensors of unit "
                f"{layout.units[unit_index].name!r} uninitialised ({shown}); it runs "
                "on every module, children first, as model.apply(initializer) would, and must set every parameter "
                "and buffer (non-persistent buffers such as rotary inv_freq or position_ids included). For a "
                "Hugging Face model pass initializer=model._init_weights"
            )
        for space, lay in enumerate(spaces):
            unit = lay.units[unit_index]
            flat = torch.zeros(unit.size, dtype=dtype_of(lay.dtype), device=device)
            with torch.no_grad():
                for leaf in lay.leaves:
                    if leaf.unit == unit_index:
                        start = leaf.offset - unit.start
                        flat[start : start + leaf.numel].copy_(named[leaf.name].reshape(-1))
            flat = mesh.broadcast(mesh.replicate(flat), src=0)
            # this rank's chunk (hybrid: along the sharding axis), as `fzero.transforms.shard_params` cuts it
            shards.place(space, unit_index, mesh.local_shard(flat, axis=lay.axis))
        for name, t in named.items():
            if name in buffer_names:
                buffers[name] = mesh.broadcast(mesh.replicate(t.detach().clone()), src=0)
        for m, params, bufs in originals:
            m._parameters.update(params)
            m._buffers.update(bufs)
        del named
    return (*shards.result(), buffers)


def replicated_parameters(model: nn.Module, layout: Layout, mesh: Mesh) -> tuple[Tensor, Tensor | None, dict]:
    """The model's trainable and frozen parameters as full flat buffers and its buffers, per rank: rank 0's values
    on every rank.

    Args:
      model: a module built in memory (left unchanged).
      layout: its layout (`fzero.layout.from_module`).
      mesh: the mesh (rank 0's values are broadcast unit by unit: no second full copy exists).

    Returns:
      `(flat, frozen, buffers)`: the trainable parameters (`[numel]`, or `[world, numel]` on a SimMesh, in the
      layout's dtype), the frozen ones likewise (None without frozen parameters), and the buffers by name.
    """
    named = dict(model.named_parameters())
    with torch.no_grad():
        flat = _broadcast_units(mesh, layout, mesh.replicate(flatten(layout, named)))
        frozen = None
        if layout.frozen_layout is not None:
            frozen = _broadcast_units(mesh, layout.frozen_layout, mesh.replicate(flatten(layout.frozen_layout, named)))
        module_buffers = dict(model.named_buffers())
        buffers = {s.name: mesh.replicate(module_buffers[s.name].detach().clone()) for s in layout.buffers}
    return flat, frozen, buffers


def _broadcast_units(mesh: Mesh, layout: Layout, flat: Tensor) -> Tensor:
    """Rank 0's values of `flat` on every rank, written into `flat` one unit at a time: a broadcast returns a new
    buffer, and one of the whole model would be a third copy of it at init's peak (the model's, the flat one)."""
    if mesh.world == 1:
        return flat
    for i, unit in enumerate(layout.units):
        if unit.size:  # (a unit without frozen parameters has none in the frozen buffer)
            part = flat[..., layout.unit_slice(i)]
            part.copy_(mesh.broadcast(part, src=0))
    return flat


class Partition:
    """One parameter's values cut across the ranks as DeepSpeed's `zero.Init` cuts them: the flattened tensor,
    zero-padded to `world * n` elements (`n = ceil(numel / world)`), rank `r` keeping elements `[r * n, (r + 1) * n)`.
    The parameter itself holds an empty stand-in meanwhile.

    Attributes:
      mesh: the ranks it is cut across, as this rank sees them.
      shard: this rank's `n` elements (DeepSpeed's `param.ds_tensor`).
      shape: the parameter's shape.
      version: the parameter's version counter when its stand-in was set: an in-place write to the stand-in (which
        holds nothing, so the write is lost) moves it.
      round_to: the dtype every value it takes is rounded through (kept in the shard's dtype), or None: where
        DeepSpeed's partition is in bf16 / fp16, so is every value written to it later (`assign`: a checkpoint
        loaded through `GatheredParameters`), not only the first.
    """

    def __init__(self, mesh: RankMesh, shard: Tensor, shape: tuple[int, ...], version: int = 0,
                 round_to: torch.dtype | None = None) -> None:  # fmt: skip
        self.mesh, self.shard, self.shape, self.version, self.round_to = mesh, shard, shape, version, round_to

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def cut(
        cls,
        mesh: RankMesh,
        full: Tensor,
        device: torch.device | str | None = None,
        *,
        src: int | None = None,
        round_to: torch.dtype | None = None,
        freed: Callable[[int], None] | None = None,
    ) -> Partition:
        """This rank's partition of `full`, kept on `device` (default: `full`'s).

        With `src`, rank `src`'s values are kept (the ranks agree whatever each holds), broadcast `CUT_CHUNK_BYTES`
        at a time, each rank keeping its piece of each: the memory this takes beside `full` and the partition is
        one chunk, not a received copy of the whole (which, for the largest parameter made whole, would be as much
        again on top of it).

        Args:
          mesh: the ranks to cut across, as this rank sees them.
          full: the parameter's whole value (the same shape and dtype on every rank).
          device: where the partition lives.
          src: None: every rank passes the same values; a rank: that rank's values are kept.
          round_to: round the values through this dtype first (kept in `full`'s dtype), and every value `assign`
            takes later.
          freed: told the bytes of each received chunk once it is freed (`fzero.host.heap.HeapRelease.freed`).

        Returns:
          The partition, its values bitwise those of the cut of rank `src`'s (or this rank's) `full`, rounded.
        """
        n = -(-full.numel() // mesh.world)
        shard = torch.zeros(n, dtype=full.dtype, device=device or full.device)
        part = cls(mesh, shard, tuple(full.shape), round_to=round_to)
        part.assign(full, src=src, freed=freed)
        return part

    def assign(self, full: Tensor, *, src: int | None = None, freed: Callable[[int], None] | None = None) -> None:
        """Keep this rank's part of the new full value `full`, rounded through `round_to`; with `src`, of rank
        `src`'s value, received `CUT_CHUNK_BYTES` at a time (see `cut`; every rank calls it).

        Raises:
          ValueError: `full` does not have the parameter's shape.
        """
        if tuple(full.shape) != self.shape:
            raise ValueError(f"a partitioned parameter of shape {self.shape} cannot take a value of shape "
                             f"{tuple(full.shape)}: its shape is fixed once it is partitioned")  # fmt: skip
        mesh, shard, numel = self.mesh, self.shard, self.numel
        mine = _piece(numel, shard.numel(), mesh.rank)
        flat = full.detach().reshape(-1)

        def rounded(x: Tensor) -> Tensor:
            return x if self.round_to is None else x.to(self.round_to).to(shard.dtype)

        with torch.no_grad():
            shard.zero_()
            if src is None or mesh.world == 1:
                shard[: mine.stop - mine.start].copy_(rounded(flat[mine]))
                return
            step = max(1, CUT_CHUNK_BYTES // full.element_size())
            for start in range(0, numel, step):  # every rank takes part in every chunk's broadcast
                piece = mesh.broadcast(rounded(flat[start : start + step]), src=src)
                lo, hi = max(start, mine.start), min(start + piece.numel(), mine.stop)
                if lo < hi:
                    shard[lo - mine.start : hi - mine.start].copy_(piece[lo - start : hi - start])
                if freed is not None:
                    nbytes = piece.numel() * piece.element_size()
                    del piece
                    freed(nbytes)


def _piece(numel: int, n: int, rank: int) -> slice:
    """Rank `rank`'s elements of a flattened tensor of `numel` elements cut into chunks of `n` (empty past the end)."""
    return slice(min(rank * n, numel), min((rank + 1) * n, numel))


def partition_of(param: Tensor) -> Partition | None:
    """The `Partition` a parameter built partitioned holds its values in, or None."""
    return getattr(param, PARTITION, None)


def partitioned(model: nn.Module) -> bool:
    """Whether any parameter of `model` was built partitioned."""
    return any(partition_of(p) is not None for p in model.parameters())


def gather_partitions(parts: Sequence[Partition]) -> list[Tensor]:
    """The full values of `parts` (cut across the same ranks), with one all-gather per dtype and device."""
    out: list[Tensor | None] = [None] * len(parts)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, part in enumerate(parts):
        groups.setdefault((part.shard.dtype, part.shard.device), []).append(i)
    for members in groups.values():
        mesh = parts[members[0]].mesh
        sizes = [parts[i].shard.numel() for i in members]
        total = sum(sizes)
        shards = [parts[i].shard for i in members]
        rows = mesh.all_gather(shards[0] if len(shards) == 1 else torch.cat(shards))
        if rows.untyped_storage().data_ptr() == shards[0].untyped_storage().data_ptr():
            rows = rows.clone()  # (a mesh of one may hand its input back: the values must not be the partition)
        rows = rows.view(mesh.world, total)
        start = 0
        for i, size in zip(members, sizes, strict=True):
            # views of `rows`, or of the copy `reshape` makes of its columns: no further copy
            full = rows[:, start : start + size].reshape(-1)[: parts[i].numel]
            out[i] = full.view(parts[i].shape)
            start += size
    return cast(list[Tensor], out)


def broadcast_tensors(mesh: Mesh, tensors: Sequence[Tensor], src: int) -> list[Tensor]:
    """Rank `src`'s values of `tensors` (the same shapes and dtypes on every rank) on every rank, with one broadcast
    per dtype and device."""
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    for members in groups.values():
        parts = [tensors[i].detach().reshape(-1) for i in members]
        flat = mesh.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts), src=src)
        start = 0
        for i in members:
            n = tensors[i].numel()
            out[i] = flat[start : start + n].view(tensors[i].shape)
            start += n
    return cast(list[Tensor], out)


@contextlib.contextmanager
def shapes_shown(model: nn.Module) -> Iterator[None]:
    """Inside, each partitioned parameter is replaced, in its module, by a `meta` parameter of its real shape (tied
    ones by one), so that what reads only shapes and dtypes (`fzero.layout.from_module`) sees the model's."""
    twins: dict[int, nn.Parameter] = {}
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                part = partition_of(p) if p is not None else None
                if part is None:
                    continue
                assert p is not None  # (a partition belongs to a parameter)
                if id(p) not in twins:
                    meta = torch.empty(part.shape, dtype=p.dtype, device="meta")
                    twins[id(p)] = nn.Parameter(meta, requires_grad=p.requires_grad)
                saved.append((module, name, p))
                module._parameters[name] = twins[id(p)]
        yield
    finally:
        for module, name, p in reversed(saved):
            module._parameters[name] = p


def partitioned_parameters(
    model: nn.Module,
    layout: Layout,
    mesh: Mesh,
    *,
    spill: str | os.PathLike[str] | None = None,
    release: bool = False,
) -> tuple[Tensor, Tensor | None, dict]:
    """Each rank's shard of the trainable and of the frozen parameters, and the buffers, of a model built
    partitioned (`Partition`) or in memory (`fzero.init` under a chain that shards): one unit at a time, each of
    its parameters all-gathered from its partition (one all-gather per unit) into the unit's flat buffer, of which
    this rank keeps its shard. Parameters not partitioned (made outside `zero.Init`) are taken as they are, rank 0's
    values broadcast. The model is left as it is, unless `release`.

    Args:
      model: the module (its parameters' values in their partitions or in themselves, none on `meta`).
      layout: its layout (`fzero.layout.from_module` under `shapes_shown`).
      mesh: the mesh the state is for.
      spill: a directory (the NVMe tier's): the trainable shard is built in a file there (`fzero.storage.Spill`),
        each unit's pages dropped once written, rather than in memory.
      release: empty each parameter once its unit is in the shards (and drop its `Partition`), as `fully_shard`
        and DeepSpeed's stage 3 release a module's parameters: the model's memory goes as the shard is built, so
        the model and the shard never both exist whole. Its buffers are left.

    Returns:
      `(shard, frozen, buffers)`, as `sharded_parameters` returns them.

    Raises:
      ValueError: a parameter that is neither partitioned nor materialised (on `meta`); it names it.
    """
    named = dict(model.named_parameters())
    meta = [n for n, p in named.items() if p.is_meta and partition_of(p) is None]
    if meta:
        raise ValueError(f"init: parameters {meta[:8]} are on the meta device and were not built under zero.Init; "
                         "materialise them, or build the whole model under zero.Init")  # fmt: skip
    spaces = [lay for lay in (layout, layout.frozen_layout) if lay is not None]
    shards = _Shards(spaces, spill)
    heap = HeapRelease()
    # the shard where the parameters are (a model on the GPU, a zero.Init stand-in made on it)
    device = next((p.device for p in named.values() if not p.is_meta), torch.device("cpu"))
    for unit_index in range(len(layout.units)):
        for space, lay in enumerate(spaces):
            unit = lay.units[unit_index]
            leaves = [leaf for leaf in lay.leaves if leaf.unit == unit_index]
            flat = torch.zeros(unit.size, dtype=dtype_of(lay.dtype), device=device)
            parts = [partition_of(named[leaf.name]) for leaf in leaves]
            gathered = iter(gather_partitions([p for p in parts if p is not None]))
            with torch.no_grad():
                for leaf, part in zip(leaves, parts, strict=True):  # (no name kept on a value: all go below)
                    start = leaf.offset - unit.start
                    own = named[leaf.name].detach()
                    flat[start : start + leaf.numel].copy_((next(gathered) if part is not None else own).reshape(-1))
            flat = mesh.replicate(flat)
            if any(p is None for p in parts):  # values made on each rank: rank 0's (a partition's are agreed)
                flat = mesh.broadcast(flat, src=0)
            piece = mesh.local_shard(flat, axis=lay.axis)
            shards.place(space, unit_index, piece)
            # the unit, gathered and flattened, is freed here, beside the shards that stay: its pages handed back
            # (a heap keeps them resident, and cannot reuse them for the next unit: `fzero.host.heap`)
            nbytes = 2 * flat.numel() * flat.element_size()
            del flat, piece, gathered, parts
            if release:
                nbytes += sum(_release(named[leaf.name]) for leaf in leaves)
            heap.freed(nbytes)
    heap.release()
    module_buffers = dict(model.named_buffers())
    with torch.no_grad():
        buffers = {s.name: mesh.broadcast(mesh.replicate(module_buffers[s.name].detach().clone()), src=0)
                   for s in layout.buffers}  # fmt: skip
    return (*shards.result(), buffers)


def external_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    """`(module path, parameter)` for each parameter registered as used in the forward of a module that does not
    own it (DeepSpeed's `register_external_parameter`, which fills the module's `_external_params`)."""
    return [(path, p) for path, m in model.named_modules() for p in getattr(m, EXTERNAL, {}).values()]

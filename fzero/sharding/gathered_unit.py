"""One unit of a rank's gathering: its state in the step and its own verbs (FSDP2's `FSDPParamGroup`).

A `GatheredUnit` knows how to gather itself (`start`, asynchronously ahead of its use, or `unshard`, ready to read),
free itself (`reshard`), hand out named views of its full buffers (`views`) and put them into its modules and take
them out again (`swap`, `unswap`). When each verb runs is the schedule's business
(`fzero.sharding.schedule.Gatherer`: the hooks, the prefetch order, the catch-up of units a rank did not run); what
the verbs of a rank's units share (the ranks, the two flat spaces' layouts, modes and buffers, the count of gathered
elements) is one `Spaces`.

How a unit's buffers live: the unit's parameters are the outputs of an autograd Function (`_Unit`), views of its
full trainable buffer, whose backward receives the unit's complete gradient exactly once, after its last use, and
hands it to the schedule (`GatheredUnit.on_gradient`) as its parameters' gradients, unconcatenated (`Pieces`); the
buffers' storage is resized to zero when the unit is freed and refilled before it is read again (FSDP's technique),
so the tensors autograd saved stay valid, and writing through a separate alias keeps their version counters
untouched; the memory behind it is a spare the units pass on (`fzero.host.scratch.refill`, `empty`), kept from step to
step below `fzero.host.scratch.KEPT_BELOW` bytes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import Tensor, nn

from ..host import scratch
from ..layout import ROOT_UNIT, Layout, unit_pieces, unit_views
from ..layout.pieces import Pieces
from ..mesh import Work
from ..mesh.ranks import Ranks
from .bind import carry_attributes, submodules

__all__ = ["EXACT", "FROZEN", "RESHARD", "TRAIN", "GatherSpec", "GatheredUnit", "Phase", "Spaces", "build_units"]

# the two flat spaces a unit has: trainable parameters, frozen parameters
TRAIN: Final = 0
FROZEN: Final = 1
FULL, KEEP, RESHARD = "full", "keep", "reshard"  # a space's buffers: given whole; gathered and kept; gathered, freed


@dataclasses.dataclass(frozen=True)
class GatherSpec:
    """How a lazily gathered unit travels (ZeRO++'s qwZ and hpZ at stage 3; `fzero.gather`).

    Attributes:
      blocks: for the trainable and the frozen space, int8 with one fp32 scale per that many elements (qwZ), or
        None: exact.
      secondary: a mesh axis: after its forward, each rank keeps its `1/size(secondary)` of the gathered unit (a
        secondary copy sharded over the axis's group), and the backward gathers the unit again from those, within
        the group only (hpZ). None: the backward gathers from the shards, as the forward.
    """

    blocks: tuple[int | None, int | None] = (None, None)
    secondary: str | None = None


EXACT = GatherSpec()  # units gathered exactly, from the shards, forward and backward


class Phase(enum.Enum):
    """Where a unit is in the step (FSDP2's training states)."""

    IDLE = "idle"  # before its forward, or between its forward and its backward
    FORWARD = "forward"  # its module is computing (a forward, or a recompute's)
    BACKWARD = "backward"  # its outputs' gradients arrived: gathered again, its views in its modules
    DONE = "done"  # its gradient is reduced


def _alias(store: Tensor) -> Tensor:
    """A tensor on `store`'s storage that autograd does not track: writes through it leave the version counters of
    `store`'s views (the tensors autograd saved) untouched."""
    return store.new_empty(0).set_(store.untyped_storage(), store.storage_offset(), store.shape, store.stride())


def _mode(layout: Layout | None, buffer: Tensor | None, keep: bool) -> str:
    """A space's mode (see `Spaces`): `FULL` when its buffer is whole (at world 1 a shard is)."""
    if layout is None or buffer is None:
        return RESHARD  # no such space: never gathered
    if layout.is_full(buffer):
        return FULL
    return KEEP if keep else RESHARD


def _full(layout: Layout | None, buffer: Tensor | None, mode: str) -> Tensor | None:
    """A space's full buffer (see `Spaces`): the buffer given whole (`FULL`), one to gather into (`KEEP`), or
    None (`RESHARD`: each unit gets its own)."""
    if mode == FULL:
        return buffer
    if mode == KEEP:
        assert layout is not None and buffer is not None  # (a space without them is `RESHARD`)
        return scratch.new_empty("gathered", buffer, (layout.numel,))
    return None


@dataclass
class Spaces:
    """What one rank's units share: the ranks, and the two flat spaces (trainable, frozen) they are gathered from.

    Each space is in one of three modes: `FULL` (the buffer is given whole: stage 0, or a buffer kept from an
    earlier micro-step of the accumulation window; units are views of it), `KEEP` (gathered unit by unit into one
    full buffer as the forward reaches them, kept to the end: stages 1-2), `RESHARD` (each unit gathered into a
    buffer of its own, freed after its forward, gathered again for its backward: stage 3).

    Attributes:
      ranks, rank: the mesh's strategy (`fzero.mesh.ranks`) and the rank the units are gathered for.
      layouts: the trainable layout and the frozen one (None without frozen parameters).
      shards: this rank's trainable and frozen (or None) buffers: shards, or full buffers (`FULL`); the trainable
        one is the autograd leaf.
      everyone: every rank's trainable and frozen shards as per-rank values (on a DistMesh: this rank's).
      gradients: the units' gradients are reduced (the trainable views go through `_Unit`); False for forwards
        without gradients.
      modes: each space's mode.
      full: each space's full buffer (`FULL`, `KEEP`), or None (`RESHARD`).
      live_elements: the elements gathered into buffers of their own now (a `FULL` space counts nothing).
      peak: the most `live_elements` so far.
      source: where the trainable units' shard pieces come from when the shard is not in memory (offloaded to
        disk: `fzero.storage.UnitReader`): `source(unit)` is every rank's piece of the unit as per-rank values, on
        the step's compute device; `shards` then holds an empty placeholder of the compute dtype on that device
        (the autograd leaf, and what the units' buffers are made like: `fzero.sharding.units.on_disk`).
      gather_spec: how `RESHARD` units travel (`GatherSpec`: int8 gathers, hpZ's secondary copies).
      kept_elements, kept_peak: the elements of hpZ secondary copies this rank holds now / at most so far.
    """

    ranks: Ranks
    rank: int
    layouts: tuple[Layout, Layout | None]
    shards: tuple[Tensor, Tensor | None]
    everyone: tuple[Tensor, Tensor | None]
    gradients: bool
    modes: tuple[str, ...]
    full: list[Tensor | None]
    live_elements: int = 0
    peak: int = 0
    source: Callable[[int], Tensor] | None = None
    gather_spec: GatherSpec = EXACT
    kept_elements: int = 0
    kept_peak: int = 0

    @classmethod
    def create(
        cls,
        ranks: Ranks,
        rank: int,
        layout: Layout,
        shards: tuple[Tensor, Tensor | None],
        everyone: tuple[Tensor, Tensor | None],
        gradients: bool,
        keep: bool,
        source: Callable[[int], Tensor] | None = None,
        gather_spec: GatherSpec = EXACT,
    ) -> Spaces:
        """The spaces of `layout` (and its frozen layout) over `shards`.

        Args:
          ranks, rank, shards, everyone, gradients: as the attributes.
          layout: the step's layout.
          keep: keep gathered units (`KEEP`) rather than free them (`RESHARD`).
          source, gather_spec: as the attributes.

        Returns:
          The spaces, nothing gathered yet.
        """
        layouts = (layout, layout.frozen_layout)
        modes = tuple(_mode(lay, x, keep) for lay, x in zip(layouts, shards, strict=True))
        if source is not None:  # read unit by unit whatever the world size (never given whole)
            modes = (KEEP if keep else RESHARD, modes[1])
        full = [_full(lay, x, mode) for lay, x, mode in zip(layouts, shards, modes, strict=True)]
        if source is not None and modes[0] == KEEP:
            full[0] = scratch.new_empty("gathered", shards[0], (layout.numel,))
        return cls(
            ranks, rank, layouts, shards, everyone, gradients, modes, full, source=source, gather_spec=gather_spec
        )


class _Unit(torch.autograd.Function):
    """shard slice -> the unit's parameters, views of its full trainable buffer (an alias of the unit's storage,
    which the unit fills and frees); backward: hand the unit's complete gradient, as its parameters' gradients
    (`fzero.layout.pieces.Pieces`: no concatenation), to the schedule (`GatheredUnit.on_gradient`)."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, unit: GatheredUnit, sizes: tuple[int, ...],
                shapes: tuple[torch.Size | None, ...]) -> tuple[Tensor, ...]:  # fmt: skip
        # the node keeps the callback, not the unit: as long as the graph lives, its backward reaches the schedule
        # even after the unit let go of it (`GatheredUnit.release`)
        assert unit.on_gradient is not None, f"unit {unit.name!r} was released"
        ctx.on_gradient, ctx.index, ctx.sizes, ctx.owned = unit.on_gradient, unit.index, sizes, shapes
        ctx.set_materialize_grads(False)  # (a parameter the loss does not reach: None, written as zeros)
        pieces = _alias(unit.store(TRAIN)).split(sizes)
        return tuple(p.view(shape) for p, shape in zip(pieces, shapes, strict=True) if shape is not None)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        given = iter(grads)
        ctx.on_gradient(ctx.index, Pieces(ctx.sizes, tuple(None if s is None else next(given) for s in ctx.owned)))
        return None, None, None, None


@dataclass
class GatheredUnit:
    """One unit's place in a gathering, and the verbs that gather, free and swap it.

    Attributes:
      index, name: the unit's index and name in the layout.
      module: the module whose forward gathers it, or None when it is gathered for the whole step (the root unit,
        units at or below the persistence threshold, units holding a parameter tied across units).
      sizes: elements of the unit's full buffer in each space (0 where the space has no real element in it: such
        a space is never gathered).
      shared: what the rank's units share (`Spaces`).
      on_gradient: called as `on_gradient(index, grad)` with the unit's complete trainable gradient (the
        schedule's post-backward); None once the unit is released.
      phase: where the unit is in the step (`Phase`).
      stores: each space's full buffer while gathered; its storage is resized to 0 when released.
      live: whether each space's buffer is gathered now (unsharded).
      pending: collectives in flight into `stores`.
      kept: each space's hpZ secondary copy (`Spaces.gather_spec.secondary`) while held: this rank's chunk of the unit
        as gathered by its forward (per-rank values), kept from the forward to the backward's gather.
      named: the unit's parameters as named views of `stores` (created once, when the unit first runs: `views`).
      swaps: how many times the views are in the unit's modules now (its forward, its backward; an activation-
        checkpoint recompute that stopped early never ends its forward): the modules' own tensors come back
        when it drops to 0.
      originals: `(owner, name, original)` for the module slots the views took.
      owners: the model's submodules by path (`fzero.sharding.bind.submodules`, the step's), where `swap` finds the
        views' modules.
      inputs_done: the gradient of an input of its module exists (its frozen buffer is no longer needed).
      ran: its forward ran this step.
      passed: its forward did not run here but was passed (`Gatherer.catch_up_forward`).
    """

    index: int
    name: str
    module: nn.Module | None
    sizes: tuple[int, ...]
    shared: Spaces
    on_gradient: Callable[[int, Tensor | Pieces], None] | None
    phase: Phase = Phase.IDLE
    stores: list[Tensor | None] = field(default_factory=lambda: [None, None])
    live: list[bool] = field(default_factory=lambda: [False, False])
    pending: list[Work] = field(default_factory=list)
    kept: list[Tensor | None] = field(default_factory=lambda: [None, None])
    named: dict[str, Tensor] | None = None
    swaps: int = 0
    originals: list[tuple[nn.Module, str, Any]] = field(default_factory=list)
    owners: dict[str, nn.Module] = field(default_factory=dict)
    inputs_done: bool = False
    ran: bool = False
    passed: bool = False

    def store(self, space: int) -> Tensor:
        """`stores[space]`, set since the space was first gathered."""
        store = self.stores[space]
        assert store is not None, f"unit {self.name!r} was never gathered"
        return store

    # -- unshard and reshard -------------------------------------------------------------------------------------
    def start(self, ahead: bool = False) -> None:
        """Gather the unit into its storages: asynchronously when prefetching `ahead` of its use, else at once (an
        async collective waited on at once buys nothing and leaves one more handle in flight)."""
        sp, i = self.shared, self.index
        for space, lay in enumerate(sp.layouts):
            size = self.sizes[space]
            if not size or self.live[space]:
                continue
            assert lay is not None  # (a space with elements has one)
            if sp.modes[space] != RESHARD:  # views of one full buffer (given whole, or gathered into)
                full = sp.full[space]
                assert full is not None  # (`_full`)
                self.stores[space] = full[lay.unit_slice(i)]
                if sp.modes[space] == FULL:
                    self.live[space] = True
                    continue
            store, shard, everyone = self.stores[space], sp.shards[space], sp.everyone[space]
            assert shard is not None and everyone is not None  # (a space with elements has buffers)
            if store is None:
                store = self.stores[space] = shard.new_empty(0)
            if sp.modes[space] == RESHARD:  # (a `KEEP` unit is a view of the full buffer)
                scratch.refill(store.untyped_storage(), size * store.element_size())
                if store.numel() != size:  # (its first gather)
                    store.set_(store.untyped_storage(), 0, (size,), (1,))
            piece, axis, block = lay.unit_shard_slice(i), lay.axis, sp.gather_spec.blocks[space]
            kept = self.kept[space]
            if kept is not None:  # hpZ: from the secondary copies, exactly as the forward gathered them
                everyone, piece, axis, block = kept, slice(None), sp.gather_spec.secondary, None
            elif space == TRAIN and sp.source is not None:  # the pieces read from disk, then gathered as usual
                everyone, piece = sp.source(i), slice(None)
            work = sp.ranks.gather_into(_alias(store), everyone, piece, sp.rank, ahead, axis, block)
            self.pending.append(work)
            self.live[space] = True
            sp.live_elements += size
        sp.peak = max(sp.peak, sp.live_elements)

    def unshard(self) -> None:
        """The unit gathered and ready to read."""
        self.start()
        for work in self.pending:
            work.wait()
        self.pending.clear()

    def reshard(self, spaces: tuple[int, ...] = (TRAIN, FROZEN)) -> None:
        """Free the unit's buffers in `spaces` (waiting first for collectives still writing them)."""
        for work in self.pending:
            work.wait()
        self.pending.clear()
        sp = self.shared
        for space in spaces:
            if self.live[space] and sp.modes[space] == RESHARD:  # the others stay to the end
                self._keep(space)
                scratch.empty(self.store(space).untyped_storage())
                self.live[space] = False
                sp.live_elements -= self.sizes[space]
            if self.phase is Phase.DONE:  # the backward gathered it: the secondary copy has served
                self._drop(space)

    def _keep(self, space: int) -> None:
        """hpZ: after the unit's forward (a backward to come), keep this rank's chunk of what it gathered."""
        sp = self.shared
        axis = sp.gather_spec.secondary
        if axis is None or self.phase is not Phase.IDLE or not sp.gradients or not torch.is_grad_enabled():
            return
        if self.kept[space] is None:
            kept = self.kept[space] = sp.ranks.secondary(_alias(self.store(space)), axis)
            sp.kept_elements += kept.shape[-1]
            sp.kept_peak = max(sp.kept_peak, sp.kept_elements)

    def _drop(self, space: int) -> None:
        kept = self.kept[space]
        if kept is not None:
            self.shared.kept_elements -= kept.shape[-1]
            self.kept[space] = None

    def views(self) -> dict[str, Tensor]:
        """Named views of the unit's full buffers, created just before the unit first runs: with gradients, the
        trainable one through its autograd node, which autograd (ordering its backward by creation) completes right
        after the unit's backward; created in grad mode even inside a `no_grad` forward (reentrant activation
        checkpointing recomputes it later with gradients)."""
        if self.named is None:
            self.unshard()
            sp = self.shared
            views: dict[str, Tensor] = {}
            for space, lay in enumerate(sp.layouts):
                if not self.sizes[space]:
                    continue
                assert lay is not None  # (a space with elements has one)
                if space == TRAIN and sp.gradients:
                    sizes, owners = unit_pieces(lay, self.index)
                    shapes = tuple(None if leaf is None else torch.Size(leaf.shape) for leaf in owners)
                    with torch.enable_grad():
                        out = _Unit.apply(sp.shards[TRAIN][lay.unit_shard_slice(self.index)], self, sizes, shapes)
                    named = [leaf.name for leaf in owners if leaf is not None]
                    views.update(zip(named, (out,) if isinstance(out, Tensor) else out, strict=True))
                else:
                    views.update(unit_views(lay, self.index, _alias(self.store(space))))
            self.named = views
        return self.named

    # -- the unit's modules --------------------------------------------------------------------------------------
    def swap(self) -> None:
        """Put the unit's views into its modules (as functional_call does: the modules compute with them)."""
        self.swaps += 1
        if self.swaps > 1:
            return
        assert self.module is not None  # (only a unit gathered on demand is swapped)
        for name, view in self.views().items():
            path, _, pname = name.rpartition(".")
            owner = self.owners[path]  # (the step's walk lists every module a parameter's name passes through)
            table: dict[str, Any] = owner._parameters  # (typed for Parameters; a view stands in, as in functional_call)
            self.originals.append((owner, pname, table[pname]))
            carry_attributes(table[pname], view)
            table[pname] = view

    def unswap(self, every: bool = False) -> None:
        """End one `swap` (or all, with `every`); the modules get their own tensors back after the last."""
        self.swaps = 0 if every else max(self.swaps - 1, 0)
        if self.swaps == 0:
            for owner, pname, original in reversed(self.originals):
                owner._parameters[pname] = original
            self.originals.clear()

    def leave_backward(self) -> None:
        """End the swap the unit's backward began, if it is in its backward."""
        if self.phase is Phase.BACKWARD:
            self.unswap()

    def release(self) -> None:
        """The gathering is over: the modules' own tensors back, the buffers freed and dropped."""
        self.unswap(every=True)
        self.reshard()
        # the views' autograd nodes hold the gatherer (ctx.on_gradient), which holds this unit: a reference cycle
        # through C++ that Python's collector cannot see, so drop the views explicitly or every step would leak a
        # gradient
        self.named = None
        self.stores = [None, None]
        for space in (TRAIN, FROZEN):
            self._drop(space)
        # and `on_gradient` (the gatherer's bound method) makes gatherer -> unit -> gatherer a cycle that only the
        # collector would free, late, with what the gatherer still holds: drop it so the gatherer goes at once
        self.on_gradient = None


def build_units(
    layout: Layout,
    model: nn.Module,
    shared: Spaces,
    persistence_threshold: int,
    on_gradient: Callable[[int, Tensor | Pieces], None],
) -> list[GatheredUnit]:
    """Every unit of `layout`; which are gathered on demand (a module, above the persistence threshold, no parameter
    tied across units: it must be reachable whenever either unit runs).

    Args:
      layout, model: the step's.
      shared: what the units share.
      persistence_threshold: units with at most this many elements are gathered for the whole step.
      on_gradient: each unit's `on_gradient`.

    Returns:
      The units, in the layout's order.
    """
    modules = submodules(model)
    layouts = (layout, layout.frozen_layout)
    unit_of = {leaf.name: leaf.unit for lay in layouts if lay is not None for leaf in lay.leaves}
    crossed = {unit_of[n] for a, n in layout.aliases if not a.startswith(f"{layout.units[unit_of[n]].name}.")}
    units = []
    for i, u in enumerate(layout.units):
        sizes = tuple(lay.units[i].size if lay is not None and lay.units[i].numel > 0 else 0 for lay in layouts)
        on_demand = u.name != ROOT_UNIT and u.name in modules and sum(sizes) > persistence_threshold
        module = modules[u.name] if on_demand and i not in crossed else None
        units.append(GatheredUnit(i, u.name, module, sizes, shared, on_gradient, owners=modules))
    return units

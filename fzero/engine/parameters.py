"""`ParameterAccess`: the model's parameters as handles on the engine's state, the way DeepSpeed's ZeRO shows them.

DeepSpeed hangs its optimizer on every parameter (`param._z3_optimizer`), and its free functions that take a
parameter (`safe_get_full_fp32_param`, `GatheredParameters`, ...) find the state through it. Here every parameter
of `engine.module` is registered, weakly, as the engine's: `owner(param)` finds the engine (or None: a parameter of
no engine, or of one since collected), and the engine reads and writes the parameter's values in its `TrainState`:

    full_fp32_param(p, key)       the master value (key: an optimizer state, e.g. "exp_avg"), all-gathered
    set_full_fp32_param(p, v)     every rank writes its fragment of `v` (the same on every rank): master, compute
    local_fp32_param(p, key)      this rank's fragment, no communication; set_local_fp32_param writes it
    full_grad(p), local_grad(p)   the gradient after `backward`, before `step`, reduced over the ranks
    gathered_values(ps)           the full values (master; frozen parameters their own), for `GatheredParameters`
    assign_values(ps, vs)         write full values into the master, the compute copy and the module

A **fragment** is the part of a parameter in this rank's shard: fzero shards units (each rank the `r`-th of `world`
equal chunks of a unit), not parameters, so a fragment's size is not DeepSpeed's `ceil(numel / world)` and may be
empty; the fragments of all ranks, in rank order, are the parameter.

At stage 3 (compute parameters sharded at rest) every parameter carries DeepSpeed's attributes as scripts read them
(`ds_id`, `ds_status`, `ds_numel`, `ds_shape`, `ds_tensor`: this rank's fragment of the compute shard, a view;
`ds_persist`); at stages 0-2 it carries none, as in DeepSpeed. A model built under `zero.Init` hands its values to
the state at `init`; the engine then drops the construction's partitions.

The engine must list `ParameterAccess` before `ModuleSync` among its bases: its `_sync_module` rebinds the
attributes after `ModuleSync`'s.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..config import Config
from ..host.hostmem import trim_heap
from ..layout import Layout, Leaf
from ..mesh import RankMesh
from ..sharding.construct import PARTITION
from ..state import TrainState
from ..step.microstep import MicroStep
from ..storage import Offloaded, in_memory

__all__ = ["ParameterAccess", "ZeroParamStatus", "ZeroParamType", "mark", "next_ds_id", "owner"]

DS_ATTRIBUTES = ("ds_id", "ds_status", "ds_numel", "ds_shape", "ds_tensor", "ds_persist", "ds_param_type")
NO_GRADIENT = "Gradients are only available immediately after backward and before engine step"  # (DeepSpeed's)


class ZeroParamStatus(Enum):
    """DeepSpeed's `ds_status`: whether a parameter's full value is present."""

    AVAILABLE = 1  # present on every rank
    NOT_AVAILABLE = 2  # partitioned: each rank holds its part
    INFLIGHT = 3  # being gathered


class ZeroParamType(Enum):
    """DeepSpeed's `ds_param_type`."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


_IDS = itertools.count()
# parameter -> the engine that owns it (weak both ways: a parameter kept by a user does not keep its engine alive)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def next_ds_id() -> int:
    """A fresh `ds_id` (one counter for `zero.Init` and the engines: ids are unique in the process)."""
    return next(_IDS)


def mark(param: Tensor, ds_id: int | None, shape: tuple[int, ...], partition: Tensor | None, available: bool) -> None:
    """Give `param` DeepSpeed's attributes of a ZeRO-3 parameter (`ds_id`: a fresh one if None; `ds_tensor`: this
    rank's `partition`, or an empty tensor)."""
    attrs: dict[str, Any] = {
        "ds_id": next_ds_id() if ds_id is None else ds_id,
        "ds_param_type": ZeroParamType.PARTITIONED,
        "ds_status": ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE,
        "ds_numel": math.prod(shape),
        "ds_shape": torch.Size(shape),
        "ds_tensor": partition if partition is not None else torch.empty(0, dtype=param.dtype),
        "ds_persist": False,
    }
    param.__dict__.update(attrs)


def owner(param: Tensor) -> ParameterAccess | None:
    """The engine whose state holds `param`'s values, or None."""
    ref = _OWNERS.get(param)
    engine = ref() if ref is not None else None
    return engine if engine is not None and param in engine._places else None


@dataclass(frozen=True)
class _Place:
    """Where a parameter's values are: its leaf in the trainable or the frozen layout."""

    layout: Layout
    leaf: Leaf
    frozen: bool


def _length(span: slice) -> int:
    return span.stop - span.start


class _Reduced:
    """Stands in for a micro-step's unit gathering whose reduction was finished early, to read the gradient before
    `step()`: it hands `step()` that gradient."""

    received = True

    def __init__(self, grads: Tensor, peak: int) -> None:
        self.grads, self.peak = grads, peak

    def finish(self) -> Tensor:
        return self.grads

    def close(self) -> None:
        pass

    def complete(self, abandoned: bool = False) -> None:
        pass


class ParameterAccess:
    """The model's parameters as handles on the engine's state (see the module docstring), for `fzero.Engine`."""

    state: TrainState
    mesh: RankMesh
    config: Config
    _micro: MicroStep | None
    _grad: Tensor | None
    _gas_factor: float
    _gathered: tuple[Tensor | None, Tensor] | None

    if TYPE_CHECKING:  # (the engine's)

        @property
        def module(self) -> nn.Module: ...

    # ------------------------------------------------------------------------------------------------- binding
    def _sync_module(self) -> None:
        super()._sync_module()  # type: ignore[misc]  # (ModuleSync's, next in the engine's bases)
        self._bind_parameters()

    def _bind_parameters(self) -> None:
        """Register the module's parameters as this engine's and give them DeepSpeed's attributes (stage 3)."""
        state = self.state
        key = (state.layout, state.params, state.compute, state.frozen)
        last = getattr(self, "_bound_key", None)
        if last is not None and all(a is b for a, b in zip(key, last, strict=True)):
            return  # (the same buffers as at the last binding: the views still hold)
        frozen_layout = state.layout.frozen_layout
        places = {leaf.name: _Place(lay, leaf, lay is frozen_layout)
                  for lay in (state.layout, frozen_layout) if lay is not None for leaf in lay.leaves}  # fmt: skip
        self._places: WeakIdKeyDictionary = WeakIdKeyDictionary()
        stage3 = state.plan.stage == 3
        dropped = False
        for name, p in self.module.named_parameters():
            place = places[name]
            self._places[p] = place
            _OWNERS[p] = weakref.ref(self)
            # the state holds the values now: the construction's partition goes
            dropped |= p.__dict__.pop(PARTITION, None) is not None
            if not stage3:
                for attr in DS_ATTRIBUTES:
                    p.__dict__.pop(attr, None)
                continue
            shard = self._tensor(place, "compute")
            fragment = shard[self._fragment(place, shard)[1]] if not isinstance(shard, Offloaded) else None
            # (at world 1 nothing is sharded at rest: the module holds the values)
            available = not state.plan.sharded_at_rest
            mark(p, getattr(p, "ds_id", None), place.leaf.shape, fragment, available)
        if dropped:  # the partitions freed among the state's tensors: their pages back (`fzero.host.heap` says why)
            trim_heap()
        self._bound_key = key

    # ------------------------------------------------------------------------------------------ where, which
    def _place(self, param: Tensor) -> _Place:
        place = self._places.get(param) if hasattr(self, "_places") else None
        if place is None:
            raise ValueError("this parameter is not one of the engine's (engine.module's parameters are)")
        return place

    def _tensor(self, place: _Place, role: str, key: str | None = None) -> Any:
        """This rank's flat buffer holding the parameter's `role` values ("master", "compute"), or optimizer state
        `key`."""
        state = self.state
        if place.frozen:
            assert state.frozen is not None  # (a frozen parameter has its buffer)
            return state.frozen
        if key is not None:
            found = getattr(state.plan.state_of(state.tx_state, "update"), key, None)
            if not isinstance(found, Tensor | Offloaded) or found.shape != state.params.shape:
                raise ValueError(f"{key} not found in optimizer state fragment")  # (DeepSpeed's message)
            return found
        if role == "compute" and state.compute is not None:
            return state.compute
        return state.params

    def _fragment(self, place: _Place, x: Any, rank: int | None = None) -> tuple[slice, slice]:
        """The parameter's fragment in this rank's (or `rank`'s) flat buffer `x` (full, or a shard): its elements
        in the flattened parameter, and where they are in `x`."""
        lay, leaf = place.layout, place.leaf
        if lay.is_full(x):
            return slice(0, leaf.numel), slice(leaf.offset, leaf.offset + leaf.numel)
        unit = lay.units[leaf.unit]
        chunk = unit.size // lay.world
        low = unit.start + chunk * (self.mesh.index(lay.axis) if rank is None else rank)
        a = max(leaf.offset, low)
        b = max(a, min(leaf.offset + leaf.numel, low + chunk))
        return slice(a - leaf.offset, b - leaf.offset), slice(unit.shard_start + a - low, unit.shard_start + b - low)

    def _own_shard(self, layout: Layout, full: Tensor) -> Tensor:
        """This rank's shard of a full flat buffer (each unit's chunk of this rank, end to end)."""
        r = self.mesh.index(layout.axis)
        return torch.cat(
            [full[u.start + r * (u.size // layout.world) :][: u.size // layout.world] for u in layout.units]
        )

    # ------------------------------------------------------------------------------------------ read, write
    def _full(self, places: list[_Place], buffers: list[Any]) -> list[Tensor]:
        """The full values of parameters at `places` from the per-rank flat `buffers`: one all-gather per mesh
        axis and dtype for the sharded ones, each rank sending its fragments padded to the longest rank's."""
        out: list[Tensor | None] = [None] * len(places)
        groups: dict[tuple[Any, torch.dtype], list[int]] = {}
        for i, (place, x) in enumerate(zip(places, buffers, strict=True)):
            x = buffers[i] = in_memory(x)
            if place.layout.is_full(x):
                out[i] = x[self._fragment(place, x)[1]].view(place.leaf.shape).clone()
            else:
                groups.setdefault((place.layout.axis, x.dtype), []).append(i)
        for (axis, _), members in groups.items():
            # every rank's fragment of each parameter (static: the layout says), the longest one padded to
            lengths = [[_length(self._fragment(places[i], buffers[i], r)[0]) for r in range(places[i].layout.world)]
                       for i in members]  # fmt: skip
            chunks = [max(row) for row in lengths]
            mine = [buffers[i][self._fragment(places[i], buffers[i])[1]] for i in members]
            send = torch.cat([nn.functional.pad(m, (0, c - m.numel())) for m, c in zip(mine, chunks, strict=True)])
            rows = self.mesh.all_gather(send, axis=axis).view(places[members[0]].layout.world, -1)
            start = 0
            for i, c, row in zip(members, chunks, lengths, strict=True):
                out[i] = torch.cat([rows[r, start : start + n] for r, n in enumerate(row)]).view(places[i].leaf.shape)
                start += c
        return cast(list[Tensor], out)

    def _write(self, place: _Place, x: Any, value: Tensor, whole: bool = True) -> None:
        """Write this rank's fragment of `value` (the full parameter, or with `whole=False` the fragment itself)
        into the flat buffer `x`."""
        if isinstance(x, Offloaded):
            raise NotImplementedError("writing a parameter whose state is offloaded to NVMe is not supported by "
                                      "fzero: write it before initialize, or offload to the CPU")  # fmt: skip
        mine, where = self._fragment(place, x)
        value = value.detach().reshape(-1)
        with torch.no_grad():
            x[where].copy_(value[mine] if whole else value)

    def _check_writable(self, what: str) -> None:
        if self._micro is not None:
            raise RuntimeError(
                f"{what}: a micro-step is in flight (between engine(...) and engine.step()) and computes with the "
                "parameters it started with; write them after engine.step()"
            )

    def _refresh(self) -> None:
        """The compute copy changed in place: the module's gathered views (stages 1-2) are stale."""
        if self._gathered is not None:
            self._gathered = (None, self._gathered[1])
        self._sync_module()

    def full_fp32_param(self, param: Tensor, key: str | None = None) -> Tensor | None:
        """The full master value of `param` (or of its optimizer state `key`); None for a frozen parameter. A
        collective at stages 1-3: call it on every rank."""
        place = self._place(param)
        if place.frozen:
            return None
        return self._full([place], [self._tensor(place, "master", key)])[0]

    def set_full_fp32_param(self, param: Tensor, value: Tensor, key: str | None = None) -> None:
        """Write the full master value of `param` (or of its optimizer state `key`): each rank its fragment of
        `value`, which must be the same on every rank; a parameter's compute copy (what the next forward uses) too,
        at once (DeepSpeed's follows at its next update). A frozen parameter is left as it is (as in DeepSpeed)."""
        place = self._place(param)
        if place.frozen:
            return
        if value.numel() != place.leaf.numel:
            raise ValueError(f" Number of elements do not match: {value.numel()} != {place.leaf.numel}")
        self._check_writable("safe_set_full_" + ("fp32_param" if key is None else "optimizer_state"))
        self._write(place, self._tensor(place, "master", key), value)
        if key is None:
            self._write(place, self._tensor(place, "compute"), value)
            self._refresh()

    def local_fp32_param(self, param: Tensor, key: str | None = None) -> Tensor | None:
        """This rank's fragment of the master value of `param` (or of its optimizer state `key`), flat (a copy);
        None for a frozen parameter."""
        place = self._place(param)
        if place.frozen:
            return None
        x = in_memory(self._tensor(place, "master", key))
        return x[self._fragment(place, x)[1]].clone()

    def set_local_fp32_param(self, param: Tensor, value: Tensor, key: str | None = None) -> None:
        """Write this rank's fragment of the master value of `param` (or of its optimizer state `key`), and of the
        compute copy (see `set_full_fp32_param`)."""
        place = self._place(param)
        if place.frozen:
            return
        x = self._tensor(place, "master", key)
        mine = self._fragment(place, x)[0]
        if value.numel() != mine.stop - mine.start:
            raise ValueError(f" Number of elements do not match: {value.numel()} != {mine.stop - mine.start} (this "
                             "rank's fragment: safe_get_local_fp32_param(param).numel())")  # fmt: skip
        self._check_writable("safe_set_local_" + ("fp32_param" if key is None else "optimizer_state"))
        self._write(place, x, value, whole=False)
        if key is None:
            self._write(place, self._tensor(place, "compute"), value, whole=False)
            self._refresh()

    def gathered_values(self, params: list[Tensor]) -> list[Tensor]:
        """The full values of `params` (the master's; frozen parameters their own), for `GatheredParameters`."""
        places = [self._place(p) for p in params]
        return self._full(places, [self._tensor(place, "master") for place in places])

    def assign_values(self, params: list[Tensor], values: list[Tensor]) -> None:
        """Write the full `values` (the same on every rank) of `params` into the master, the compute copy and the
        module's view of them, as `GatheredParameters(..., modifier_rank=r)` does on exit."""
        self._check_writable("GatheredParameters(..., modifier_rank=...)")
        for p, value in zip(params, values, strict=True):
            place = self._place(p)
            if value.numel() != place.leaf.numel:
                raise ValueError(f"GatheredParameters: a value of {value.numel()} elements for a parameter of "
                                 f"shape {place.leaf.shape}: its shape is fixed once the engine holds it")  # fmt: skip
            self._write(place, self._tensor(place, "master"), value)
            if not place.frozen:
                self._write(place, self._tensor(place, "compute"), value)
        self._refresh()

    # ------------------------------------------------------------------------------------------------- gradients
    def _gradient(self) -> tuple[Tensor, Layout]:
        """The micro-step's gradient so far as DeepSpeed holds it between `backward` and `step`: reduced over the
        ranks (their mean) and averaged over the accumulation window (the micro-steps so far, divided by its
        length), in float32 and scaled by the loss scale (fp16) as DeepSpeed's; this rank's flat buffer (a shard,
        or full where nothing is sharded).

        Per-unit reduction (stage 3): reading it finishes the micro-step's reduction, so a further `backward` before
        `step()` adds nothing (DeepSpeed's gradients are likewise read "immediately after backward")."""
        micro, state, layout = self._micro, self.state, self.state.layout
        plan = state.plan
        if micro is None:
            raise ValueError(NO_GRADIENT)
        window = plan.state_of(state.tx_state, "accumulate") if plan.accumulate > 1 else None
        acc = None if window is None else in_memory(window.acc)
        if micro.per_unit:
            opened = cast(Any, micro)  # (MicroStep's gathering: its reduction, finished here once)
            gathering = opened._gathering
            if not isinstance(gathering, _Reduced):
                if not micro.received:
                    raise ValueError(NO_GRADIENT)
                grads = micro.reduced_gradients()
                opened._gathering = gathering = _Reduced(grads, micro.gathered_peak or 0)
            g = gathering.grads * self._gas_factor if self._gas_factor != 1.0 else gathering.grads
        else:
            pending = self._grad
            if micro.leaf.grad is not None:  # a manual loss.backward()
                pending = micro.leaf.grad if pending is None else pending + micro.leaf.grad
            if pending is None:
                raise ValueError(NO_GRADIENT)
            g = pending
            if acc is not None and plan.accumulate_before_reduce:  # stage 1: the window's local sum, then reduced
                g, acc = acc + g.to(acc.dtype), None
            g = self.mesh.all_reduce(g, "mean")
            if acc is not None and not layout.is_full(acc):  # stage 2: the window's sum is of reduced shards
                g = self._own_shard(layout, g)
        if window is not None:
            g = (acc + g.to(acc.dtype) if acc is not None else g) / plan.accumulate
        return g.float(), layout

    def full_grad(self, param: Tensor) -> Tensor | None:
        """The full gradient of `param` (see `_gradient`); None for a frozen parameter. A collective."""
        place = self._place(param)
        if place.frozen:
            return None
        g, _ = self._gradient()
        return self._full([place], [g])[0]

    def local_grad(self, param: Tensor) -> Tensor | None:
        """This rank's fragment of the gradient of `param` (see `_gradient`); None for a frozen parameter."""
        place = self._place(param)
        if place.frozen:
            return None
        g, _ = self._gradient()
        return g[self._fragment(place, g)[1]].clone()

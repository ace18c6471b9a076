"""How a parameter pytree maps into one padded flat buffer and its per-rank shards.

(Over 500 lines: offsets, padding, units, the unit- and rank-major orders and the hybrid axis are one set of
invariants that every other module and every checkpoint relies on; they are kept and tested together.)

A `Layout` is static, pure and serialisable: names, shapes, dtypes and offsets, never values.

Trainable parameters are grouped into **units** (by default one per child of each `nn.ModuleList`, plus one for
everything else, or module by module for a model without one: `fzero.layout.units`): the unit is what ZeRO-3
gathers at once. Three orders of the same elements exist:

- *unit-major* (the **full** buffer, length `numel`): units end to end, in order of first appearance; inside a
  unit, parameters in `named_parameters()` order, each starting at a multiple of `align` elements, then zero
  padding up to a multiple of `world * align`.
- *shard* (length `shard_numel = numel / world`): rank `r` holds, for every unit `u`, the `r`-th of its `world`
  equal chunks, units end to end. A unit's shard slice is therefore contiguous on every rank, so gathering one unit
  is one all-gather with no copy.
- *rank-major* (length `numel`): the `world` shards end to end; the order collectives move. Permuting between
  unit-major and rank-major costs one copy, or nothing when there is a single unit.

Frozen parameters (`requires_grad=False`) get a flat buffer of their own, `Layout.frozen_layout`: a `Layout` with
the same units (by index and name), so that stage 3 shards them at rest and gathers them unit by unit with the
trainable ones; they have no optimizer state and are never updated. A unit that holds only frozen parameters (or
only trainable ones) is padding in the other space; collectives skip such units. Buffers are recorded by name,
shape, dtype and whether they are persistent (part of `state_dict()`); the state carries them unsharded.

Example:
    >>> import torch
    >>> lay = make_layout([("w", (3, 2), torch.float32), ("b", (3,), torch.float32)], world=2, align=4)
    >>> lay.numel, lay.shard_numel
    (16, 8)
    >>> flat = flatten(lay, {"w": torch.ones(3, 2), "b": torch.zeros(3)})
    >>> torch.equal(unflatten(lay, flat)["w"], torch.ones(3, 2))
    True
    >>> torch.equal(unshard(lay, shard(lay, flat)), flat)
    True
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace

import torch
from torch import Tensor, nn

from .units import ROOT_UNIT, Auto, BySize, unit_policy

__all__ = [
    "Layout",
    "Leaf",
    "TensorSpec",
    "Unit",
    "flatten",
    "from_module",
    "make_layout",
    "shard",
    "to_rank_major",
    "to_unit_major",
    "unflatten",
    "unshard",
]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The `torch.dtype` named by a layout's dtype string (``"float32"`` -> ``torch.float32``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in layout")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of a tensor carried unsharded (a buffer); `persistent`: whether the module's
    `state_dict()` holds it (False for buffers registered with `persistent=False`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    persistent: bool = True


@dataclass(frozen=True)
class Leaf:
    """A trainable parameter's place in the full buffer: elements `[offset, offset + numel)`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    unit: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    """A group of leaves gathered together: full slice `[start, start + size)`, shard slice
    `[shard_start, shard_start + size // world)`; `numel <= size` elements are real, the rest padding."""

    name: str
    start: int
    numel: int
    size: int
    shard_start: int


@dataclass(frozen=True)
class Layout:
    """The static map from named parameters to flat buffers and shards (see the module docstring).

    Attributes:
      world, align, dtype: ranks sharded over, the padding quantum per rank, the flat buffer's dtype.
      leaves, units: the trainable parameters' places, and the units they are gathered in.
      frozen_layout: the frozen parameters' flat buffer, with the same units (None: no frozen parameter).
      buffers: the module's buffers, carried unsharded.
      aliases: `(alias, name)` for every further name of a tied parameter (trainable or frozen).
      axis: the mesh axis the buffers are sharded over (`world` is its size; None: every rank of the mesh); a
        hybrid chain's sharding axis (docs/hybrid.md).
    """

    world: int
    align: int
    dtype: str
    leaves: tuple[Leaf, ...]
    units: tuple[Unit, ...]
    frozen_layout: Layout | None = None
    buffers: tuple[TensorSpec, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    axis: str | None = None
    numel: int = field(init=False)
    shard_numel: int = field(init=False)

    def __post_init__(self) -> None:
        numel = sum(u.size for u in self.units)
        object.__setattr__(self, "numel", numel)
        object.__setattr__(self, "shard_numel", numel // self.world)

    @property
    def real_numel(self) -> int:
        """Number of trainable elements, padding excluded (the Ψ of the ZeRO paper)."""
        return sum(u.numel for u in self.units)

    def on_axis(self, axis: str | None) -> Layout:
        """This layout (and its frozen layout) marked as sharded over the mesh axis `axis`."""
        frozen = None if self.frozen_layout is None else self.frozen_layout.on_axis(axis)
        return replace(self, axis=axis, frozen_layout=frozen)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def frozen(self) -> tuple[TensorSpec, ...]:
        """The frozen parameters' names, shapes and dtypes, in layout order."""
        if self.frozen_layout is None:
            return ()
        return tuple(TensorSpec(x.name, x.shape, x.dtype) for x in self.frozen_layout.leaves)

    def is_full(self, x: Tensor) -> bool:
        """Whether a per-rank buffer of this layout (last dimension) is full rather than this rank's shard; at
        world 1 the two are the same and this is True."""
        return x.shape[-1] == self.numel

    def unit_slice(self, unit: int) -> slice:
        """The unit's elements in the full buffer."""
        u = self.units[unit]
        return slice(u.start, u.start + u.size)

    def unit_shard_slice(self, unit: int) -> slice:
        """The unit's elements in every rank's shard."""
        u = self.units[unit]
        return slice(u.shard_start, u.shard_start + u.size // self.world)

    def padding_mask(self) -> Tensor:
        """Boolean `[numel]` mask, True on padding elements (to exclude them from norms and statistics)."""
        mask = torch.ones(self.numel, dtype=torch.bool)
        for leaf in self.leaves:
            mask[leaf.offset : leaf.offset + leaf.numel] = False
        return mask

    def to_json(self) -> str:
        """Serialise to a JSON string; `Layout.from_json` inverts it exactly."""
        return json.dumps(self._data(), sort_keys=True)

    def _data(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "frozen_layout"}
        if data["axis"] is None:  # a 1-D layout's JSON is what it was before named axes
            del data["axis"]
        data = json.loads(json.dumps({k: _plain(v) for k, v in data.items()}))
        data["frozen_layout"] = None if self.frozen_layout is None else self.frozen_layout._data()
        return data

    @staticmethod
    def from_json(text: str | dict) -> Layout:
        """The layout `to_json` wrote (also the layouts of checkpoints saved before frozen parameters had a flat
        buffer of their own: their frozen parameters are laid out in the root unit)."""
        data = json.loads(text) if isinstance(text, str) else text
        units = tuple(Unit(**x) for x in data["units"])
        frozen = data.get("frozen_layout")
        if frozen is not None:
            frozen_layout = Layout.from_json(frozen)
        elif data.get("frozen"):  # the first format: frozen parameters as a list of specs
            frozen_layout = make_layout(
                [(x["name"], tuple(x["shape"]), dtype_of(x["dtype"])) for x in data["frozen"]],
                world=data["world"], align=data["align"], unit_names=[u.name for u in units],
            )  # fmt: skip
        else:
            frozen_layout = None
        return Layout(
            world=data["world"],
            align=data["align"],
            dtype=data["dtype"],
            leaves=tuple(Leaf(**{**x, "shape": tuple(x["shape"])}) for x in data["leaves"]),
            units=units,
            frozen_layout=frozen_layout,
            buffers=tuple(
                TensorSpec(x["name"], tuple(x["shape"]), x["dtype"], x.get("persistent", True)) for x in data["buffers"]
            ),
            aliases=tuple((a, b) for a, b in data["aliases"]),
            axis=data.get("axis"),
        )


def _plain(value: object) -> object:
    """Dataclasses and tuples as JSON-ready dicts and lists."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def make_layout(
    params: Sequence[tuple[str, Sequence[int], torch.dtype]],
    *,
    world: int,
    align: int = 16,
    unit_of: Callable[[str], str] | None = None,
    dtype: torch.dtype | None = None,
    unit_names: Sequence[str] | None = None,
    frozen_layout: Layout | None = None,
    buffers: Iterable[TensorSpec] = (),
    aliases: Iterable[tuple[str, str]] = (),
    what: str = "parameters",
) -> Layout:
    """Lay out named parameters.

    Args:
      params: `(name, shape, dtype)` in the model's `named_parameters()` order; this order is kept.
      world: number of ranks the buffer is sharded over.
      align: every parameter starts at a multiple of `align` elements and each unit is padded to a multiple of
        `world * align`, so parameters and every rank's shard of every unit start `align`-aligned.
      unit_of: maps a parameter name to its unit's name; default: a single unit.
      dtype: dtype of the flat buffer; default: the parameters' common dtype.
      unit_names: the units, in order (every unit `unit_of` names must be among them); a unit without parameters
        here is one padding quantum. Default: the units in order of first appearance.
      frozen_layout, buffers, aliases: carried along unchanged (see `from_module`).
      what: what the parameters are, for error messages.

    Returns:
      The `Layout`.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    if not params:
        raise ValueError("cannot lay out an empty parameter list: the model has no trainable parameters")
    if dtype is None:
        dtypes = {d for _, _, d in params}
        if len(dtypes) > 1:
            found = ", ".join(f"{n}: {d}" for n, _, d in params[:8])
            raise TypeError(
                f"{what} have mixed dtypes ({found}, ...); cast the model to one dtype "
                "(e.g. model.float()) or pass dtype= to choose the flat buffer's dtype"
            )
        dtype = next(iter(dtypes))
    unit_of = unit_of or (lambda name: ROOT_UNIT)
    order: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]] = {name: [] for name in unit_names or ()}
    for name, shape, dt in params:
        unit = unit_of(name)
        if unit_names is not None and unit not in order:
            raise ValueError(f"parameter {name!r} belongs to unit {unit!r}, which is not among the units given")
        order.setdefault(unit, []).append((name, tuple(int(s) for s in shape), dt))
    quantum = world * align
    leaves: list[Leaf] = []
    units: list[Unit] = []
    start = shard_start = 0
    for index, (unit_name, members) in enumerate(order.items()):
        offset, numel = start, 0
        for name, shape, dt in members:
            leaves.append(Leaf(name, shape, _dtype_name(dt), index, offset))
            n = math.prod(shape)
            numel += n
            # Every parameter starts `align`-aligned, like a fresh allocation: BLAS kernels pick code paths by
            # pointer alignment, so this keeps gradients bitwise those of the unflattened model.
            offset += -(-n // align) * align
        size = max(quantum, -(-(offset - start) // quantum) * quantum)
        units.append(Unit(unit_name, start, numel, size, shard_start))
        start += size
        shard_start += size // world
    return Layout(
        world=world,
        align=align,
        dtype=_dtype_name(dtype),
        leaves=tuple(leaves),
        units=tuple(units),
        frozen_layout=frozen_layout,
        buffers=tuple(buffers),
        aliases=tuple(aliases),
    )


def from_module(
    model: nn.Module,
    *,
    world: int,
    align: int = 16,
    units: str | BySize | Auto | Callable[[str], str] | None = None,
    dtype: torch.dtype | None = None,
) -> Layout:
    """Lay out a module's parameters; works on a `meta`-device model (only shapes and dtypes are read).

    Trainable parameters go into the flat buffer in `named_parameters()` order, frozen parameters into the frozen
    layout's, with the same units; tied parameters are recorded as aliases of their first name; buffers are
    recorded for the state to carry, persistent or not.

    Args:
      model: the module.
      world, align, dtype: see `make_layout`.
      units: how parameters group into units (`fzero.layout.units`): None (`Auto()`: each child of an
        `nn.ModuleList` and each untied module outside it of 100,000 elements or more, or module by module where
        that would leave one unit holding most of the model),
        `"module_list"`, `BySize(n)` (module subtrees of at least `n` elements), `"single"`, `"param"` (one unit
        per parameter), or a callable from a parameter's name to its unit's name.

    Raises:
      TypeError: a parameter is not floating point (integer data belongs in a buffer), or the trainable (or the
        frozen) parameters have mixed dtypes.
      ValueError: the model has no trainable parameters, or a parameter was partitioned by DeepSpeed itself.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    trainable: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    frozen: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    canonical: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases.append((name, canonical[id(p)]))
            continue
        canonical[id(p)] = name
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {name!r} has dtype {p.dtype}; fzero trains floating-point parameters only. "
                "Integer or boolean data belongs in a buffer (module.register_buffer)."
            )
        if hasattr(p, "ds_tensor") and callable(getattr(p, "all_gather", None)):
            raise ValueError(
                f"parameter {name!r} was partitioned by DeepSpeed itself (built under the deepspeed package's "
                "zero.Init, as transformers' HfDeepSpeedConfig or from_pretrained at ZeRO-3 does when deepspeed is "
                "installed): it holds an empty stand-in, and its values are in DeepSpeed's partitions, which fzero "
                "does not read. Build the model normally or under fzero.deepspeed.zero.Init"
            )
        (trainable if p.requires_grad else frozen).append((name, tuple(p.shape), p.dtype))
    if not trainable:
        what = "frozen parameters only" if frozen else "no parameters"
        raise ValueError(f"{type(model).__name__} has {what}: there is nothing to train")
    unit_of = unit_policy(model, units)
    unit_names = list(dict.fromkeys(unit_of(name) for name, p in model.named_parameters()))
    frozen_layout = None
    if frozen:
        frozen_layout = make_layout(
            frozen, world=world, align=align, unit_of=unit_of, unit_names=unit_names, what="frozen parameters"
        )
    buffers = [
        TensorSpec(n, tuple(b.shape), _dtype_name(b.dtype), _persistent(model, n)) for n, b in model.named_buffers()
    ]
    return make_layout(
        trainable,
        world=world,
        align=align,
        unit_of=unit_of,
        dtype=dtype,
        unit_names=unit_names,
        frozen_layout=frozen_layout,
        buffers=buffers,
        aliases=aliases,
        what="trainable parameters",
    )


def _persistent(model: nn.Module, name: str) -> bool:
    """Whether buffer `name` is in `model.state_dict()` (not registered with `persistent=False`)."""
    owner, _, short = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return short not in module._non_persistent_buffers_set


def flatten(layout: Layout, tensors: Mapping[str, Tensor]) -> Tensor:
    """Copy named tensors into a new full buffer (`[numel]`, `layout.dtype`, zero padding).

    Raises:
      KeyError: a trainable parameter of the layout is missing from `tensors`.
      ValueError: a tensor's shape differs from the layout's.
    """
    first = next(iter(tensors.values()), None)
    device = first.device if first is not None else None
    flat = torch.zeros(layout.numel, dtype=layout.torch_dtype, device=device)
    for leaf in layout.leaves:
        if leaf.name not in tensors:
            raise KeyError(f"parameter {leaf.name!r} of the layout is missing from the tensors given")
        t = tensors[leaf.name]
        if tuple(t.shape) != leaf.shape:
            raise ValueError(f"parameter {leaf.name!r} has shape {tuple(t.shape)}, the layout expects {leaf.shape}")
        flat[leaf.offset : leaf.offset + leaf.numel].copy_(t.detach().reshape(-1))
    return flat


@functools.lru_cache(maxsize=64)
def _pieces(leaves: tuple[Leaf, ...], start: int, end: int) -> tuple[tuple[int, ...], tuple[Leaf | None, ...]]:
    """Split sizes covering elements `[start, end)` of the full buffer, and the leaf (or None for padding) each
    piece is."""
    sizes: list[int] = []
    owners: list[Leaf | None] = []
    pos = start
    for leaf in sorted(leaves, key=lambda x: x.offset):
        if leaf.offset > pos:
            sizes.append(leaf.offset - pos)
            owners.append(None)
        sizes.append(leaf.numel)
        owners.append(leaf)
        pos = leaf.offset + leaf.numel
    if end > pos:
        sizes.append(end - pos)
        owners.append(None)
    return tuple(sizes), tuple(owners)


def _split_views(flat: Tensor, leaves: tuple[Leaf, ...], start: int) -> dict[str, Tensor]:
    """One `split` of `flat` (elements `[start, start + len(flat))` of the full buffer) into the leaves' views:
    its backward writes every gradient into one new buffer, where slicing each parameter separately would make
    autograd sum one buffer-sized gradient per parameter."""
    sizes, owners = _pieces(leaves, start, start + flat.shape[0])
    return {leaf.name: p.view(leaf.shape) for p, leaf in zip(flat.split(sizes), owners, strict=True) if leaf}


def unflatten(layout: Layout, flat: Tensor) -> dict[str, Tensor]:
    """Views of a full buffer (`[numel]`) as named tensors of the layout's shapes (no copy), aliases included
    (one `split`: see `_split_views`)."""
    if flat.shape != (layout.numel,):
        raise ValueError(f"expected a full buffer of shape ({layout.numel},), got {tuple(flat.shape)}")
    out = _split_views(flat, layout.leaves, 0)
    out = {leaf.name: out[leaf.name] for leaf in layout.leaves}  # the layout's order
    for alias, name in layout.aliases:
        if name in out:
            out[alias] = out[name]
    return out


def unit_views(layout: Layout, unit: int, flat: Tensor) -> dict[str, Tensor]:
    """Views of one unit's full buffer (`[unit size]`) as the named tensors of its parameters (one `split`)."""
    u = layout.units[unit]
    if flat.shape != (u.size,):
        raise ValueError(f"expected unit {u.name!r}'s full buffer of shape ({u.size},), got {tuple(flat.shape)}")
    return _split_views(flat, tuple(leaf for leaf in layout.leaves if leaf.unit == unit), u.start)


def unit_pieces(layout: Layout, unit: int) -> tuple[tuple[int, ...], tuple[Leaf | None, ...]]:
    """The consecutive pieces of one unit's full buffer: their sizes, and the leaf each is (None: padding)."""
    u = layout.units[unit]
    return _pieces(tuple(leaf for leaf in layout.leaves if leaf.unit == unit), u.start, u.start + u.size)


def _check_last(layout: Layout, x: Tensor, what: str) -> None:
    if x.shape[-1:] != (layout.numel,):
        raise ValueError(f"{what}: expected a last dimension of {layout.numel}, got shape {tuple(x.shape)}")


def to_rank_major(layout: Layout, x: Tensor) -> Tensor:
    """Permute the last dimension from unit-major to rank-major (`x` itself when there is one unit or one rank:
    the two orders are then the same)."""
    _check_last(layout, x, "to_rank_major")
    lead, w = x.shape[:-1], layout.world
    if len(layout.units) == 1 or w == 1:
        return x
    parts = [x[..., layout.unit_slice(i)].unflatten(-1, (w, -1)) for i in range(len(layout.units))]
    return torch.cat(parts, dim=-1).reshape(*lead, layout.numel)


def to_unit_major(layout: Layout, x: Tensor) -> Tensor:
    """Inverse of `to_rank_major`."""
    _check_last(layout, x, "to_unit_major")
    lead, w = x.shape[:-1], layout.world
    if len(layout.units) == 1 or w == 1:
        return x
    by_rank = x.unflatten(-1, (w, layout.shard_numel))
    parts = [by_rank[..., layout.unit_shard_slice(i)].flatten(-2) for i in range(len(layout.units))]
    return torch.cat(parts, dim=-1).reshape(*lead, layout.numel)


def shard(layout: Layout, flat: Tensor) -> Tensor:
    """All ranks' shards of a full buffer: `[numel] -> [world, shard_numel]`."""
    return to_rank_major(layout, flat).view(layout.world, layout.shard_numel)


def unshard(layout: Layout, shards: Tensor) -> Tensor:
    """Inverse of `shard`: `[world, shard_numel] -> [numel]`."""
    if shards.shape != (layout.world, layout.shard_numel):
        raise ValueError(f"expected shards of shape ({layout.world}, {layout.shard_numel}), got {tuple(shards.shape)}")
    return to_unit_major(layout, shards.reshape(layout.numel))

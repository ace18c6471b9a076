"""`consolidate`: a checkpoint's parameters as one plain state_dict, from any world size and stage.

No conversion step, no separate script: the master parameters are put back together from the ranks' shard files
unit by unit, cut into named tensors, and joined by the frozen parameters and the buffers (rank 0's), with tied
parameters under every name: what `model.load_state_dict` accepts. `write_consolidated` streams the same tensors
into one safetensors file, holding one unit (and the tensor being written) at a time; `iter_consolidated` streams
them to the caller, and `Consolidated` reads them by name in any order (one unit held at a time, for writers that
lay tensors out in another order than the checkpoint's, such as `fzero.interop.export_hf`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from ..layout import Layout, dtype_of
from .atomic import fsync_dir
from .errors import CorruptCheckpointError
from .reader import Checkpoint
from .safetensors_io import TensorSpec, write_safetensors
from .sources import unit

__all__ = ["Consolidated", "consolidate", "iter_consolidated", "write_consolidated"]


def _cast(dtype: torch.dtype | None, saved: torch.dtype) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


Plan = tuple[dict[str, tuple[str, torch.dtype]], list[TensorSpec], list[tuple[str, str]]]


def _plan(ckpt: Checkpoint, dtype: torch.dtype | None) -> Plan:
    """The param-space leaves to stream (`{space: (key, dtype)}`), the output tensors in order (parameters in
    layout order, aliases after their parameter, then frozen parameters likewise, then persistent buffers), and
    where each comes from: `("stream", space)` or `("value", key)` (a replicated leaf, read whole)."""
    m, lay = ckpt.manifest, ckpt.layout
    key = m.roles.get("params") or "params"
    entry = ckpt.entries.get(key)
    if entry is None or entry.kind == "replicated":
        raise CorruptCheckpointError(f"{ckpt.path}: the manifest names no master parameters (leaf {key!r})")
    if entry.lead:
        raise CorruptCheckpointError(f"{ckpt.path}: master parameters {key!r} have leading dimensions {entry.lead}")
    aliases: dict[str, list[str]] = {}
    for alias, name in lay.aliases:
        aliases.setdefault(name, []).append(alias)
    streams = {"params": (key, dtype or dtype_of(entry.dtype))}
    specs: list[TensorSpec] = []
    origins: list[tuple[str, str]] = []

    def add(name: str, dt: torch.dtype, shape: tuple[int, ...], origin: tuple[str, str]) -> None:
        for n in (name, *aliases.get(name, ())):
            specs.append(TensorSpec(n, dt, shape))
            origins.append(origin)

    for leaf in lay.leaves:
        add(leaf.name, streams["params"][1], leaf.shape, ("stream", "params"))
    frozen = m.roles.get("frozen")
    if isinstance(frozen, str):  # one flat leaf
        fentry = ckpt.entries[frozen]
        if fentry.kind == "replicated" or fentry.space != "frozen" or fentry.lead:
            raise CorruptCheckpointError(f"{ckpt.path}: frozen parameters {frozen!r} are not a flat frozen buffer")
        streams["frozen"] = (frozen, _cast(dtype, dtype_of(fentry.dtype)))
        for leaf in lay.frozen_layout.leaves if lay.frozen_layout is not None else ():
            add(leaf.name, streams["frozen"][1], leaf.shape, ("stream", "frozen"))
    elif lay.frozen:  # a checkpoint written before: one replicated leaf per frozen parameter
        for s in lay.frozen:
            leaf_key = (frozen or {}).get(s.name)
            if leaf_key is None or leaf_key not in ckpt.entries:
                raise CorruptCheckpointError(f"{ckpt.path}: the manifest has no leaf for frozen parameter {s.name!r}")
            add(s.name, _cast(dtype, dtype_of(s.dtype)), tuple(s.shape), ("value", leaf_key))
    for s in lay.buffers:
        if not s.persistent:  # not in the model's state_dict()
            continue
        leaf_key = m.roles.get("buffers", {}).get(s.name)
        if leaf_key is None or leaf_key not in ckpt.entries:
            raise CorruptCheckpointError(f"{ckpt.path}: the manifest has no leaf for buffer {s.name!r}")
        add(s.name, _cast(dtype, dtype_of(s.dtype)), tuple(s.shape), ("value", leaf_key))
    return streams, specs, origins


class Consolidated:
    """A checkpoint's consolidated tensors (`consolidate`'s), read by name in any order, one unit in memory at a
    time.

    A parameter is cut out of its unit, which stays cached until a parameter of another unit is asked for: read in
    the checkpoint's order (`specs`), every unit is read once; in another order a unit may be read again (more
    reading, never more memory).

    Args:
      ckpt: an open checkpoint (the caller closes it).
      dtype: cast floating tensors to it; default: as saved.

    Attributes:
      specs: every tensor's name, dtype and shape, in `consolidate`'s order (parameters in layout order, aliases
        after their parameter, frozen parameters likewise, then persistent buffers).
      aliases: `{alias: name}` for tied parameters: both names give the same values.
    """

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype | None = None) -> None:
        self.ckpt = ckpt
        streams, self.specs, origins = _plan(ckpt, dtype)
        self.aliases: dict[str, str] = dict(ckpt.layout.aliases)
        self._spec = {s.name: s for s in self.specs}
        self._value = {s.name: where for s, (how, where) in zip(self.specs, origins, strict=True) if how == "value"}
        # a streamed parameter: its space's leaf key and layout, and where in which unit it lies
        self._spaces: dict[str, tuple[str, Layout]] = {}
        self._where: dict[str, tuple[str, int, int, int]] = {}
        for space, (key, _) in streams.items():
            lay = ckpt.entries[key].layout_in(ckpt.layout)
            self._spaces[space] = (key, lay)
            for leaf in lay.leaves:
                self._where[leaf.name] = (space, leaf.unit, leaf.offset - lay.units[leaf.unit].start, leaf.numel)
        self._cached: tuple[str, int] | None = None
        self._unit: Tensor | None = None

    def spec(self, name: str) -> TensorSpec:
        """The name, dtype and shape of tensor `name`.

        Raises:
          KeyError: the checkpoint has no such tensor.
        """
        try:
            return self._spec[name]
        except KeyError:
            raise KeyError(f"{self.ckpt.path}: no tensor {name!r} in the consolidated checkpoint") from None

    def tensor(self, name: str, *, copy: bool = True) -> Tensor:
        """Tensor `name` (a parameter, alias, frozen parameter or persistent buffer), of `spec(name)`'s dtype.

        Args:
          name: as in `specs`.
          copy: with False, a parameter that needs no cast comes as a view of its cached unit (no copy; it keeps
            the unit's memory alive while held: for streaming it out). Buffers are always new tensors.

        Raises:
          KeyError: the checkpoint has no such tensor.
        """
        spec = self.spec(name)
        if name in self._value:
            t = self.ckpt.value(self._value[name])
            return t.to(spec.dtype) if t.dtype != spec.dtype else t
        space, index, start, numel = self._where[self.aliases.get(name, name)]
        if self._cached != (space, index):
            self._cached = self._unit = None  # free the last unit before reading the next
            key, _ = self._spaces[space]
            self._unit, self._cached = unit(self.ckpt, key, index), (space, index)
        assert self._unit is not None  # read just above
        t = self._unit[start : start + numel].reshape(spec.shape)
        if t.dtype != spec.dtype:
            return t.to(spec.dtype)
        return t.clone() if copy else t

    def release(self) -> None:
        """Drop the cached unit (views handed out keep their own reference)."""
        self._cached = self._unit = None


def iter_consolidated(
    directory: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    copy: bool = True,
) -> Iterator[tuple[str, Tensor]]:
    """`consolidate`'s tensors one at a time, `(name, tensor)` in its order, holding one unit at a time.

    Args:
      directory: a checkpoint directory, or a root (its ``latest``, or `tag`).
      tag: which checkpoint of the root.
      dtype: cast floating tensors to it; default: as saved.
      verify: check the files' checksums first (before the first tensor is yielded).
      copy: with False, parameters come as views of the unit being read (see `Consolidated.tensor`).

    Returns:
      An iterator; the checkpoint's files stay open until it is exhausted or closed.
    """
    with Checkpoint(directory, tag, verify=verify) as ckpt:
        reader = Consolidated(ckpt, dtype)
        for spec in reader.specs:
            yield spec.name, reader.tensor(spec.name, copy=copy)


def consolidate(
    directory: str | os.PathLike[str], *, tag: str | None = None, dtype: torch.dtype | None = None, verify: bool = True
) -> dict[str, Tensor]:
    """The checkpoint's consolidated parameters, frozen parameters and buffers, by name.

    Args:
      directory: a checkpoint directory, or a root (its ``latest``, or `tag`).
      tag: which checkpoint of the root.
      dtype: cast floating tensors to it (e.g. `torch.bfloat16`); default: as saved (the master dtype, float32
        under mixed precision).
      verify: check the files' checksums first.

    Returns:
      `{name: tensor}` for `model.load_state_dict`; tied parameters appear under every name (one tensor).
    """
    with Checkpoint(directory, tag, verify=verify) as ckpt:
        reader = Consolidated(ckpt, dtype)
        out: dict[str, Tensor] = {}
        for spec in reader.specs:
            base = reader.aliases.get(spec.name)
            out[spec.name] = out[base] if base in out else reader.tensor(spec.name)
        return out


def write_consolidated(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> Path:
    """Write `consolidate`'s tensors into one safetensors file, streaming (one unit in memory at a time).

    The file appears atomically (written beside `out`, flushed, renamed). Tied parameters are stored under every
    name (each a copy: safetensors has no aliasing), so `load_file(out)` feeds `model.load_state_dict` directly.

    Returns:
      The path written.
    """
    out = Path(out)
    with Checkpoint(directory, tag, verify=verify) as ckpt:
        reader = Consolidated(ckpt, dtype)
        specs = reader.specs
        meta = {"format": "pt", "fzero.tag": ckpt.manifest.tag, "fzero.step": str(ckpt.manifest.step)}
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        try:
            write_safetensors(tmp, specs, lambda i: reader.tensor(specs[i].name, copy=False), meta)
            os.replace(tmp, out)
        finally:
            reader.release()
            if tmp.exists():
                tmp.unlink()
    fsync_dir(out.parent if str(out.parent) else ".")
    return out

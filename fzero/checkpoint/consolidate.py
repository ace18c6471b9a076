"""`consolidate`: a checkpoint's parameters as one plain state_dict, from any world size and stage.

No conversion step, no separate script: the master parameters are put back together from the ranks' shard files
unit by unit, cut into named tensors, and joined by the frozen parameters and the buffers (rank 0's), with tied
parameters under every name: what `model.load_state_dict` accepts. `write_consolidated` streams the same tensors
into one safetensors file, holding one unit (and the tensor being written) at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..layout import dtype_of
from .atomic import fsync_dir
from .errors import CorruptCheckpointError
from .reader import Checkpoint
from .safetensors_io import TensorSpec, write_safetensors

__all__ = ["consolidate", "write_consolidated"]


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


def _producer(
    ckpt: Checkpoint, dtype: torch.dtype | None, copy: bool = True
) -> tuple[list[TensorSpec], Callable[[int], Tensor]]:
    """The output tensors and `produce(i)`: replicated tensors in any order; each space's parameters (one dtype
    per space, so the writer's dtype ordering keeps them in layout order) streamed unit by unit (views of the unit
    unless `copy`)."""
    streams, specs, origins = _plan(ckpt, dtype)
    flows = {space: ckpt.named(key, dt, copy=copy) for space, (key, dt) in streams.items()}

    def produce(i: int) -> Tensor:
        spec, (how, where) = specs[i], origins[i]
        if how == "value":
            t = ckpt.value(where)
            return t.to(spec.dtype) if t.dtype != spec.dtype else t
        name, t = next(flows[where])
        if name != spec.name:  # cannot happen: both follow the layout's order
            raise RuntimeError(f"consolidate: expected parameter {spec.name!r}, the stream gave {name!r}")
        return t

    return specs, produce


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
        specs, produce = _producer(ckpt, dtype)
        return {s.name: produce(i) for i, s in enumerate(specs)}


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
        specs, produce = _producer(ckpt, dtype, copy=False)
        meta = {"format": "pt", "fzero.tag": ckpt.manifest.tag, "fzero.step": str(ckpt.manifest.step)}
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        try:
            write_safetensors(tmp, specs, produce, meta)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
    fsync_dir(out.parent if str(out.parent) else ".")
    return out

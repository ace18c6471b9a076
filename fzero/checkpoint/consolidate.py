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


def _plan(ckpt: Checkpoint, dtype: torch.dtype | None) -> tuple[str, list[TensorSpec], dict[str, tuple[str, str]]]:
    """The master-parameter leaf's key, the output tensors in order (parameters in layout order, aliases after
    their parameter, then frozen parameters and buffers), and where each non-parameter tensor comes from."""
    m, lay = ckpt.manifest, ckpt.layout
    key = m.roles.get("params") or "params"
    entry = ckpt.entries.get(key)
    if entry is None or entry.kind == "replicated":
        raise CorruptCheckpointError(f"{ckpt.path}: the manifest names no master parameters (leaf {key!r})")
    if entry.lead:
        raise CorruptCheckpointError(f"{ckpt.path}: master parameters {key!r} have leading dimensions {entry.lead}")
    pdtype = dtype or dtype_of(entry.dtype)
    aliases: dict[str, list[str]] = {}
    for alias, name in lay.aliases:
        aliases.setdefault(name, []).append(alias)
    specs: list[TensorSpec] = []
    for leaf in lay.leaves:
        for name in (leaf.name, *aliases.get(leaf.name, ())):
            specs.append(TensorSpec(name, pdtype, leaf.shape))
    sources: dict[str, tuple[str, str]] = {}
    for role, spec_list in (("frozen", lay.frozen), ("buffers", lay.buffers)):
        for s in spec_list:
            leaf_key = m.roles.get(role, {}).get(s.name)
            if leaf_key is None or leaf_key not in ckpt.entries:
                raise CorruptCheckpointError(f"{ckpt.path}: the manifest has no leaf for {role[:-1]} {s.name!r}")
            for name in (s.name, *aliases.get(s.name, ())):
                specs.append(TensorSpec(name, _cast(dtype, dtype_of(s.dtype)), tuple(s.shape)))
                sources[name] = (leaf_key, s.name)
    return key, specs, sources


def _producer(
    ckpt: Checkpoint, dtype: torch.dtype | None, copy: bool = True
) -> tuple[list[TensorSpec], Callable[[int], Tensor]]:
    """The output tensors and `produce(i)`: non-parameter tensors in any order; parameters (one dtype, so the
    writer's dtype ordering keeps them in layout order) streamed unit by unit (views of the unit unless `copy`)."""
    key, specs, sources = _plan(ckpt, dtype)
    params = ckpt.named(key, dtype, copy=copy)

    def produce(i: int) -> Tensor:
        spec = specs[i]
        if spec.name in sources:
            t = ckpt.value(sources[spec.name][0])
            return t.to(spec.dtype) if t.dtype != spec.dtype else t
        name, t = next(params)
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

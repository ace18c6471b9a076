"""Sharded checkpoints: safe (safetensors and JSON, never pickle), atomic, checksummed, resumable at any world size
and stage, and consolidated without a conversion step.

    path = fzero.save(state, "ckpts", data_position=i)              # ckpts/step{N}/, then ckpts/latest -> step{N}
    state, extra = fzero.load("ckpts", like=fzero.init(model, tx, mesh))   # any world size, any stage
    model.load_state_dict(fzero.consolidate("ckpts"))               # a plain state_dict

A checkpoint directory holds one safetensors file per rank (``rank-00000-of-00004.safetensors``: the rank's
shards, and the process's random generator states) and ``manifest.json`` (format version, layout, world size,
step, precision, how each leaf is stored, every file's size and sha256, the data position, user state and
config) with its digest ``manifest.json.sha256``, written last. See ``docs/checkpoints.md``.

May import: `fzero._version`, `fzero.storage`, `fzero.layout`, `fzero.config` (its schema machinery, for the
manifest).
"""

from __future__ import annotations

from typing import Any

import optree

from . import errors
from .atomic import read_latest, resolve
from .background import SaveHandle
from .consolidate import consolidate, write_consolidated
from .errors import *  # noqa: F403  (every error is public: `__all__` takes `errors.__all__`)
from .hybrid import expand_hybrid, hybrid_mesh, shard_group
from .load import load
from .manifest import FORMAT, VERSION, Manifest
from .manifest_schema import read_manifest
from .reader import Checkpoint
from .reshard import build_leaves
from .save import save
from .sources import MemorySource, decide_storage, named
from .tree import PARAM_SPACE, flatten_state

__all__ = [
    "FORMAT",
    "VERSION",
    "Checkpoint",
    "Manifest",
    "SaveHandle",
    "consolidate",
    "load",
    "named_leaves",
    "read_latest",
    "read_manifest",
    "reshard",
    "resolve",
    "save",
    "write_consolidated",
]
__all__ += errors.__all__


def _memory(state: Any) -> MemorySource:
    flat = flatten_state(shard_group(state))
    if not flat.simulated and flat.world > 1:
        raise ValueError("this needs every rank's values: a SimMesh state, or world 1 (save and load a DistMesh one)")
    return MemorySource(flat, decide_storage(flat))


def reshard(state: Any, like: Any, *, strict: bool = True) -> Any:
    """`state` (a `SimMesh` state, or world 1) moved into `like`'s structure, world size and stage, in memory:
    what `load(save(state), like)` gives, without the files."""
    if not getattr(like, "simulated", True) and like.layout.world > 1:
        raise ValueError("reshard targets a SimMesh state or world 1; use save and load for a DistMesh")
    if hybrid_mesh(like) is not None:
        return expand_hybrid(reshard(state, shard_group(like), strict=strict), like)
    flat = flatten_state(like)
    ranks = list(range(flat.world)) if flat.simulated else [0]
    return optree.tree_unflatten(flat.treespec, build_leaves(_memory(state), flat, ranks, strict=strict))


def named_leaves(state: Any) -> dict[str, Any]:
    """Every leaf of a state (a `SimMesh` state, or world 1) in a form independent of world size and stage:
    param-space leaves as `{parameter name: tensor}`, the others as rank 0's value, and leaves whose ranks hold
    different values (local accumulators mid-step, per-rank buffers) as the list of the ranks' values. Two states
    hold the same training state, whatever their meshes and stages, exactly when these are equal."""
    source = _memory(state)
    out: dict[str, Any] = {}
    for key, e in source.entries.items():
        if e.storage == "per_rank":
            out[key] = [source.read(key, r).clone() for r in range(source.layout.world)]
        elif e.kind in PARAM_SPACE:
            out[key] = dict(named(source, key))
        else:
            out[key] = source.read(key, 0).clone()
    return out

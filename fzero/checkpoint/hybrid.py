"""Checkpoints of hybrid-sharded `SimMesh` states: saved as the 1-D state of their first shard group.

A hybrid state (`Layout.axis` set: sharded over a mesh axis of `S` ranks, replicated `R` times) holds `R` equal
copies of a world-`S` sharded state: after every reduction the replicas' shards are the same. So it is saved as
that world-`S` state (rows `0..S-1`, the first shard group, the sharding axis being innermost), with the mesh
recorded in the manifest (`mesh`: `{"axis": name, "replicas": R}`), and any checkpoint loads into a hybrid state
by loading into that world-`S` view and copying it to every replica. Resharding between 1-D and 2-D meshes of any
shape is therefore the 1-D resharding between world sizes (`fzero.checkpoint.reshard`).

A leaf whose replicas differ (a local accumulator mid-window, a buffer each rank updates itself) has no world-`S`
form: saving such a state is refused, naming the leaf. `DistMesh` hybrid states are not supported yet.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from ..storage import in_memory

__all__ = ["expand_hybrid", "hybrid_mesh", "shard_group"]


def hybrid_mesh(state: Any) -> dict[str, Any] | None:
    """The manifest's record of a hybrid state's mesh, `{"axis": name, "replicas": R}`; None for a 1-D state."""
    layout = getattr(state, "layout", None)
    if layout is None or layout.axis is None:
        return None
    params: Tensor = state.params
    if not getattr(state, "simulated", False):
        raise ValueError(f"checkpoints of hybrid-sharded DistMesh states (sharded over mesh axis {layout.axis!r}) "
                         "are not supported yet; save fzero.state_dict(state, mesh), or use a SimMesh")  # fmt: skip
    return {"axis": layout.axis, "replicas": params.shape[0] // layout.world}


def shard_group(state: Any) -> Any:
    """A hybrid `SimMesh` state as the 1-D state of its first shard group (world `S`), checking that every replica
    holds the same values.

    Raises:
      ValueError: a leaf's replicas differ (it names the leaf).
    """
    info = hybrid_mesh(state)
    if info is None:
        return state
    layout = state.layout
    S, W = layout.world, state.params.shape[0]

    def rows(path: tuple, t: Tensor) -> Tensor:
        t = in_memory(t)  # (an offloaded leaf: its rows are compared and kept in memory)
        if t.ndim == 0 or t.shape[0] != W:
            return t
        first = t[:S]
        for i in range(1, W // S):
            if not torch.equal(first, t[i * S : (i + 1) * S]):
                where = "state" + "".join(f"[{p!r}]" for p in path)
                raise ValueError(f"{where} differs between the replicas of this hybrid state (a local accumulator "
                                 "mid-window, or a buffer each rank updates itself), so it has no form sharded over "
                                 f"{layout.axis!r} alone; save at an optimizer step's boundary")  # fmt: skip
        return first

    out: Any = optree.tree_map_with_path(rows, state, namespace="fzero", none_is_leaf=False)
    return out.replace(layout=layout.on_axis(None))


def expand_hybrid(loaded: Any, like: Any) -> Any:
    """The world-`S` state `loaded` (loaded into `shard_group(like)`) copied to every replica of the hybrid `like`."""
    S, W = like.layout.world, like.params.shape[0]
    index = torch.arange(W) % S  # rank r holds shard r % S (the sharding axis is innermost)

    def expand(target: Tensor, value: Tensor) -> Tensor:
        if target.ndim >= 1 and target.shape[0] == W and value.ndim == target.ndim and value.shape[0] == S:
            return value[index]
        return value

    targets, spec = optree.tree_flatten(like, namespace="fzero", none_is_leaf=False)
    values = optree.tree_leaves(loaded, namespace="fzero", none_is_leaf=False)  # the same structure, world S
    return optree.tree_unflatten(spec, [expand(t, v) for t, v in zip(targets, values, strict=True)])

"""Checkpoints of hybrid-sharded states (`SimMesh` and `DistMesh`): saved as the 1-D state of their first shard group.

A hybrid state (`Layout.axis` set: sharded over a mesh axis of `S` ranks, replicated `R` times) holds `R` equal
copies of a world-`S` sharded state: after every reduction the replicas' shards are the same. So it is saved as
that world-`S` state, with the mesh recorded in the manifest (`mesh`: `{"axis": name, "replicas": R}`), and any
checkpoint loads into a hybrid state by loading into that world-`S` view and giving it to every replica. Resharding
between 1-D and 2-D meshes of any shape is therefore the 1-D resharding between world sizes
(`fzero.checkpoint.reshard`). The sharding axis is the mesh's innermost, so rank `r` is shard rank `r % S` of
replica `r // S`:

- on a `SimMesh` the first shard group is rows `0..S-1`; a load fills them and copies them to every replica
  (`expand_hybrid`);
- on a `DistMesh` (pass its `mesh` to `save` and `load`) the ranks of replica 0, ranks `0..S-1`, write the files a
  1-D `DistMesh` of `S` processes would; the other replicas write nothing but take part in every agreement of the
  save (`GroupCoordinator`), so a failure on any rank is raised on all of them. A load gives every replica its
  shard rank's part (each replica reads the files it needs). The process generators saved are those of ranks
  `0..S-1`: with `restore_rng`, rank `r` restores saved process `r % processes`'s, so the replicas beyond the first
  get their shard rank's (fzero's own random stream, the state's `seed`, is in the state and unaffected).

A leaf whose replicas differ (a local accumulator mid-window, a buffer each rank updates itself) has no world-`S`
form: saving such a state is refused, naming the leaf, before anything is written. On a `DistMesh` the replicas
compare a checksum per leaf rather than the values: a sha256 of each in-memory leaf (one pass over the state, as
the save's own file checksums), the block crc32s an offloaded leaf already carries, all exchanged in one all-gather
of 32 bytes per leaf and rank; every rank sees every checksum, so all of them refuse together.
"""

from __future__ import annotations

import hashlib
from typing import Any

import optree
import torch
from torch import Tensor

from ..storage import Offloaded, in_memory
from .coord import Coordinator
from .safetensors_io import tensor_sha256

__all__ = ["GroupCoordinator", "expand_hybrid", "hybrid_mesh", "shard_group"]


def _check_mesh(state: Any, mesh: Any) -> None:
    """That `mesh` is the `DistMesh` the hybrid `state` was built on (its sharding axis innermost, of its size)."""
    layout = state.layout
    if mesh is None or len(mesh.local_ranks) != 1:
        raise TypeError(f"a hybrid-sharded DistMesh state (sharded over mesh axis {layout.axis!r}) is checkpointed "
                        f"by fzero.save and fzero.load with its mesh: pass mesh=fzero.DistMesh(shape=...), got "
                        f"{mesh!r}")  # fmt: skip
    axes = tuple(getattr(mesh, "axes", ()))
    if not axes or axes[-1] != layout.axis or mesh.size(layout.axis) != layout.world:
        raise ValueError(f"the state is sharded over {layout.world} ranks of mesh axis {layout.axis!r}, the "
                         f"innermost, but the mesh is {mesh!r}")  # fmt: skip


def hybrid_mesh(state: Any, mesh: Any = None) -> dict[str, Any] | None:
    """The manifest's record of a hybrid state's mesh, `{"axis": name, "replicas": R}`; None for a 1-D state.

    Args:
      state: a `TrainState` (all ranks of a `SimMesh`, or this rank's of a `DistMesh`).
      mesh: a `DistMesh` state's mesh (its replica count is the mesh's); unused for a `SimMesh` state.

    Raises:
      TypeError: a hybrid `DistMesh` state without its mesh.
      ValueError: `mesh` is not the state's (no innermost axis of the state's name and shard count).
    """
    layout = getattr(state, "layout", None)
    if layout is None or layout.axis is None:
        return None
    if getattr(state, "simulated", False):
        return {"axis": layout.axis, "replicas": state.params.shape[0] // layout.world}
    _check_mesh(state, mesh)
    return {"axis": layout.axis, "replicas": mesh.world // layout.world}


def _where(path: tuple) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _differs(where: str, axis: str) -> ValueError:
    return ValueError(f"{where} differs between the replicas of this hybrid state (a local accumulator mid-window, "
                      f"or a buffer each rank updates itself), so it has no form sharded over {axis!r} alone; save "
                      "at an optimizer step's boundary")  # fmt: skip


def _digest(x: Any) -> Tensor:
    """A leaf's checksum, 32 bytes (uint8): the sha256 of an in-memory leaf's bytes; for a leaf offloaded to disk,
    the sha256 of the crc32s of its blocks, which its store keeps (nothing is read)."""
    if isinstance(x, Offloaded):
        raw = hashlib.sha256(repr((str(x.dtype), tuple(x.shape), x.crcs)).encode()).digest()
    else:
        raw = tensor_sha256(x)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _check_replicas(state: Any, mesh: Any) -> None:
    """Raise, on every rank alike, if a leaf of a hybrid `DistMesh` state differs between replicas (naming the
    first such leaf), from one all-gather of every rank's per-leaf checksums."""
    layout = state.layout
    paths, leaves, _ = optree.tree_flatten_with_path(state, namespace="fzero", none_is_leaf=False)
    if not leaves or mesh.world == layout.world:  # one replica: nothing to compare
        return
    device = next((x.device for x in leaves if isinstance(x, Tensor)), torch.device("cpu"))
    mine = torch.stack([_digest(x) for x in leaves])  # [leaves, 32]
    every = Coordinator(mesh, distributed=True, world=mesh.world, device=device).all_gather(mine)
    by_replica = every.view(mesh.world // layout.world, layout.world, len(leaves), -1)  # rank r: [r // S, r % S]
    differ = (by_replica != by_replica[:1]).any(-1).any(0).any(0)  # [leaves]
    if bool(differ.any()):
        raise _differs(_where(paths[int(differ.nonzero()[0])]), layout.axis)


def shard_group(state: Any, mesh: Any = None, *, check: bool = True) -> Any:
    """A hybrid state as the 1-D state of its shard group (world `S`): on a `SimMesh` the first group's rows, on a
    `DistMesh` this rank's values (its part of its group's state); a 1-D state as it is.

    Args:
      state: a `TrainState`.
      mesh: a `DistMesh` state's mesh (see `hybrid_mesh`).
      check: check that every replica holds the same values (on a `DistMesh` a collective: every rank calls it).

    Raises:
      ValueError: a leaf's replicas differ (it names the leaf).
    """
    info = hybrid_mesh(state, mesh)
    if info is None:
        return state
    layout = state.layout
    if not getattr(state, "simulated", False):
        if check:
            _check_replicas(state, mesh)
        return state.replace(layout=layout.on_axis(None))
    S, W = layout.world, state.params.shape[0]

    def rows(path: tuple, t: Tensor) -> Tensor:
        t = in_memory(t)  # (an offloaded leaf: its rows are compared and kept in memory)
        if t.ndim == 0 or t.shape[0] != W:
            return t
        first = t[:S]
        for i in range(1, W // S):
            if check and not torch.equal(first, t[i * S : (i + 1) * S]):
                raise _differs(_where(path), layout.axis)
        return first

    out: Any = optree.tree_map_with_path(rows, state, namespace="fzero", none_is_leaf=False)
    return out.replace(layout=layout.on_axis(None))


def expand_hybrid(loaded: Any, like: Any) -> Any:
    """The world-`S` state `loaded` (loaded into `shard_group(like)`) copied to every replica of the hybrid `like`:
    on a `SimMesh`, the rows of the first shard group copied to the others; on a `DistMesh`, this rank's values
    with `like`'s layout."""
    if not getattr(like, "simulated", False):
        spec = optree.tree_structure(like, namespace="fzero", none_is_leaf=False)
        return optree.tree_unflatten(spec, optree.tree_leaves(loaded, namespace="fzero", none_is_leaf=False))
    S, W = like.layout.world, like.params.shape[0]
    index = torch.arange(W) % S  # rank r holds shard r % S (the sharding axis is innermost)

    def expand(target: Tensor, value: Tensor) -> Tensor:
        if target.ndim >= 1 and target.shape[0] == W and value.ndim == target.ndim and value.shape[0] == S:
            return value[index]
        return value

    targets, spec = optree.tree_flatten(like, namespace="fzero", none_is_leaf=False)
    values = optree.tree_leaves(loaded, namespace="fzero", none_is_leaf=False)  # the same structure, world S
    return optree.tree_unflatten(spec, [expand(t, v) for t, v in zip(targets, values, strict=True)])


class GroupCoordinator:
    """What `save` and `load` need from a `Coordinator` (`fzero.checkpoint.coord`), for a hybrid `DistMesh` state:
    the checkpoint's world is the shard group's `S`, but every rank of the mesh takes part.

    Agreement (`exchange`, `agree`) and `rank` (rank 0 prepares and commits) are over every rank of the mesh;
    `all_gather` (the save's storage decision) over this rank's shard group; `ranks` are the checkpoint ranks this
    process holds: its shard rank when loading, and when saving only on replica 0 (the others write nothing).

    Args:
      mesh: the state's `DistMesh` (checked by `hybrid_mesh`).
      world: the shard group's size `S` (the state's `layout.world`).
      device: where the messages travel (the state's device).
      saving: whether the ranks are those that write (replica 0's) or those that load (every replica's).
    """

    def __init__(self, mesh: Any, world: int, device: torch.device | str = "cpu", *, saving: bool) -> None:
        self._all = Coordinator(mesh, distributed=True, world=mesh.world, device=device)
        self.distributed = self._all.distributed
        self.rank = self._all.rank
        self.world = self._all.world
        self.device = self._all.device
        self.group_world = world
        self.shard_rank, self.replica = self.rank % world, self.rank // world
        self.saving = saving

    @property
    def ranks(self) -> list[int]:
        """The checkpoint ranks (of `S`) whose values this process writes or loads."""
        return [] if self.saving and self.replica else [self.shard_rank]

    def all_gather(self, x: Tensor) -> Tensor:
        """The shard group's `x` stacked (`[S, ...]`): rows of one all-gather over every rank (every group gathers
        at once; each keeps its own rows)."""
        every = self._all.all_gather(x)
        return every[self.replica * self.group_world : (self.replica + 1) * self.group_world]

    def exchange(self, text: str) -> list[str]:
        """Every rank's `text`, over the whole mesh."""
        return self._all.exchange(text)

    def agree(self, error: BaseException | None, what: str) -> None:
        """End a phase on every rank of the mesh (`Coordinator.agree`)."""
        self._all.agree(error, what)

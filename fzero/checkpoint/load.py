"""`load(directory, like)`: a checkpoint into the structure of `like`, at `like`'s world size and stage.

Everything is checked before anything is applied: the manifest (format version), every file's size and sha256,
the files' headers, that the checkpoint is of `like`'s model and structure. A failure raises an error naming the
file or leaf at fault, and changes nothing (the state is built anew; the generators are restored last).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import optree
from torch import Tensor

from ..storage import Offloaded, Store
from . import background, rng
from .coord import Coordinator
from .hybrid import GroupCoordinator, expand_hybrid, hybrid_mesh, shard_group
from .reader import Checkpoint
from .reshard import build_leaves, check_compatible
from .tree import FlatState, flatten_state

__all__ = ["load"]


class _ToDisk:
    """Writes the loaded values of `like`'s offloaded leaves into their stores as they are built (one leaf in
    memory at a time), as a new version of each store; `handles` puts the new handles in place."""

    def __init__(self, like: Sequence[Any]) -> None:
        self.like = {i: x for i, x in enumerate(like) if isinstance(x, Offloaded)}
        self.versions: dict[int, tuple[Store, int, int, dict[str, Any]]] = {}

    def _version(self, x: Offloaded) -> tuple[Store, int, int, dict[str, Any]]:
        if id(x.store) not in self.versions:  # (like's own version stays readable: a leaf not loaded is copied)
            self.versions[id(x.store)] = (x.store, *x.store.begin(keep=x), {})
        return self.versions[id(x.store)]

    def __call__(self, i: int, value: Tensor) -> Any:
        x = self.like.get(i)
        if x is None:
            return value
        store, version, slot, crcs = self._version(x)
        crcs[x.name] = store.write_leaf(x.name, value, version, slot)
        return None  # (replaced by `handles`)

    def handles(self, leaves: list[Any]) -> list[Any]:
        out = list(leaves)
        for x in self.like.values():
            store, version, slot, crcs = self._version(x)
            if x.name not in crcs:  # not loaded (`select`, or missing with strict=False): like's values
                crcs[x.name] = store.write_leaf(x.name, x.read(), version, slot)
        for i, x in self.like.items():
            store, version, slot, crcs = self._version(x)
            out[i] = store.finish(version, slot, crcs)[x.name]
        return out


def load(
    directory: str | os.PathLike[str],
    like: Any,
    mesh: Any = None,
    *,
    tag: str | None = None,
    restore_rng: bool = False,
    strict: bool = True,
    select: Callable[[str], bool] | None = None,
    verify: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Load a checkpoint into the structure, forms and world size of `like`.

    The checkpoint may come from any world size and any stage: each leaf is resharded to `like`'s layout (see
    `fzero.checkpoint.reshard`). Loading into the same world size and stage gives back the saved tensors bitwise.

    Args:
      directory: a root of tagged checkpoints (its ``latest`` is loaded unless `tag` says otherwise) or a
        checkpoint directory itself.
      like: a `TrainState` of the target run, e.g. `fzero.init(model, tx, mesh)`: it gives the structure, the
        static configuration and the layout; the values come from the files.
      mesh: the target's `DistMesh` (every rank calls `load`); not needed on a `SimMesh`. For a hybrid state
        (`DistMesh(shape=...)`) every replica loads its shard rank's part (`fzero.checkpoint.hybrid`).
      tag: which checkpoint of the root.
      restore_rng: set this process's random generators (torch, CUDA, Python, NumPy) to the saved ones: on a
        `DistMesh`, rank `r` gets those of saved process `r % processes`.
      strict: the checkpoint and `like` must have the same leaves; with False, leaves missing from the checkpoint
        keep `like`'s values and extra ones are ignored.
      select: load only the leaves whose key it accepts (e.g. `lambda k: not k.startswith("tx_state")` to load the
        model but keep `like`'s fresh optimizer state); the others keep `like`'s values.
      verify: check every shard file's sha256 first (reads every byte once more; leave on).

    Returns:
      `(state, extra)`: the new state, and a dict with ``step``, ``data_position``, ``user_state``, ``config``,
      ``tag``, ``path``, ``world`` (the saved world size), ``rng`` (the generator states this process would
      restore) and ``manifest``.

    Raises:
      CheckpointNotFoundError, CorruptCheckpointError, CheckpointVersionError, IncompatibleCheckpointError.
    """
    background.wait_pending(directory)  # a background save to it in flight ends first
    hybrid = hybrid_mesh(like, mesh)
    if hybrid is not None and getattr(like, "simulated", False):
        # load into its first shard group, then copy that to every replica
        state, extra = load(directory, shard_group(like), tag=tag, mesh=mesh, strict=strict, select=select,
                            verify=verify, restore_rng=restore_rng)  # fmt: skip
        state = expand_hybrid(state, like)
        to_disk = _ToDisk(optree.tree_leaves(like, namespace="fzero"))  # (the shard group was loaded in memory)
        leaves = to_disk.handles([to_disk(i, x) for i, x in enumerate(optree.tree_leaves(state, namespace="fzero"))])
        return optree.tree_unflatten(optree.tree_structure(like, namespace="fzero"), leaves), extra
    if hybrid is not None:  # a DistMesh rank: its part of its shard group's world-S state, on every replica
        flat = flatten_state(shard_group(like, mesh, check=False))
        group = GroupCoordinator(mesh, flat.world, flat.device, saving=False)
        state, extra = _load(directory, flat, group, tag, restore_rng, strict, select, verify)
        return expand_hybrid(state, like), extra
    flat = flatten_state(like)
    coord = Coordinator(mesh, distributed=not flat.simulated, world=flat.world, device=flat.device)
    return _load(directory, flat, coord, tag, restore_rng, strict, select, verify)


def _load(
    directory: str | os.PathLike[str],
    flat: FlatState,
    coord: Coordinator | GroupCoordinator,
    tag: str | None,
    restore_rng: bool,
    strict: bool,
    select: Callable[[str], bool] | None,
    verify: bool,
) -> tuple[Any, dict[str, Any]]:
    """`load` into the 1-D state `flat` (see there), for the ranks `coord` holds."""
    ckpt = None
    error: BaseException | None = None
    try:
        ckpt = Checkpoint(directory, tag, verify=False)
        check_compatible(ckpt, flat, strict=strict, select=select)  # cheap, from the manifest: before reading
        if verify:  # each rank checks a share of the files; they all learn the verdict
            share = [i for i in range(ckpt.manifest.world) if not coord.distributed or i % coord.world == coord.rank]
            ckpt.verify(share)
    except Exception as e:
        error = e
    coord.agree(error, "checking the checkpoint")
    assert ckpt is not None
    try:
        with ckpt:
            to_disk = _ToDisk(flat.leaves)
            leaves = to_disk.handles(build_leaves(ckpt, flat, coord.ranks, strict=strict, select=select, keep=to_disk))
            processes = ckpt.manifest.processes
            states = ckpt.rng(coord.rank % processes if coord.distributed else 0)
    except Exception as e:
        error = e
    coord.agree(error, "loading the checkpoint")
    state = optree.tree_unflatten(flat.treespec, leaves)
    m = ckpt.manifest
    if restore_rng:
        rng.restore(states)
    extra = {
        "step": m.step,
        "data_position": m.data_position,
        "user_state": m.user_state,
        "config": m.config,
        "tag": m.tag,
        "path": str(ckpt.path),
        "world": m.world,
        "rng": states,
        "manifest": m,
    }
    return state, extra

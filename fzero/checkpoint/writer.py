"""A save's two halves: `make_job`, everything that depends on the state at the call (the storage decision, the
generators, the manifest's fields), and `write`, the files, the manifest and the commit (`fzero.checkpoint.save`
runs both at once; `fzero.checkpoint.background` runs the second in a thread, on a staged copy).

Every rank writes its own shard file, rank 0 the manifest, and the checkpoint appears all at once (see
`fzero.checkpoint.atomic`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..layout import dtype_of
from . import rng
from .atomic import check_tag, commit, fsync_dir, prepare, temp_dir
from .coord import Coordinator
from .errors import CheckpointError
from .hybrid import GroupCoordinator, hybrid_mesh, shard_group
from .manifest import VERSION, FileInfo, Manifest, StoredEntry, file_name, write_manifest
from .safetensors_io import TensorSpec, write_safetensors
from .sources import MemorySource, decide_storage
from .tree import FlatState, flatten_state

__all__ = ["Job", "make_job", "write"]


def _json(value: Any, name: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save: {name} must be JSON-serialisable (checkpoints never pickle), got {e}") from None
    return value


def _roles(state: Any, flat: FlatState) -> dict[str, Any]:
    """Which keys hold the master parameters, frozen parameters and buffers (read by `consolidate`)."""
    by_id = {id(x): e.key for e, x in zip(flat.entries, flat.leaves, strict=True)}
    roles: dict[str, Any] = {
        "params": by_id.get(id(getattr(state, "params", None))),
        "frozen": by_id.get(id(getattr(state, "frozen", None))),
    }
    buffers = getattr(state, "buffers", None) or {}
    roles["buffers"] = {name: by_id[id(x)] for name, x in buffers.items() if id(x) in by_id}
    return roles


def _precision(flat: FlatState, roles: dict[str, Any]) -> dict[str, str | None]:
    by_key = {e.key: e for e in flat.entries}
    master = by_key.get(roles.get("params") or "")
    compute = by_key.get("compute")
    return {"master": master.dtype if master else None, "compute": compute.dtype if compute else None}


RngState = tuple[dict[str, torch.Tensor], dict[str, str]]
Coord = Coordinator | GroupCoordinator


def _write_rank(
    directory: Path,
    source: MemorySource,
    rank: int,
    world: int,
    rng_state: RngState | None,
    meta: dict[str, str],
    fsync: bool,
) -> FileInfo:
    entries = [e for e in source.entries.values() if e.in_file(rank)]
    specs = [TensorSpec(e.key, dtype_of(e.dtype), e.stored_shape(source.layout)) for e in entries]
    producers = [lambda e=e: source.pieces(e.key, rank) for e in entries]
    meta = {**meta, "fzero.rank": str(rank), "fzero.world": str(world)}
    if rng_state is not None:
        tensors, rng_meta = rng_state
        meta.update(rng_meta)
        for name, t in tensors.items():
            specs.append(TensorSpec(name, t.dtype, tuple(t.shape)))
            producers.append(lambda t=t: t)
    name = file_name(rank, world)
    record = write_safetensors(directory / name, specs, lambda i: producers[i](), meta, fsync=fsync)
    return FileInfo(name, rank, record.bytes, record.sha256)


@dataclass
class Job:
    """A save decided at the call, ready to write: what `write` needs, nothing of the live state but `source`
    (which `fzero.checkpoint.background` replaces by a staged copy) and `coord` (there, a side channel)."""

    root: Path
    tag: str
    source: MemorySource
    coord: Coord
    manifest: Callable[[list[FileInfo]], Manifest]  # the manifest, given every rank's file
    rng_state: RngState  # this process's generators at the call
    latest: bool
    overwrite: bool
    fsync: bool


def make_job(
    state: Any,
    directory: str | os.PathLike[str],
    mesh: Any,
    tag: str | None,
    data_position: int | None,
    user_state: Any,
    config: Any,
    latest: bool,
    overwrite: bool,
    fsync: bool,
) -> Job:
    """Everything about the save that depends on the state at the call (the one collective: the storage decision)."""
    hybrid = hybrid_mesh(state, mesh)
    # a hybrid state: its first shard group's world-S state; on a DistMesh every rank takes part, replica 0's ranks
    # write (fzero.checkpoint.hybrid)
    state = shard_group(state, mesh)
    flat = flatten_state(state)
    coord: Coord
    if hybrid is not None and not flat.simulated:
        coord = GroupCoordinator(mesh, flat.world, flat.device, saving=True)
    else:
        coord = Coordinator(mesh, distributed=not flat.simulated, world=flat.world, device=flat.device)
    if data_position is not None and (isinstance(data_position, bool) or not isinstance(data_position, int)):
        raise TypeError(f"save: data_position must be an int, got {data_position!r}")
    user_state, config = _json(user_state, "user_state"), _json(config, "config")
    step = int(getattr(state, "step", 0))
    tag = check_tag(f"step{step}" if tag is None else tag)

    gather = (lambda mine: coord.all_gather(mine)) if coord.distributed else None
    storage = decide_storage(flat, gather)
    # (this process's checkpoint rank; a replica that writes nothing reads nothing)
    source = MemorySource(flat, storage, rank=(coord.ranks or [0])[0] if coord.distributed else None)
    roles = _roles(state, flat)
    bare = dataclasses.replace(flat, leaves=())  # (the manifest needs no values: a staged save holds no live leaf)

    def manifest(infos: list[FileInfo]) -> Manifest:
        return _manifest(bare, roles, storage, infos, coord, tag, step, data_position, user_state, config, hybrid)

    return Job(Path(directory), tag, source, coord, manifest, rng.capture(), latest, overwrite, fsync)


def write(job: Job) -> Path:
    """Write a decided save: the shard files, the manifest, then the commit (every rank of `job.coord` calls it)."""
    root, tag, coord = job.root, job.tag, job.coord
    tmp = temp_dir(root, tag)
    error: BaseException | None = None
    if coord.rank == 0:
        try:
            prepare(root, tag, job.overwrite)
        except Exception as e:
            error = e
    coord.agree(error, "preparing the checkpoint directory")

    try:
        infos = _write_files(tmp, job)
    except Exception as e:
        error = CheckpointError(f"writing the shard files of {root / tag} failed ({type(e).__name__}: {e}); "
                                "nothing was changed")  # fmt: skip
        error.__cause__ = e
    try:
        coord.agree(error, "writing the shard files")
    except BaseException:
        if coord.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if coord.distributed:  # rank 0 learns every file's size and checksum
        texts = coord.exchange(json.dumps([vars(i) for i in infos]))
        infos = [FileInfo(**x) for text in texts for x in json.loads(text)]

    final = root / tag
    if coord.rank == 0:
        try:
            write_manifest(tmp, job.manifest(infos), job.fsync)  # last: a directory without it is an unfinished save
            if job.fsync:
                fsync_dir(tmp)
        except Exception as e:
            error = CheckpointError(f"writing the manifest of {final} failed ({type(e).__name__}: {e}); nothing "
                                    "was changed")  # fmt: skip
            error.__cause__ = e
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                final = commit(root, tag, job.latest)  # on failure it restores what was there and removes tmp
            except CheckpointError as e:
                error = e
    coord.agree(error, "committing the checkpoint")
    return final


def _write_files(tmp: Path, job: Job) -> list[FileInfo]:
    """This process's shard files, one thread per file (hashing and writing release the GIL, so a `SimMesh`'s
    files are written side by side); the first of them also holds the process's generators. None for a replica
    of a hybrid `DistMesh` state beyond the first."""
    ranks = job.coord.ranks
    if not ranks:
        return []
    meta = {"fzero.tag": job.tag, "fzero.format_version": str(VERSION)}
    world, first = job.source.layout.world, ranks[0]
    with ThreadPoolExecutor(min(len(ranks), os.cpu_count() or 1)) as pool:
        jobs = [pool.submit(_write_rank, tmp, job.source, r, world, job.rng_state if r == first else None, meta,
                            job.fsync) for r in ranks]  # fmt: skip
        return [j.result() for j in jobs]


def _manifest(
    flat: FlatState,
    roles: dict[str, Any],
    storage: dict[str, str],
    infos: list[FileInfo],
    coord: Coord,
    tag: str,
    step: int,
    data_position: int | None,
    user_state: Any,
    config: Any,
    mesh: dict[str, Any] | None = None,
) -> Manifest:
    return Manifest(
        tag=tag,
        step=step,
        world=flat.world,
        processes=flat.world if coord.distributed else 1,
        simulated=flat.simulated,
        layout=flat.layout,
        leaves=tuple(StoredEntry(**vars(e), storage=storage[e.key]) for e in flat.entries),
        files=tuple(sorted(infos, key=lambda i: i.rank)),
        precision=_precision(flat, roles),
        data_position=data_position,
        user_state=user_state,
        config=config,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        fzero_version=__version__,
        torch_version=torch.__version__,
        roles=roles,
        mesh=mesh,
    )

"""The manifest: one JSON file that says what a checkpoint holds and how to check it.

```json
{"format": "fzero-checkpoint", "version": 1, "tag": "step8", "step": 8, "world": 2, "processes": 1,
 "layout": {...}, "leaves": [{"key": "tx_state/shard_update/exp_avg", "kind": "shard", "storage": "split", ...}],
 "files": [{"name": "rank-00000-of-00002.safetensors", "rank": 0, "bytes": 1234, "sha256": "..."}, ...],
 "precision": {"master": "float32", "compute": "bfloat16"}, "data_position": 640, "user_state": {}, "config": {}}
```

How each leaf is stored (`storage`):

- ``"split"``: the leaf's full, unit-major value `F` (a shard leaf's shards put together, or a full leaf that every
  rank holds alike) is cut as the layout cuts parameters: rank `r`'s file holds `shard(layout, F)[r]`. Together the
  files hold `F` exactly once, and every rank writes an equal part.
- ``"rank0"``: every rank holds the same value; rank 0's file holds it.
- ``"per_rank"``: the ranks' values differ (e.g. gradients accumulated locally in the middle of a step, or
  per-rank buffers); every rank's file holds its own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._version import __version__
from ..layout import Layout
from .errors import CheckpointVersionError, CorruptCheckpointError
from .tree import PARAM_SPACE, PARAMS, REPLICATED, SPACES, Entry

__all__ = ["FORMAT", "VERSION", "FileInfo", "Manifest", "StoredEntry", "file_name", "read_manifest"]

FORMAT = "fzero-checkpoint"
VERSION = 2  # 2: leaves carry a space (frozen parameters' flat buffer), chain states are named by transform
STORAGES = ("split", "rank0", "per_rank")
_FILE = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")


def file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


@dataclass(frozen=True)
class StoredEntry(Entry):
    """An `Entry` and how it is stored (see the module docstring)."""

    storage: str = "split"

    def in_file(self, rank: int) -> bool:
        """Whether rank `rank`'s file holds this leaf."""
        return self.storage != "rank0" or rank == 0

    def stored_shape(self, layout: Layout) -> tuple[int, ...]:
        """The shape of what one file holds (`layout`: the state's; the leaf's space picks its part)."""
        if self.storage == "split":
            return (*self.lead, self.shape[-1] if self.kind == "shard" else self.layout_in(layout).shard_numel)
        return self.shape


@dataclass(frozen=True)
class FileInfo:
    """One shard file: its name, the rank that wrote it, its size and sha256."""

    name: str
    rank: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything a checkpoint says about itself (see the module docstring)."""

    tag: str
    step: int
    world: int
    processes: int
    simulated: bool
    layout: Layout
    leaves: tuple[StoredEntry, ...]
    files: tuple[FileInfo, ...]
    precision: dict[str, str | None] = field(default_factory=dict)
    data_position: int | None = None
    user_state: Any = None
    config: Any = None
    created: str = ""
    fzero_version: str = ""
    torch_version: str = ""
    roles: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def entry(self, key: str) -> StoredEntry | None:
        for e in self.leaves:
            if e.key == key:
                return e
        return None

    def to_json(self) -> str:
        data = {"format": FORMAT, "version": self.version}
        for name in self.__dataclass_fields__:
            if name == "version":
                continue
            value = getattr(self, name)
            if name == "layout":
                value = json.loads(value.to_json())
            elif name in ("leaves", "files"):
                value = [asdict(x) for x in value]
            data[name] = value
        # one top-level field per line and one list item per line: readable, and small for large models
        lines = []
        for k, v in data.items():
            if isinstance(v, list) and v:
                items = ",\n  ".join(json.dumps(x, allow_nan=False) for x in v)
                lines.append(f"{json.dumps(k)}: [\n  {items}\n ]")
            else:
                lines.append(f"{json.dumps(k)}: {json.dumps(v, allow_nan=False)}")
        return "{\n " + ",\n ".join(lines) + "\n}\n"


def _need(data: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in data:
        raise CorruptCheckpointError(f"{where}: the manifest has no {name!r} field")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptCheckpointError(f"{where}: manifest field {name!r} is {value!r}, not a {kind}")
    return value


def _entry(x: Any, where: str, i: int) -> StoredEntry:
    try:
        e = StoredEntry(
            key=str(x["key"]),
            path=str(x.get("path", x["key"])),
            kind=str(x["kind"]),
            shape=tuple(int(s) for s in x["shape"]),
            dtype=str(x["dtype"]),
            world_axis=bool(x["world_axis"]),
            space=str(x.get("space", PARAMS)),  # format 1 before frozen parameters had a space: all in params
            storage=str(x["storage"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptCheckpointError(f"{where}: leaf entry {i} is malformed ({err!r})") from None
    if e.kind not in (*PARAM_SPACE, REPLICATED) or e.storage not in STORAGES or e.space not in SPACES:
        raise CorruptCheckpointError(
            f"{where}: leaf {e.key!r} has unknown kind {e.kind!r}, storage {e.storage!r} or space {e.space!r}"
        )
    if e.storage == "split" and (e.kind == REPLICATED or not e.shape):
        raise CorruptCheckpointError(f"{where}: leaf {e.key!r} of kind {e.kind!r} cannot be stored split")
    return e


def _roles(roles: Any, keys: set[str], where: str) -> dict[str, Any]:
    """Which leaves hold the master parameters, the frozen parameters (one flat leaf; `{name: key}` in checkpoints
    written before frozen parameters had a flat buffer) and the buffers; each must be a leaf's key."""
    roles = roles if isinstance(roles, dict) else {}
    params, frozen = roles.get("params"), roles.get("frozen")
    frozen = frozen if isinstance(frozen, (str, dict)) else None
    buffers = roles.get("buffers") if isinstance(roles.get("buffers"), dict) else {}
    named = list(frozen.values()) if isinstance(frozen, dict) else [frozen]
    for key in [params, *named, *buffers.values()]:
        if key is not None and key not in keys:
            raise CorruptCheckpointError(f"{where}: roles name leaf {key!r}, which the manifest does not list")
    return {"params": params, "frozen": frozen, "buffers": buffers}


def parse_manifest(text: str, where: str) -> Manifest:
    """Parse and check a manifest's text; `where` names the file in errors."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the file is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CorruptCheckpointError(f"{where}: not an fzero checkpoint manifest (format {got!r}, expected {FORMAT!r})")
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{where}: invalid format version {version!r}")
    if version > VERSION:
        by = data.get("fzero_version") or "a newer fzero"
        raise CheckpointVersionError(
            f"{where}: written in checkpoint format version {version} (by fzero {by}); this fzero ({__version__}) "
            f"reads versions up to {VERSION}. Upgrade fzero to load it."
        )
    try:
        layout = Layout.from_json(json.dumps(_need(data, "layout", dict, where)))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: the manifest's layout is malformed ({e!r})") from None
    world = _need(data, "world", int, where)
    if world != layout.world:
        raise CorruptCheckpointError(f"{where}: world {world} differs from the layout's world {layout.world}")
    leaves = tuple(_entry(x, where, i) for i, x in enumerate(_need(data, "leaves", list, where)))
    files = []
    for i, x in enumerate(_need(data, "files", list, where)):
        try:
            info = FileInfo(str(x["name"]), int(x["rank"]), int(x["bytes"]), str(x["sha256"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{where}: file entry {i} is malformed ({err!r})") from None
        m = _FILE.fullmatch(info.name)  # plain names only: a manifest never points outside its directory
        if not m or int(m.group(1)) != info.rank or int(m.group(2)) != world or info.rank != i:
            raise CorruptCheckpointError(f"{where}: file entry {i} names {info.name!r}, expected {file_name(i, world)}")
        files.append(info)
    if len(files) != world:
        raise CorruptCheckpointError(f"{where}: lists {len(files)} shard files for world {world}")
    processes = _need(data, "processes", int, where)
    if processes not in (1, world):
        raise CorruptCheckpointError(f"{where}: processes is {processes}, expected 1 or {world}")
    position = data.get("data_position")
    if position is not None and (isinstance(position, bool) or not isinstance(position, int)):
        raise CorruptCheckpointError(f"{where}: data_position is {position!r}, not an int")
    return Manifest(
        tag=str(_need(data, "tag", str, where)),
        step=_need(data, "step", int, where),
        world=world,
        processes=processes,
        simulated=bool(data.get("simulated", False)),
        layout=layout,
        leaves=leaves,
        files=tuple(files),
        precision=dict(data.get("precision") or {}),
        data_position=position,
        user_state=data.get("user_state"),
        config=data.get("config"),
        created=str(data.get("created", "")),
        fzero_version=str(data.get("fzero_version", "")),
        torch_version=str(data.get("torch_version", "")),
        roles=_roles(data.get("roles"), {e.key for e in leaves}, where),
        version=version,
    )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and check ``DIRECTORY/manifest.json``.

    Raises:
      CorruptCheckpointError: missing (an unfinished save), unreadable or malformed.
      CheckpointVersionError: written by a newer format version.
    """
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise CorruptCheckpointError(
            f"{path}: missing; {directory} is not a complete checkpoint (its save did not finish, or it is not a "
            "checkpoint directory)"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e})") from None
    return parse_manifest(text, str(path))

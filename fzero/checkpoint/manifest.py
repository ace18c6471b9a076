"""The manifest: one JSON file that says what a checkpoint holds and how to check it.

```json
{"format": "fzero-checkpoint", "version": 2, "tag": "step8", "step": 8, "world": 2, "processes": 1,
 "layout": {...}, "leaves": [{"key": "tx_state/shard_update/exp_avg", "kind": "shard", "space": "params", ...}],
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

The manifest is covered by ``manifest.json.sha256`` beside it (``sha256sum``'s format), written with it;
`fzero.checkpoint.manifest_schema` reads and checks both.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..layout import Layout
from .tree import Entry

__all__ = [
    "DIGEST",
    "FORMAT",
    "VERSION",
    "FileInfo",
    "Manifest",
    "StoredEntry",
    "file_name",
    "write_manifest",
]

FORMAT = "fzero-checkpoint"
VERSION = 3  # 2: the manifest's digest; leaves carry a space (the frozen parameters' flat buffer); chain states
# are named by transform. 3: the mesh (null for a 1-D mesh), so an fzero that predates it refuses a newer format
DIGEST = "manifest.json.sha256"
STORAGES = ("split", "rank0", "per_rank")


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
    mesh: dict[str, Any] | None = None  # a hybrid state's {"axis": name, "replicas": R}, None for 1-D (.hybrid)

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


def write_manifest(directory: Path, manifest: Manifest, fsync: bool = True) -> None:
    """Write ``manifest.json`` and its digest ``manifest.json.sha256`` into `directory` (flushed if `fsync`)."""
    data = manifest.to_json().encode("utf-8")
    digest = f"{hashlib.sha256(data).hexdigest()}  manifest.json\n".encode()
    for name, content in (("manifest.json", data), (DIGEST, digest)):
        with open(directory / name, "wb") as f:
            f.write(content)
            f.flush()
            if fsync:
                os.fsync(f.fileno())

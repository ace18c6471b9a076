"""Reading a manifest (`fzero.checkpoint.manifest`): its digest first, then every field against `SCHEMA`.

``manifest.json.sha256`` is checked before anything of the manifest is read: a manifest altered after it was written
is refused. Format 1 (before this digest existed) loads with a `CheckpointWarning`; from format 2 on a missing digest
is an error. Then every field is checked against `SCHEMA` (its layout by `Layout.from_json`, rebuilt to check every
offset; its leaves' kinds from `fzero.checkpoint.tree.KINDS`; their shapes against the layout; the files' names,
ranks, sizes and checksums; the roles): a malformed manifest raises `CorruptCheckpointError` naming the field,
whatever was changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .._version import __version__
from ..config.schema import REQUIRED, Bool, ConfigError, Field, Int, ListOf, Nullable, Section, Spec, Str
from ..layout import Layout, TensorSpec, dtype_of, make_layout
from ..storage.swapfile import DTYPES
from .atomic import inside
from .errors import CheckpointVersionError, CheckpointWarning, CorruptCheckpointError
from .manifest import DIGEST, FORMAT, STORAGES, VERSION, FileInfo, Manifest, StoredEntry, file_name
from .tree import FROZEN, KINDS, PARAM_SPACE, PARAMS, SHARD, SPACES, dtype_name

__all__ = ["SCHEMA", "parse_manifest", "read_manifest"]

_FILE = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")
_DIGEST_LINE = re.compile(rb"([0-9a-f]{64})  manifest\.json\n?")
_DTYPE_NAMES = tuple(dtype_name(d) for d in DTYPES)


# ---------------------------------------------------------------------------------------------------- the schema
class _Json(Spec):
    """Any JSON value (user state, config): kept as it is."""

    expect = "a JSON value"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        return value


@dataclass(frozen=True)
class _Match(Spec):
    """A string matching `pattern` in full."""

    pattern: re.Pattern[str]
    expect: str = "a string"

    def validate(self, value: Any, path: str, unknown: list[str]) -> str:
        if not isinstance(value, str):
            raise self.type_error(path, value)
        if not self.pattern.fullmatch(value):
            raise self.value_error(path, value)
        return value


@dataclass(frozen=True)
class _MapOf(Spec):
    """An object of string keys and `inner` values."""

    inner: Spec
    expect: str = "an object of strings"

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.type_error(path, value)
        return {k: self.inner.validate(v, f"{path}.{k}", unknown) for k, v in value.items()}


def _difference(a: Any, b: Any, path: str) -> str | None:
    """The first path where two JSON values differ (types included: `1`, `1.0` and `true` differ)."""
    if type(a) is not type(b):
        return path
    if isinstance(a, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if k not in a or k not in b:
                return f"{path}.{k}"
            found = _difference(a[k], b[k], f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):  # a length difference is reported below
            found = _difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return f"{path}[{min(len(a), len(b))}]" if len(a) != len(b) else None
    return None if a == b else path


def _value_at(data: Any, path: str) -> Any:
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        key, index = part
        try:
            data = data[int(index)] if index else data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


@dataclass(frozen=True)
class _OneOf(Spec):
    """A value of the first of `options` that accepts it."""

    options: tuple[Spec, ...]

    @property
    def expect(self) -> str:
        return " or ".join(o.expect for o in self.options)

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        for option in self.options:
            try:
                return option.validate(value, path, unknown)
            except ConfigError:
                continue
        raise self.type_error(path, value)


class _LayoutSpec(Spec):
    """A layout: parsed by `Layout.from_json`, then rebuilt by `make_layout` from its parameters' names, shapes,
    dtypes and units (and its frozen layout's likewise), which must give it back exactly (every offset, unit start,
    size and shard start; every value of its JSON type), with non-negative shapes, known dtypes and unique names.
    A format-1 layout (frozen parameters as a list of specs, buffers without `persistent`) is compared in its own
    form."""

    expect = "a layout (JSON object)"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Layout:
        if not isinstance(value, dict):
            raise self.type_error(path, value)
        try:
            layout = Layout.from_json(json.dumps(value))
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
            raise ConfigError(path, f"malformed ({type(e).__name__}: {_short(e, 100)})") from None
        canonical = _canonical(layout, path)
        written, rebuilt = json.loads(json.dumps(value)), json.loads(canonical.to_json())
        if "frozen_layout" not in written:
            rebuilt = _format1(rebuilt)
        where = _difference(written, rebuilt, path)
        if where is not None:
            raise ConfigError(where, f"is {_short(_value_at(written, where[len(path):]))}, inconsistent with the "
                              f"layout (expected {_short(_value_at(rebuilt, where[len(path):]))})")  # fmt: skip
        return canonical


def _format1(data: dict[str, Any]) -> dict[str, Any]:
    """A layout's JSON as format 1 wrote it: frozen parameters as specs, buffers without `persistent`."""
    data = dict(data)
    frozen = data.pop("frozen_layout")
    data["frozen"] = [] if frozen is None else [{k: x[k] for k in ("dtype", "name", "shape")} for x in frozen["leaves"]]
    data["buffers"] = [{k: v for k, v in b.items() if k != "persistent"} for b in data["buffers"]]
    return data


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dims(shape: Any, path: str) -> tuple[int, ...]:
    dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        got = list(shape) if isinstance(shape, tuple) else shape
        raise ConfigError(path, f"expected a list of non-negative integers, got {_short(got)}")
    return dims


def _dtype(name: Any, path: str) -> str:
    if name not in _DTYPE_NAMES:
        raise ConfigError(path, f"expected one of {', '.join(_DTYPE_NAMES)}, got {_short(name)}")
    return name


def _name(name: Any, path: str, seen: set[str]) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(path, f"expected a non-empty string, got {_short(name)}")
    if name in seen:
        raise ConfigError(path, f"{_short(name)} names two tensors")
    seen.add(name)
    return name


def _canonical(layout: Layout, path: str, seen: set[str] | None = None) -> Layout:
    """The layout `make_layout` gives for `layout`'s parameters, units, frozen layout, buffers and aliases; raises
    `ConfigError` naming the field of a malformed one. `seen`: names already taken (the trainable layout's, for its
    frozen layout)."""
    outer = seen is None
    seen = set() if seen is None else seen
    units = [u.name for u in layout.units]
    params, unit_of = [], {}
    for i, x in enumerate(layout.leaves):
        where = f"{path}.leaves[{i}]"
        name = _name(x.name, f"{where}.name", seen)
        if not isinstance(x.unit, int) or isinstance(x.unit, bool) or not 0 <= x.unit < len(units):
            raise ConfigError(f"{where}.unit", f"expected a unit index in [0, {len(units)}), got {_short(x.unit)}")
        params.append((name, _dims(x.shape, f"{where}.shape"), dtype_of(_dtype(x.dtype, f"{where}.dtype"))))
        unit_of[name] = units[x.unit]
    if not all(isinstance(u, str) for u in units):
        raise ConfigError(f"{path}.units", "expected unit names (strings)")
    frozen = None
    if outer and layout.frozen_layout is not None:
        frozen = _canonical(layout.frozen_layout, f"{path}.frozen_layout", seen)
        if frozen.world != layout.world or frozen.align != layout.align:
            raise ConfigError(f"{path}.frozen_layout", "has another world or alignment than the layout")
    elif layout.frozen_layout is not None:
        raise ConfigError(f"{path}.frozen_layout", "a frozen layout has no frozen layout of its own")
    buffers = tuple(
        TensorSpec(_name(b.name, f"{path}.buffers[{j}].name", seen), _dims(b.shape, f"{path}.buffers[{j}].shape"),
                   _dtype(b.dtype, f"{path}.buffers[{j}].dtype"), b.persistent)
        for j, b in enumerate(layout.buffers)
    )  # fmt: skip
    named = set(seen)
    aliases = []
    for k, (alias, target) in enumerate(layout.aliases):
        _name(alias, f"{path}.aliases[{k}][0]", seen)
        if target not in named:
            raise ConfigError(
                f"{path}.aliases[{k}][1]", f"{_short(target)} is no parameter, frozen parameter or buffer"
            )
        aliases.append((alias, target))
    dtype = dtype_of(_dtype(layout.dtype, f"{path}.dtype"))
    try:
        return make_layout(params, world=layout.world, align=layout.align, unit_of=unit_of.__getitem__, dtype=dtype,
                           unit_names=units, frozen_layout=frozen, buffers=buffers, aliases=tuple(aliases),
                           what="frozen parameters" if not outer else "parameters")  # fmt: skip
    except (TypeError, ValueError) as e:  # world, align, no parameters
        raise ConfigError(path, f"malformed ({_short(e, 100)})") from None


_INT = Int(0)
_KEY = _Match(re.compile(r".+", re.DOTALL), "a non-empty string")
_LEAF = Section(
    {
        "key": Field(_KEY, REQUIRED),
        "path": Field(Str(), REQUIRED),
        "kind": Field(Str(KINDS), REQUIRED),
        "shape": Field(ListOf(_INT), REQUIRED),
        "dtype": Field(Str(_DTYPE_NAMES), REQUIRED),
        "world_axis": Field(Bool(), REQUIRED),
        "space": Field(Str(SPACES), PARAMS),  # format 1 had none: every leaf in the trainable space
        "storage": Field(Str(STORAGES), REQUIRED),
    }
)
_FILE_ENTRY = Section(
    {
        "name": Field(_Match(_FILE, "rank-NNNNN-of-NNNNN.safetensors"), REQUIRED),
        "rank": Field(_INT, REQUIRED),
        "bytes": Field(_INT, REQUIRED),
        "sha256": Field(_Match(re.compile(r"[0-9a-f]{64}"), "64 lower-case hex digits"), REQUIRED),
    }
)
_ROLES = Section(
    {
        "params": Field(Nullable(_KEY), None),
        "frozen": Field(_OneOf((Nullable(_KEY), _MapOf(_KEY))), None),  # one flat leaf; format 1: {name: key}
        "buffers": Field(_MapOf(_KEY), REQUIRED),
    }
)


def _stored(e: dict[str, Any]) -> StoredEntry:
    return StoredEntry(key=e["key"], path=e["path"], kind=e["kind"], shape=tuple(e["shape"]), dtype=e["dtype"],
                       world_axis=e["world_axis"], space=e["space"], storage=e["storage"])  # fmt: skip


def _checks(v: dict[str, Any], path: str) -> None:
    """What no single field says: the fields agree with each other and with the layout."""
    layout: Layout = v["layout"]
    world = v["world"]
    if world != layout.world:
        raise ConfigError("world", f"is {world}, the layout's world is {layout.world}")
    if v["processes"] not in (1, world):
        raise ConfigError("processes", f"is {v['processes']}, expected 1 or {world}")
    files = v["files"]
    if len(files) != world:
        raise ConfigError("files", f"lists {len(files)} shard files for world {world}")
    for i, f in enumerate(files):
        if f["name"] != file_name(i, world) or f["rank"] != i:
            raise ConfigError(f"files[{i}]", f"names {_short(f['name'])} of rank {f['rank']}, expected "
                              f"{file_name(i, world)} of rank {i}")  # fmt: skip
    keys: set[str] = set()
    stored = [0] * world  # bytes of tensor data each file must hold at least
    for i, e in enumerate(v["leaves"]):
        where, kind, shape = f"leaves[{i}]", e["kind"], tuple(e["shape"])
        if e["key"] in keys:
            raise ConfigError(f"{where}.key", f"{_short(e['key'])} appears twice")
        keys.add(e["key"])
        if e["space"] == FROZEN and layout.frozen_layout is None:
            raise ConfigError(f"{where}.space", "is 'frozen', but the layout has no frozen parameters")
        if kind in PARAM_SPACE:
            lay = layout.frozen_layout if e["space"] == FROZEN else layout
            assert lay is not None  # (checked just above)
            want = lay.shard_numel if kind == SHARD else lay.numel
            if not shape or shape[-1] != want:
                raise ConfigError(f"{where}.shape", f"is {list(shape)}: a {kind} leaf's last dimension is {want}")
        if e["storage"] == "split" and kind not in PARAM_SPACE:
            raise ConfigError(f"{where}.storage", f"a {kind} leaf cannot be stored 'split'")
        if kind == SHARD and e["storage"] != "split":
            raise ConfigError(f"{where}.storage", f"is {e['storage']!r}: a shard leaf is stored 'split'")
        entry = _stored(e)
        size = math.prod(entry.stored_shape(layout)) * dtype_of(e["dtype"]).itemsize
        for r in range(world):
            stored[r] += size if entry.in_file(r) else 0
    for r, need in enumerate(stored):
        if files[r]["bytes"] < need:
            raise ConfigError(f"files[{r}].bytes", f"is {files[r]['bytes']}, less than the {need} bytes of tensors "
                              "the leaves put in it")  # fmt: skip
    roles = v["roles"]
    if roles["params"] is not None and roles["params"] not in keys:
        raise ConfigError("roles.params", f"names leaf {_short(roles['params'])}, which the manifest does not list")
    frozen = roles["frozen"]
    if isinstance(frozen, str) and frozen not in keys:
        raise ConfigError("roles.frozen", f"names leaf {_short(frozen)}, which the manifest does not list")
    for role in ("frozen", "buffers"):
        for name, key in (roles[role] if isinstance(roles[role], dict) else {}).items():
            if key not in keys:
                raise ConfigError(f"roles.{role}.{name}", f"names leaf {_short(key)}, which the manifest does not list")
    for key, dtype in v["precision"].items():
        if dtype is not None and dtype not in _DTYPE_NAMES:
            raise ConfigError(f"precision.{key}", f"is {_short(dtype)}, not a dtype name")


SCHEMA = Section(
    {
        "format": Field(Str((FORMAT,)), REQUIRED),
        "version": Field(Int(1, VERSION), REQUIRED),
        "tag": Field(_Match(re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}"), "a checkpoint tag"), REQUIRED),
        "step": Field(_INT, REQUIRED),
        "world": Field(Int(1), REQUIRED),
        "processes": Field(Int(1), REQUIRED),
        "simulated": Field(Bool(), REQUIRED),
        "layout": Field(_LayoutSpec(), REQUIRED),
        "leaves": Field(ListOf(_LEAF), REQUIRED),
        "files": Field(ListOf(_FILE_ENTRY), REQUIRED),
        "precision": Field(_MapOf(Nullable(Str())), REQUIRED),
        "data_position": Field(Nullable(Int()), None),
        "user_state": Field(_Json(), None),
        "config": Field(_Json(), None),
        "created": Field(Str(), REQUIRED),
        "fzero_version": Field(Str(), REQUIRED),
        "torch_version": Field(Str(), REQUIRED),
        "roles": Field(_ROLES, REQUIRED),
        "mesh": Field(Nullable(_Json()), None),
    },
    checks=(_checks,),
)
"""Every field of a manifest, its type and constraints; `_checks` holds the constraints between fields."""


# ---------------------------------------------------------------------------------------------------- reading
def _strict_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_manifest(text: str, where: str) -> Manifest:
    """Parse and check a manifest's text against `SCHEMA`; `where` names the file in errors.

    Raises:
      CorruptCheckpointError: not JSON, or a field is missing, of another type, out of range or inconsistent
        (the message names it).
      CheckpointVersionError: written in a newer format.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the file is damaged") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a manifest; the file is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CorruptCheckpointError(
            f"{where}: not an fzero checkpoint manifest (format {_short(got)}, expected {FORMAT!r})"
        )
    version = data.get("version")
    if _strict_int(version) and version > VERSION:
        by = data.get("fzero_version")
        by = by if isinstance(by, str) and len(by) <= 40 else "a newer fzero"
        raise CheckpointVersionError(
            f"{where}: written in checkpoint format version {version} (by fzero {by}); this fzero ({__version__}) "
            f"reads versions up to {VERSION}. Upgrade fzero to load it."
        )
    if not _strict_int(version):
        raise CorruptCheckpointError(f"{where}: invalid format version {_short(version)}")
    unknown: list[str] = []
    try:
        v = SCHEMA.validate(data, "", unknown)
    except ConfigError as e:
        raise CorruptCheckpointError(f"{where}: malformed manifest: field {e}") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a manifest; the file is damaged") from None
    if unknown:
        raise CorruptCheckpointError(f"{where}: malformed manifest: unknown field {unknown[0]}")
    fields = {name: v[name] for name in Manifest.__dataclass_fields__}  # the schema's fields are the manifest's
    fields["leaves"] = tuple(_stored(e) for e in v["leaves"])
    fields["files"] = tuple(FileInfo(f["name"], f["rank"], f["bytes"], f["sha256"]) for f in v["files"])
    return Manifest(**fields)


def _read_small(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit + 1)


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read ``DIRECTORY/manifest.json``, check it against its digest, then against `SCHEMA`.

    Raises:
      CorruptCheckpointError: missing (an unfinished save), unreadable, altered (its digest differs), a symbolic
        link out of the directory, or malformed (the message names the field).
      CheckpointVersionError: written by a newer format version.

    Warns:
      CheckpointWarning: a format-1 manifest, written before digests existed: it is checked, but not covered by a
        checksum.
    """
    directory = Path(directory)
    path, digest_path = directory / "manifest.json", directory / DIGEST
    if not path.is_file():
        raise CorruptCheckpointError(
            f"{path}: missing; {directory} is not a complete checkpoint (its save did not finish, or it is not a "
            "checkpoint directory)"
        )
    for p in (path, digest_path):
        if os.path.lexists(p) and not inside(p, directory):
            raise CorruptCheckpointError(f"{p}: a symbolic link out of the checkpoint directory; refused")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e.strerror})") from None
    if os.path.lexists(digest_path):
        try:
            line = _read_small(digest_path, 200)
        except OSError as e:
            raise CorruptCheckpointError(f"{digest_path}: unreadable ({type(e).__name__}: {e.strerror})") from None
        m = _DIGEST_LINE.fullmatch(line)
        if m is None:
            raise CorruptCheckpointError(f"{digest_path}: not a sha256 line for manifest.json; the file is damaged")
        actual = hashlib.sha256(raw).hexdigest()
        if actual != m.group(1).decode():
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch (sha256 {actual[:16]}..., {DIGEST} records {m.group(1).decode()[:16]}...)"
                ": the manifest was altered or damaged after it was written"
            )
        digested = True
    else:
        digested = False
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{path}: not UTF-8 text; the file is damaged") from None
    manifest = parse_manifest(text, str(path))
    if not digested:
        if manifest.version >= 2:
            raise CorruptCheckpointError(
                f"{digest_path}: missing; a format-{manifest.version} manifest is always written with its digest"
            )
        warnings.warn(
            f"{path}: format 1, written before manifests had a digest: its fields are checked, but a change to them "
            "cannot be detected; save the checkpoint again to add one",
            CheckpointWarning,
            stacklevel=3,
        )
    return manifest

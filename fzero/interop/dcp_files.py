"""Reading a PyTorch Distributed Checkpoint (DCP) directory without executing anything in it, and finding where
its model and optimizer keys are.

A DCP directory (`torch.distributed.checkpoint.save`, any world size) holds ``.metadata`` (every key, flattened
to dots, with its size, dtype and the chunks the saving ranks wrote) and the ranks' ``__R_N.distcp`` files. DCP
itself reads ``.metadata`` with `pickle.load` and its non-tensor values with `torch.load(weights_only=False)`: either
runs code a crafted file carries. Here ``.metadata`` is read by an unpickler that rebuilds only the few classes a
DCP metadata file holds (`_SafeUnpickler`: any other global is refused with `UnsafeCheckpointError`, naming it), and
values go through `torch.load(weights_only=True)`; the tensors themselves are read and put back together across the
saving ranks' chunks by DCP's own `dcp.load` (its reader and planner, with those two methods replaced).

Layouts (`find_layout`): the optimizer's section is found from its ``state.<fqn>.exp_avg`` keys, the model's as the
prefix under which every such ``<fqn>`` is a tensor:

    PyTorch's DCP recipe      model.<fqn>        optim.state.<fqn>.<field>       optim.param_groups.<i>.<key>
    its `app.` wrapper        app.model.<fqn>    app.optim.state.<fqn>.<field>   app.optim.param_groups.<i>.<key>
    torchtitan                <fqn>              optimizer.state.<fqn>.<field>   optimizer.param_groups.<fqn>.<key>

(param groups either by index, `get_state_dict`'s default, or by parameter name, its
`flatten_optimizer_state_dict=True` and torchtitan's).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from ..checkpoint import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from ..checkpoint.atomic import inside
from .ds_files import UnsafeCheckpointError

__all__ = [
    "ADAM_FIELDS",
    "METADATA",
    "UNREADABLE",
    "DcpLayout",
    "find_layout",
    "read_metadata",
    "read_values",
    "scalars",
    "single_process",
]

METADATA = ".metadata"
ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # torch Adam/AdamW's state; the last: AMSGrad's
UNREADABLE = object()  # a value `read_values(lenient=True)` did not load: it needs more than weights_only allows
SECTIONS = ("lr_scheduler", "scheduler", "train_state", "dataloader")  # beside model and optimizer, never the model's

_MD = "torch.distributed.checkpoint.metadata"
_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")  # fmt: skip
_ALLOWED = {(_MD, name) for name in _CLASSES} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),  # (its module from Python 3.13)
    ("collections", "OrderedDict"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata classes, torch.Size and dtypes; refuses every other global (functions, classes)."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: needs the Python global {module}.{name}, which DCP metadata does not hold; refused (nothing "
            "of the file ran)"
        )


def read_metadata(dcp_dir: str | os.PathLike[str]) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint directory, read safely, with its files checked.

    Raises:
      CheckpointNotFoundError: no such directory, or no ``.metadata`` in it (not a DCP checkpoint).
      UnsafeCheckpointError: the metadata needs a Python global beyond DCP's own classes.
      CorruptCheckpointError: unreadable metadata; a data file it names missing, outside the directory, or not a
        plain file name.
    """
    root = Path(dcp_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such directory (a DCP checkpoint directory is expected)")
    path = root / METADATA
    if not path.is_file():
        also = " (it is an fzero checkpoint: see export_dcp)" if (root / "manifest.json").exists() else ""
        raise CheckpointNotFoundError(f"{root}: not a PyTorch DCP checkpoint: no {METADATA} file{also}")
    if not inside(path, root):
        raise CorruptCheckpointError(f"{path}: a symbolic link out of the checkpoint directory; refused")
    try:
        with open(path, "rb") as f:
            metadata = _SafeUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # (whatever a damaged pickle raises: EOFError, UnpicklingError, ...)
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{path}: not DCP metadata (holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{path}: names the data file {name!r}, not a file of its directory")
        file = root / name
        if not file.is_file() or not inside(file, root):
            raise CorruptCheckpointError(f"{file}: missing or not a regular file inside {root} (listed in {METADATA})")
    return metadata


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata already read safely (instead of its `pickle.load`)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _Planner(DefaultLoadPlanner):
    """DCP's planner for a flat `{key: tensor or None}`, reading non-tensor values with `weights_only=True`."""

    def __init__(self, path: Path, lenient: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path, self.lenient = path, lenient

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            if self.lenient:
                self.state_dict[key] = UNREADABLE
                return
            found = re.search(r"GLOBAL ([\w.]+)", str(e))  # (torch names the global it refused)
            what = f"the Python global {found.group(1)}" if found else "more than tensors and plain containers"
            raise UnsafeCheckpointError(
                f"{self.path}: value {key!r} needs {what} to load; refused (nothing of it ran)"
            ) from None


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Quiet DCP's warning that `no_dist=True` means one process: that is what fzero asks for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_values(dcp_dir: Path, metadata: Metadata, keys: list[str], *, lenient: bool = False) -> dict[str, Any]:
    """The values of `keys`: tensors whole (put together from every saving rank's chunks, in their saved dtype) and
    other values as `torch.load(weights_only=True)` rebuilds them; a value that needs more is refused
    (`UnsafeCheckpointError`), or with `lenient` returned as `UNREADABLE` (never loaded)."""
    entries = metadata.state_dict_metadata
    out: dict[str, Any] = {}
    for key in keys:
        md = entries[key]
        out[key] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    if not out:
        return out
    try:
        with single_process():
            dcp.load(out, storage_reader=_Reader(dcp_dir, metadata), planner=_Planner(dcp_dir, lenient), no_dist=True)
    except dcp.api.CheckpointException as e:  # DCP wraps what its reader raised, per rank
        for _, failure in getattr(e, "failures", {}).items():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, (UnsafeCheckpointError, CorruptCheckpointError)):
                raise exc from None
        raise CorruptCheckpointError(f"{dcp_dir}: unreadable DCP data ({str(e).splitlines()[0][:300]})") from None
    return out


@dataclass
class DcpLayout:
    """Where a DCP checkpoint keeps what fzero reads (see the module docstring).

    Attributes:
      model: the model section's prefix (``"model."``, ``""``, ``"app.model."``).
      optim: the optimizer section's prefix (``"optim."``, ``"optimizer."``, ...).
      root: what both sit under (``""``, or ``"app."``): the scheduler and train-state sections are looked for there.
      fields: per parameter with optimizer state (in the checkpoint's order), the names of its state's fields.
      grouped_by_name: param groups keyed by parameter name (``param_groups.<fqn>.<key>``) rather than index.
      model_keys: every tensor of the model section, by name without the prefix, in the checkpoint's order.
    """

    model: str
    optim: str
    root: str
    fields: dict[str, list[str]]
    grouped_by_name: bool
    model_keys: dict[str, tuple[int, ...]]

    @property
    def name(self) -> str:
        """The layout's common name, for messages and the imported checkpoint's record."""
        if self.model == "" and self.grouped_by_name:
            return "torchtitan"
        return f"{self.root}{{model,optim}} (PyTorch DCP recipe)" if self.root else "PyTorch DCP recipe"


def _optimizer_sections(keys: list[str]) -> dict[str, dict[str, list[str]]]:
    """`{prefix: {fqn: [fields]}}` for every key ``<prefix>state.<fqn>.<field>`` whose prefix also has
    ``<prefix>param_groups.`` keys (an optimizer's state dict, not a model module that happens to be named `state`)."""
    found: dict[str, dict[str, list[str]]] = {}
    for key in keys:
        at = 0 if key.startswith("state.") else key.find(".state.") + 1  # the first `state.` on a boundary
        if at == 0 and not key.startswith("state."):
            continue
        fqn, _, field = key[at + len("state.") :].rpartition(".")
        if fqn:
            found.setdefault(key[:at], {}).setdefault(fqn, []).append(field)
    groups = {k[: k.find("param_groups.")] for k in keys if k.startswith("param_groups.") or ".param_groups." in k}
    return {p: f for p, f in found.items() if p in groups}


def find_layout(metadata: Metadata, where: Path) -> DcpLayout:
    """Find the model and optimizer sections of a DCP checkpoint from its keys.

    Raises:
      IncompatibleCheckpointError: no optimizer state, or several; no prefix under which every parameter with
        optimizer state has its tensor; no param groups.
    """
    entries = metadata.state_dict_metadata
    keys = list(entries)
    sections = _optimizer_sections(keys)
    if not sections:
        raise IncompatibleCheckpointError(
            f"{where}: no optimizer state (no '<prefix>state.<parameter>.exp_avg' keys): fzero imports a training "
            "checkpoint, model and Adam/AdamW state (saved from get_state_dict(model, optimizer))"
        )
    if len(sections) > 1:
        raise IncompatibleCheckpointError(
            f"{where}: optimizer states under several prefixes ({', '.join(map(repr, sections))}): one optimizer's "
            "state can be imported"
        )
    ((optim, fields),) = sections.items()
    fqns = list(fields)
    candidates = []
    for key in keys:  # the prefixes under which the first parameter is a tensor
        if key.endswith(fqns[0]) and not key.startswith(optim):
            prefix = key[: len(key) - len(fqns[0])]
            if prefix == "" or prefix.endswith("."):
                candidates.append(prefix)
    models = [p for p in candidates if all(isinstance(entries.get(p + f), TensorStorageMetadata) for f in fqns)]
    if len(models) != 1:
        missing = f"{candidates[0] if candidates else 'model.'}{next((f for f in fqns), '')}"
        raise IncompatibleCheckpointError(
            f"{where}: no model section holds every parameter the optimizer has state for "
            + ("(several do: " + ", ".join(map(repr, models)) + ")" if models else f"(e.g. no tensor {missing!r})")
        )
    model = models[0]
    parent = optim.rstrip(".").rpartition(".")[0]  # "app" for "app.optim.": the wrapper both sections sit in
    root = f"{parent}." if parent and model.startswith(f"{parent}.") else ""
    by_name = any(f"{optim}param_groups.{f}.lr" in entries for f in fqns)
    if not by_name and f"{optim}param_groups.0.lr" not in entries:
        raise IncompatibleCheckpointError(
            f"{where}: no param groups ('{optim}param_groups.0.lr' or '{optim}param_groups.<parameter>.lr'): the "
            "optimizer's hyper-parameters are needed"
        )
    others = tuple(f"{root}{s}." for s in SECTIONS)
    model_keys = {}
    for key, md in entries.items():
        if key.startswith(model) and not key.startswith(optim) and isinstance(md, TensorStorageMetadata):
            if model == "" and key.startswith(others):  # (torchtitan: the model's keys sit beside these)
                continue
            model_keys[key[len(model) :]] = tuple(md.size)
    return DcpLayout(model, optim, root, fields, by_name, model_keys)


def scalars(metadata: Metadata, layout: DcpLayout, dcp_dir: Path) -> dict[str, Any]:
    """The scheduler's and train state's plain values (``lr_scheduler.last_epoch``, ``train_state.step``, ...), as
    JSON values by key; others (lists of tensors, data loader state) are not read."""
    wanted = [
        k
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(tuple(f"{layout.root}{s}." for s in SECTIONS[:3]))
        and (isinstance(md, BytesStorageMetadata) or (isinstance(md, TensorStorageMetadata) and not tuple(md.size)))
    ]
    out = {}
    for key, value in read_values(dcp_dir, metadata, wanted, lenient=True).items():
        if isinstance(value, Tensor):
            value = value.item()
        if isinstance(value, (bool, int, float, str)) and value == value:  # (not NaN)
            out[key[len(layout.root) :]] = value
    return out

"""Reading a DeepSpeed checkpoint's files without executing anything they contain.

DeepSpeed saves with `torch.save` (pickle). `torch.load(weights_only=True)` rebuilds tensors and plain containers
only; the few other types a DeepSpeed ZeRO checkpoint holds are allowed here by name, each rebuilt as an inert
stand-in that keeps the pickled fields as attributes (no DeepSpeed code is imported, none runs):

    deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler   the loss scaler's fields
    deepspeed.runtime.zero.config.ZeroStageEnum                         the stage, an int
    deepspeed.utils.tensor_fragment.fragment_address                    (numel, start) of a parameter's slice

A file that needs any other global (a function, another class) is refused with `UnsafeCheckpointError` naming it.

The files of a tag directory (``CKPT/global_step10/``):

    mp_rank_00_model_states.pt                        stages 0-2: the module's state_dict, counters, config, shapes
    zero_pp_rank_{r}_mp_rank_00_model_states.pt       stage 3: one per rank (the parameters in it are empty)
    zero_pp_rank_{r}_mp_rank_00_optim_states.pt       one per data-parallel rank: its optimizer partition
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.serialization import safe_globals

from ..checkpoint import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..checkpoint.atomic import check_tag, read_latest

__all__ = ["UnsafeCheckpointError", "load_file", "model_files", "optim_files", "resolve_tag"]


class UnsafeCheckpointError(CheckpointError):
    """A file needs a Python global (function or class) beyond the allowlist to load: it was not loaded."""


class _Fields:
    """An inert record of a pickled object's fields (`vars(x)`): nothing of the original class runs."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_Fields):
    pass


class DynamicLossScaler(_Fields):
    pass


class fragment_address(_Fields):  # DeepSpeed's name
    pass


class ZeroStageEnum(int):
    """DeepSpeed's stage enum, pickled as `ZeroStageEnum(value)`: its value."""


_ALLOWED: list[Any] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (fragment_address, "deepspeed.utils.tensor_fragment.fragment_address"),
]
# torch words it "Unsupported global: GLOBAL x" or "unsupported GLOBAL x whose module ..."
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed checkpoint file, loaded with `torch.load(weights_only=True)` and the allowlist above.

    Raises:
      UnsafeCheckpointError: the file needs another global to load (named in the message); nothing was executed.
      CorruptCheckpointError: the file is not a complete `torch.save` archive (truncated, damaged, not one).
    """
    if torch.torch_version.TorchVersion(torch.__version__) < "2.6":
        raise CheckpointError(
            f"reading DeepSpeed checkpoints safely needs torch >= 2.6 (weights_only loading with named allowed "
            f"types); this is torch {torch.__version__}"
        )
    try:
        with safe_globals(_ALLOWED):
            out = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        if found is None:  # not a refused type: a damaged pickle
            raise CorruptCheckpointError(f"{path}: not a readable torch.save archive ({_first_line(e)})") from None
        raise UnsafeCheckpointError(
            f"{path}: loading it needs the global {found.group(1)!r}, which is not among the types a DeepSpeed ZeRO "
            f"checkpoint stores ({', '.join(name for _, name in _ALLOWED)}, tensors and containers); refused "
            "without executing it"
        ) from None
    except Exception as e:  # truncated zip, bad tensor records, an allowed type given arguments it does not take
        raise CorruptCheckpointError(
            f"{path}: not a readable torch.save archive ({type(e).__name__}: {_first_line(e)}): truncated or damaged?"
        ) from None
    if not isinstance(out, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(out).__name__}; a DeepSpeed checkpoint file holds a dict")
    return out


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def resolve_tag(ckpt_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The tag directory: `ckpt_dir/tag`, or the one DeepSpeed's `latest` file names.

    Raises:
      CheckpointNotFoundError: no such directory, or no `latest` file without a tag.
      CheckpointError: `latest` or `tag` is not a plain tag name (a path, damaged text).
    """
    root = Path(ckpt_dir)
    if tag is None:
        tag = read_latest(root)  # bounded, checked: a crafted pointer cannot lead out of the root
        if tag is None:
            raise CheckpointNotFoundError(
                f"{root}: no 'latest' file (DeepSpeed writes it with save_latest=True); pass the tag, e.g. "
                "--tag global_step10"
            )
    path = root / check_tag(tag)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory (tag {tag!r})")
    return path


def _ranked(path: Path, pattern: str, what: str) -> list[Path]:
    """The files `pattern` (with one `(\\d+)` rank group) matches in `path`, by rank; ranks 0..N-1 all present."""
    regex = re.compile(pattern)
    found: dict[int, Path] = {}
    for p in sorted(path.iterdir()):
        if m := regex.fullmatch(p.name):
            rank = int(m.group(1))
            if rank in found:  # e.g. bf16_zero_pp_rank_0_... beside zero_pp_rank_0_...: which one is meant?
                raise CorruptCheckpointError(f"{path}: two {what} files for rank {rank}: {found[rank].name}, {p.name}")
            found[rank] = p
    if not found:
        raise CheckpointNotFoundError(f"{path}: no {what} files ({pattern}): not a DeepSpeed ZeRO checkpoint?")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise CorruptCheckpointError(f"{path}: the {what} files of ranks {missing} are missing")
    return [found[r] for r in sorted(found)]


def optim_files(path: Path) -> list[Path]:
    """Each data-parallel rank's optimizer file, by rank."""
    return _ranked(path, r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", "optimizer state")


def model_files(path: Path) -> list[Path]:
    """The model-state files: one (stages 0-2) or one per rank (stage 3)."""
    single = path / "mp_rank_00_model_states.pt"
    if single.is_file():
        return [single]
    return _ranked(path, r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt", "model state")

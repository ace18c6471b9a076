"""`export_hf`: an fzero checkpoint as the folder Hugging Face's `save_pretrained` writes, for `from_pretrained`.

    fzero.interop.export_hf("ckpts", "hf-model", config="path/to/original/model")   # or: fzero export-hf ...
    model = transformers.AutoModelForCausalLM.from_pretrained("hf-model")

The files are those `PreTrainedModel.save_pretrained` of the installed transformers writes for the config's model
class: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` beyond
`max_shard_size` (split by huggingface_hub's own rule, in the model's `state_dict()` order), ``config.json`` with
``dtype`` and ``architectures`` set as `save_pretrained` sets them, and ``generation_config.json`` for a model that
can generate. Tied weights are written once, under the name `save_pretrained` keeps (its own
`remove_tied_weights_from_state_dict`); non-persistent buffers and the class's `_keys_to_ignore_on_save` are left
out. Each safetensors file holds its tensors in the order the safetensors library writes them (dtype, then name)
with ``{"format": "pt"}`` metadata: the files are byte for byte the ones `save_pretrained` writes for the same
weights (tests/test_export_hf.py compares them). Tokenizer and processor files found beside the config
(`TOKENIZER_FILES`) are copied as they are, so the folder is complete for `AutoTokenizer.from_pretrained` too.

Checked before anything is written: the model class, built from the config on the ``meta`` device (no weights, no
downloads, no custom code), must expect exactly the checkpoint's tensors (names and shapes), and every pair of
weights it ties must be one tied parameter in the checkpoint; a mismatch raises `IncompatibleCheckpointError`
naming the keys. A class whose `save_pretrained` converts weights on the way out (the fused experts of MoE models)
is refused unless `original_format=False` (then its tensors are written as the model holds them, which this
transformers' `from_pretrained` reads, and older readers may not).

Streamed: tensors are read from the checkpoint one unit at a time (`fzero.checkpoint.consolidate.Consolidated`) and
written one at a time, so the memory needed is about one unit plus one tensor, whatever `max_shard_size` is. The
folder is written beside `out` and renamed into place: it appears complete or not at all.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, IncompatibleCheckpointError
from ..checkpoint.atomic import fsync_dir
from ..checkpoint.consolidate import Consolidated
from ..checkpoint.safetensors_io import TensorSpec, write_safetensors

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "TOKENIZER_FILES", "export_hf"]

DEFAULT_MAX_SHARD_SIZE = "50GB"  # PreTrainedModel.save_pretrained's default in transformers 5 (a test checks it)
WEIGHTS = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME
INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
# what tokenizers' and processors' save_pretrained write: copied from the config's directory when present
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
)  # fmt: skip
# the safetensors library's order of tensors in a file: by dtype (this order, which falls with the element size),
# then by name; `write_safetensors` keeps the caller's order among equal element sizes
_ORDER = (torch.uint64, torch.int64, torch.float64, torch.float32, torch.uint32, torch.int32, torch.bfloat16,
          torch.float16, torch.uint16, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8,
          torch.bool)  # fmt: skip
_SHOWN = 5  # keys named per kind of mismatch in an error


def export_hf(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    config: Any,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    verify: bool = True,
    overwrite: bool = False,
    model_class: type | str | None = None,
    tokenizer_files: bool = True,
    original_format: bool = True,
) -> Path:
    """Write a checkpoint's consolidated parameters as a Hugging Face model folder (`save_pretrained`'s files).

    Args:
      ckpt: a checkpoint directory, or a root of them (its ``latest``, or `tag`).
      out: the folder to create.
      config: a directory holding the model's ``config.json`` (and optionally ``generation_config.json`` and
        tokenizer files, copied too), or a `transformers.PretrainedConfig`.
      tag: which checkpoint of a root.
      dtype: cast floating tensors to it (`torch.bfloat16`, `torch.float16`); default: as saved (float32 masters
        under mixed precision). ``config.json`` records it as ``dtype``.
      max_shard_size: the largest safetensors file before splitting (bytes, or ``"5GB"``, ``"500MB"``: decimal
        units, as huggingface_hub parses them); a tensor larger than it gets a file of its own.
      verify: check the checkpoint files' sha256 first.
      overwrite: replace an existing non-empty `out` (else an error).
      model_class: the transformers class (or its name); default: the config's ``architectures[0]``, else the
        `AutoModelForCausalLM` class of its model type.
      tokenizer_files: copy the `TOKENIZER_FILES` found in the `config` directory.
      original_format: refuse classes whose `save_pretrained` converts weights (see the module docstring); False
        writes their tensors as the model holds them.

    Returns:
      `out`.

    Raises:
      IncompatibleCheckpointError: the checkpoint's tensors are not the model class's (unexpected or missing keys,
        other shapes, weights the class ties held apart), naming them; nothing is written.
      FileExistsError: `out` exists and is not an empty directory (without `overwrite`), or is a file.
      ValueError: `config` cannot be read, names no usable class, or `max_shard_size` / `dtype` is invalid.
      CheckpointError: the checkpoint is missing or damaged (see `fzero.checkpoint.Checkpoint`).
    """
    try:
        import transformers  # noqa: F401  (the model classes and their save_pretrained rules)
    except ImportError as e:
        raise ImportError("export_hf needs the transformers package (pip install 'transformers>=5')") from e
    out = Path(out)
    _check_out(out, overwrite)
    limit = _shard_limit(max_shard_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype {dtype!r}: expected a floating torch.dtype (torch.bfloat16, ...) or None")
    cfg, source = _read_config(config)
    model = _meta_model(cfg, model_class, source)
    with Checkpoint(ckpt, tag, verify=verify) as ck:
        _check_not_inside(out, [ck.path, *([source] if source is not None else [])])
        reader = Consolidated(ck, dtype)
        try:
            plan = _plan(model, reader, str(ck.path), original_format)
            tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
            _remove(tmp)
            tmp.mkdir(parents=True)
            try:
                _write(tmp, model, reader, plan, limit, source if tokenizer_files else None)
            except BaseException:
                _remove(tmp)
                raise
        finally:
            reader.release()
    _publish(tmp, out)
    return out


# ------------------------------------------------------------------------------------------------ inputs
def _shard_limit(size: int | str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        limit = parse_size_to_int(size) if isinstance(size, str) else int(size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"max_shard_size {size!r}: {e} (e.g. '5GB', '500MB', or a number of bytes)") from None
    if limit <= 0:
        raise ValueError(f"max_shard_size {size!r}: expected a positive size")
    return limit


def _check_out(out: Path, overwrite: bool) -> None:
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory (export-hf writes a model folder)")
    if not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; pass overwrite=True (--overwrite) to replace it")


def _check_not_inside(out: Path, keep: Iterable[Path]) -> None:
    """`out` is replaced as a whole: it must not hold the checkpoint or the config being read."""
    target = out.resolve()
    for path in keep:
        p = Path(path).resolve()
        if p == target or target in p.parents:
            raise ValueError(f"{out}: holds {path}, which the export reads; choose another output folder")


def _read_config(config: Any) -> tuple[Any, Path | None]:
    """The config (a copy: the export sets fields of it) and the directory it came from."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config), None
    if not isinstance(config, str | os.PathLike):
        raise TypeError(f"config: expected a directory holding config.json or a PretrainedConfig, got {config!r}")
    where = Path(config)
    if not (where / "config.json").is_file():
        raise ValueError(f"{where}: no config.json there (config is the directory of the model's config.json, as "
                         "save_pretrained writes it, or a transformers.PretrainedConfig)")  # fmt: skip
    try:  # a local directory: nothing is downloaded; custom code (auto_map) is refused, never run
        return AutoConfig.from_pretrained(where, local_files_only=True, trust_remote_code=False), where
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where / 'config.json'}: transformers cannot build a config from it ({e})") from None


def _model_class(cfg: Any, model_class: type | str | None) -> type:
    import transformers

    if model_class is None and cfg.architectures:
        model_class = cfg.architectures[0]
    if model_class is None:
        mapping: Any = transformers.AutoModelForCausalLM._model_mapping  # type: ignore[attr-defined]
        try:
            return mapping[type(cfg)]
        except KeyError:
            raise ValueError(f"the config (model_type {cfg.model_type!r}) names no architectures and has no causal "
                             "LM class; pass model_class=") from None  # fmt: skip
    cls = getattr(transformers, model_class, None) if isinstance(model_class, str) else model_class
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"model class {model_class!r}: not a transformers model class of transformers "
                         f"{transformers.__version__} (custom code is not run); pass model_class=")  # fmt: skip
    want = getattr(cls, "config_class", None)
    if isinstance(want, type) and not isinstance(cfg, want):
        raise ValueError(f"model class {cls.__name__} takes a {want.__name__}, the config is a "
                         f"{type(cfg).__name__} (model_type {cfg.model_type!r})")  # fmt: skip
    return cls


def _meta_model(cfg: Any, model_class: type | str | None, source: Path | None) -> Any:
    """The model class built from the config with every tensor on the ``meta`` device: names, shapes, ties."""
    cls = _model_class(cfg, model_class)
    try:
        with torch.device("meta"):
            return cls(cfg)
    except Exception as e:  # a config the class cannot be built from: whatever the class raises
        where = source / "config.json" if source is not None else "the config"
        raise ValueError(f"cannot build {cls.__name__} from {where}: {type(e).__name__}: {e}") from None


# ------------------------------------------------------------------------------------------------ the plan
def _tensor_of(model: nn.Module, name: str) -> Any:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _non_persistent(model: nn.Module) -> set[str]:
    return {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set}


def _kept_after_ties(state: dict[str, Any], model: Any) -> dict[str, Any]:
    """`save_pretrained`'s removal of tied weights (which name of each tied pair stays)."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # another transformers: keep the first name of each tensor, as state_dict() orders them
        seen: set[int] = set()
        kept = {}
        for k, v in state.items():
            if id(_tensor_of(model, k)) not in seen:
                seen.add(id(_tensor_of(model, k)))
                kept[k] = v
        return kept
    try:
        return remove_tied_weights_from_state_dict(dict(state), model)
    except RuntimeError as e:  # shared tensors the class does not declare as tied
        raise ValueError(f"{type(model).__name__}: {e}") from None


def _listed(items: list[str]) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _plan(model: Any, reader: Consolidated, where: str, original_format: bool) -> dict[str, TensorSpec]:
    """The tensors to write, `{name: spec}` in the model's `state_dict()` order; raises on any mismatch."""
    cls = type(model).__name__
    state = model.state_dict()
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    recomputed = _non_persistent(model)  # the model computes them at construction: never saved
    have = {s.name: s for s in reader.specs}
    unexpected = [n for n in have if n not in state and n not in recomputed and n not in ignored]
    missing = [k for k in state if k not in have and k not in ignored]
    shapes = [f"{k} (checkpoint {list(have[k].shape)}, {cls} {list(state[k].shape)})"
              for k in state if k in have and tuple(state[k].shape) != have[k].shape]  # fmt: skip
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) {cls} has no place for: {_listed(unexpected)}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) {cls} expects are missing: {_listed(missing)}")
    if shapes:
        problems.append(f"{len(shapes)} of other shapes: {_listed(shapes)}")
    if problems:
        raise IncompatibleCheckpointError(f"{where}: does not fit {cls} built from the config: "
                                          + "; ".join(problems) + ". Nothing was written.")  # fmt: skip
    saved = {k: v for k, v in state.items() if k not in ignored}
    kept = _kept_after_ties(saved, model)
    owner = {id(_tensor_of(model, k)): k for k in kept}
    for name in saved:
        if name in kept:
            continue
        partner = owner.get(id(_tensor_of(model, name)))
        if partner is None:
            raise ValueError(f"{cls}: save_pretrained drops {name!r} without keeping a tensor tied to it")
        if reader.aliases.get(name, name) != reader.aliases.get(partner, partner):
            raise IncompatibleCheckpointError(
                f"{where}: {cls} ties {name!r} to {partner!r} (its config's tie_word_embeddings, or the class's "
                f"_tied_weights_keys), but the checkpoint holds them as two parameters, which would be lost in "
                f"the export; use a config with tie_word_embeddings=false. Nothing was written."
            )
    order = _check_no_conversion(model, kept, where) if original_format else list(kept)
    return {k: have[k] for k in order}


def _check_no_conversion(model: Any, kept: dict[str, Any], where: str) -> list[str]:
    """The names in the order `save_pretrained` shards them; refuses a class whose `save_pretrained` renames or
    reshapes weights on the way out (transformers 5's conversion mappings, e.g. fused MoE experts written back as
    one tensor per expert)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversions
        return list(kept)
    try:
        reverted = revert_weight_conversion(model, dict(kept))
        changed = [k for k in kept if k not in reverted or reverted[k].shape != kept[k].shape]
        changed += [k for k in reverted if k not in kept]
    except Exception:  # a conversion that cannot even run on meta tensors: certainly not a plain rename
        changed = ["some tensors"]
    if changed:
        raise ValueError(
            f"{where}: {type(model).__name__}'s save_pretrained converts weights to another format on the way out "
            f"({_listed(changed)}), which export-hf does not do yet; pass original_format=False "
            "(--no-original-format) to write them as the model holds them (transformers 5 reads that), or load "
            "fzero.consolidate's tensors into the model and call save_pretrained"
        )
    return list(reverted)


# ------------------------------------------------------------------------------------------------ writing
def _rank(dtype: torch.dtype) -> int:
    return _ORDER.index(dtype) if dtype in _ORDER else len(_ORDER)


def _write(
    tmp: Path, model: Any, reader: Consolidated, plan: dict[str, TensorSpec], limit: int, source: Path | None
) -> None:
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        plan, get_storage_size=lambda s: s.nbytes, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    for filename, names in split.filename_to_tensors.items():
        specs = sorted((plan[n] for n in names), key=lambda s: (_rank(s.dtype), s.name))
        # one tensor at a time, read from the unit it lies in (the reader keeps one unit)
        produce = lambda i, specs=specs: reader.tensor(specs[i].name, copy=False)  # noqa: E731
        write_safetensors(tmp / filename, specs, produce, {"format": "pt"})
    if split.is_sharded:
        total = sum(p.numel() for p in model.parameters())  # PreTrainedModel.num_parameters(): ties counted once
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        with open(tmp / INDEX, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # config.json as save_pretrained writes it: the dtype of the first floating parameter, and the class
    first = next((n for n, p in model.named_parameters() if p.is_floating_point()), None)
    dtype = reader.spec(first).dtype if first is not None else next(iter(plan.values())).dtype
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    if model.can_generate():
        generation = model.generation_config
        if source is not None and (source / "generation_config.json").is_file():
            from transformers import GenerationConfig

            generation = GenerationConfig.from_pretrained(source, local_files_only=True)
        generation.save_pretrained(tmp)
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and not (tmp / name).exists():
                shutil.copyfile(source / name, tmp / name)  # follows links: a hub snapshot's files are links
    for path in tmp.iterdir():  # the files transformers wrote and the copies: on the disk before the rename
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)


def _remove(path: Path) -> None:
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an existing `out` (checked empty, or to be overwritten) is moved
    aside first and removed after, or put back if the rename fails."""
    if os.path.lexists(out):
        old = out.parent / f".{out.name}.old{os.getpid()}"
        _remove(old)
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)
            _remove(tmp)
            raise
        _remove(old)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)

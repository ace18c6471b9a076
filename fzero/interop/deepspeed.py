"""`import_deepspeed`: a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any world size) as an fzero checkpoint.

    fzero.interop.import_deepspeed("ds_ckpt", "fz_ckpt")            # or: fzero import-deepspeed ds_ckpt fz_ckpt
    engine, *_ = fzero.initialize(model=model, config=ds_config)    # any world size, any stage
    engine.load_checkpoint("fz_ckpt")                               # continues the DeepSpeed run

What is carried over: the fp32 master parameters (not the bf16/fp16 module copy: the compute copy is re-derived
from the masters by rounding, as DeepSpeed derives it), Adam's moments and update count (and with it the config's
LR schedule, a function of that count in both), DeepSpeed's counters (`global_steps`, `global_samples`,
`skipped_steps`), the loss scaler's state, frozen parameters, buffers, tied parameters, the base optimizer's
per-group hyper-parameters, a client scheduler's `state_dict()` and the `client_state`. The result is an ordinary
fzero checkpoint (one rank, stage 0: `load` reshards it to the loading engine's world size and stage).

Refused with a named error: optimizers other than Adam/AdamW (their state has other fields), a client state or
scheduler state that JSON cannot hold (fzero checkpoints never pickle), files needing types beyond the allowlist
(`fzero.interop.ds_files`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import optree
import torch
from torch import nn

from ..checkpoint import IncompatibleCheckpointError
from ..checkpoint.tree import flatten_state
from ..engine import initialize
from ..engine.checkpointing import optimizer_prefix
from ..engine.counters import EngineCounters
from ..layout import flatten
from ..mesh import SimMesh
from .ds_files import resolve_tag
from .ds_state import DeepSpeedState, read_deepspeed

__all__ = ["ADAM_TYPES", "import_deepspeed", "one_rank_config", "skeleton_module", "state_from"]

ADAM_TYPES = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")
# the loss scaler's fields that are fzero's scale_loss state leaves of the same meaning
_SCALER = {"cur_scale": "value", "cur_iter": "cur_iter", "last_overflow_iter": "last_overflow_iter",
           "cur_hysteresis": "cur_hysteresis"}  # fmt: skip


def skeleton_module(ds: DeepSpeedState) -> nn.Module:
    """A module with the checkpoint's parameters (fp32 masters), frozen parameters and buffers at their names,
    registered in the model's own order (so that a tied weight keeps the name the model gives it first)."""
    root = nn.Module()
    kinds = {**dict.fromkeys(ds.buffers, "buffer"), **dict.fromkeys(ds.frozen, "frozen"),
             **dict.fromkeys(ds.shared, "alias"), **dict.fromkeys(ds.params, "param")}  # fmt: skip
    order = [k for k in ds.order if k in kinds] + [k for k in kinds if k not in set(ds.order)]
    for name in order:
        module = root
        *owners, leaf = name.split(".")
        for part in owners:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        kind = kinds[name]
        if kind == "param":
            module.register_parameter(leaf, nn.Parameter(ds.params[name].clone()))
        elif kind == "frozen":  # float32, as a model starts (DeepSpeed's bf16 module rounded them: exact)
            value = ds.frozen[name]
            value = value.float() if value.is_floating_point() else value.clone()
            module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        elif kind == "buffer":
            module.register_buffer(leaf, ds.buffers[name].clone())
    for alias, source in ds.shared.items():  # once every source exists
        module, leaf = root, alias
        if "." in alias:
            owner, _, leaf = alias.rpartition(".")
            module = root.get_submodule(owner)
        module.register_parameter(leaf, root.get_parameter(source))
    return root


def one_rank_config(ds: DeepSpeedState, config: dict[str, Any] | None) -> dict[str, Any]:
    """The config to build the one-rank state with: the run's, at stage 0 with its per-rank micro-batch."""
    cfg = copy.deepcopy(ds.config if config is None else config)
    optimizer = cfg.get("optimizer")
    if not isinstance(optimizer, dict):
        raise IncompatibleCheckpointError(
            f"{ds.path}: the DeepSpeed config has no 'optimizer' block (a client optimizer?): pass config= (the "
            "config to train with, its optimizer block included) to import the optimizer state"
        )
    kind = str(optimizer.get("type", "")).lower()
    if kind not in ADAM_TYPES:
        raise IncompatibleCheckpointError(
            f"{ds.path}: optimizer type {optimizer.get('type')!r}: only Adam/AdamW states can be imported (exp_avg, "
            "exp_avg_sq, step); other optimizers' states have other fields"
        )
    # not for this one-rank conversion: the run's monitors and metrics file (it would write into the run's
    # dashboards), and rounding the masters (they are the checkpoint's, exactly)
    for key in ("tensorboard", "wandb", "csv_monitor", "comet", "fzero_metrics"):
        cfg.pop(key, None)
    if isinstance(cfg.get("fzero_precision"), dict):
        cfg["fzero_precision"] = {**cfg["fzero_precision"], "round_initial_master": False}
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    if "train_micro_batch_size_per_gpu" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = int(cfg["train_batch_size"]) // (gas * ds.world)
    cfg.pop("train_batch_size", None)
    cfg["zero_optimization"] = {"stage": 0}
    return cfg


def state_from(engine: Any, ds: DeepSpeedState, micro_steps: int) -> Any:
    """The engine's one-rank state with the checkpoint's optimizer state, loss scale and micro-step count."""
    state = engine.state
    layout, flat = state.layout, flatten_state(state)
    prefix = optimizer_prefix(state) or "tx_state/"
    aliased = {k: {**m, **{a: m[src] for a, src in ds.shared.items() if src in m}} for k, m in ds.moments.items()}
    values = {f"{prefix}{k}": flatten(layout, m).unsqueeze(0) for k, m in aliased.items()}
    values[f"{prefix}count"] = torch.tensor(ds.step, dtype=torch.int64)
    values["step"] = torch.tensor(micro_steps, dtype=torch.int64)
    for field, leaf in _SCALER.items():
        if field in ds.loss_scaler:
            values[f"tx_state/scale_loss/{leaf}"] = torch.tensor(ds.loss_scaler[field])
    leaves, taken = [], set(values)
    for entry, old in zip(flat.entries, flat.leaves, strict=True):
        new = values.pop(entry.key, None)
        leaves.append(old if new is None else new.to(old.dtype).reshape(old.shape))
    unused = [k for k in values if not k.startswith("tx_state/scale_loss/")]
    if unused:
        raise IncompatibleCheckpointError(
            f"{ds.path}: the fzero state built from its config has no leaf {unused[0]!r} for the DeepSpeed optimizer "
            "state (is the config's optimizer Adam/AdamW, with amsgrad as the run had it?)"
        )
    missed = [e.key for e in flat.entries if e.key.startswith(prefix) and e.key not in taken]
    if missed:  # e.g. AMSGrad's maximum in the config but not in the checkpoint: it would start at zero
        raise IncompatibleCheckpointError(
            f"{ds.path}: the optimizer state has nothing for {missed[0]!r}: was the run's optimizer configured as "
            "the config given says?"
        )
    return optree.tree_unflatten(flat.treespec, leaves)


def import_deepspeed(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write the DeepSpeed checkpoint `ckpt_dir/tag` as an fzero checkpoint under `out` (same tag).

    Args:
      ckpt_dir: the directory DeepSpeed's `engine.save_checkpoint(ckpt_dir)` wrote.
      out: the fzero checkpoint directory to write (`out/<tag>/`, and `out/latest`).
      tag: which checkpoint (default: the one DeepSpeed's `latest` file names).
      config: the DeepSpeed config to build the state with (default: the one saved in the checkpoint).

    Returns:
      The fzero checkpoint's path, for `engine.load_checkpoint` / `fzero.load` at any world size and stage.

    Raises:
      fzero.checkpoint.CheckpointError: see `read_deepspeed` and the module docstring.
    """
    ds = read_deepspeed(resolve_tag(ckpt_dir, tag))
    model = skeleton_module(ds)
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in names if n in named]} for names in ds.groups]
    try:
        engine, *_ = initialize(model=model, model_parameters=[g for g in groups if g["params"]],
                                config=one_rank_config(ds, config), mesh=SimMesh(1),
                                printer=lambda _: None)  # fmt: skip
        counters = EngineCounters(
            global_steps=ds.counters["global_steps"],
            global_samples=ds.counters["global_samples"],
            micro_steps=ds.counters["global_steps"] * engine.config.gas,
            skipped_steps=ds.counters["skipped_steps"],
            applied=ds.step,
        )
        state = state_from(engine, ds, counters.micro_steps)
    except (KeyError, ValueError, TypeError) as e:  # the checkpoint's names and shapes do not make one model
        raise IncompatibleCheckpointError(f"{ds.path}: {e}") from None
    scheduled = ds.config.get("scheduler") is not None
    engine.restore(state, counters)
    groups = engine.optimizer.param_groups
    # stage 3 keeps one base-optimizer group per sub-group: then every group takes the first's (a schedule moves
    # them alike)
    saved = ds.param_groups if len(ds.param_groups) == len(groups) else ds.param_groups[:1] * len(groups)
    for group, hypers in zip(groups, saved, strict=False):
        group.update({k: hypers[k] for k in ("lr", "betas") if k in hypers})
    if not scheduled and ds.lr_scheduler is not None:  # a client scheduler: restored by the caller's on load
        engine.client_scheduler = _Saved(ds.lr_scheduler)
    try:
        engine.save_checkpoint(out, tag=ds.path.name, client_state=ds.client_state)
    except (TypeError, ValueError) as e:  # a client state or scheduler state JSON cannot hold
        raise IncompatibleCheckpointError(f"{ds.path}: {e}") from None
    return Path(out) / ds.path.name


class _Saved:
    """A scheduler's saved `state_dict()`, handed to the engine's checkpoint record as a scheduler would."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

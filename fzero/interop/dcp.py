"""fzero checkpoints <-> PyTorch Distributed Checkpoints (DCP), the format FSDP2 runs save, both ways.

    fzero.interop.import_dcp("dcp/step-100", "fz_ckpts", model)   # or: fzero import-dcp dcp/step-100 fz_ckpts
    engine.load_checkpoint("fz_ckpts")                             # any world size, any stage

    fzero.interop.export_dcp("fz_ckpts", "dcp_out")                # or: fzero export-dcp fz_ckpts dcp_out
    # FSDP2, any world size: msd, osd = get_state_dict(model, optimizer)
    #   dcp.load({"model": msd, "optim": osd}, checkpoint_id="dcp_out"); set_state_dict(model, optimizer, ...)

What is carried: the fp32 parameters, frozen parameters and buffers (`model.state_dict()`'s keys), torch Adam's /
AdamW's `exp_avg`, `exp_avg_sq` (and AMSGrad's `max_exp_avg_sq`), its `step` (torch: a float32 scalar per parameter,
all equal; fzero: the optimizer's int64 update count, and with it the position of fzero's LR schedules, functions of
that count), the param groups' `lr`, `betas`, `eps`, `weight_decay` and Adam vs AdamW (`decoupled_weight_decay`).
The schedule's position is also written as ``lr_scheduler.last_epoch`` and the step as ``train_state.step`` (both the
update count); an imported checkpoint keeps the source's plain ``lr_scheduler.*`` / ``train_state.*`` values in its
client state. Not carried: a torch LR scheduler object's other fields, data loader state, a GradScaler's scale,
gradients of an open accumulation window. Which DCP layouts are read: `fzero.interop.dcp_files`.

Refused, naming the key, before anything is written: a model key missing, extra or of another shape than the
model's; optimizer state missing or extra for a parameter; optimizers other than Adam/AdamW (other state fields) or
with `maximize`; parameters whose `step`s differ; a directory that is not DCP (or, exporting, not fzero's).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from ..checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from ..checkpoint.atomic import fsync_dir
from ..checkpoint.consolidate import consolidate
from ..checkpoint.reader import Checkpoint
from ..engine import initialize
from ..engine.checkpointing import check_json
from ..engine.counters import EngineCounters
from ..mesh import SimMesh
from .dcp_files import (
    ADAM_FIELDS,
    METADATA,
    DcpLayout,
    find_layout,
    read_metadata,
    read_values,
    scalars,
    single_process,
)
from .deepspeed import ADAM_TYPES, one_rank_config, skeleton_module, state_from
from .ds_state import DeepSpeedState

__all__ = ["export_dcp", "import_dcp"]

_NEEDED = ("step", "exp_avg", "exp_avg_sq")
_HYPERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay", "params")


# ---------------------------------------------------------------------------------------------------------- import
@dataclass
class _Model:
    """The module's names: trainable and frozen parameters, persistent buffers, tied names, state_dict order."""

    trainable: list[str]
    frozen: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    shared: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    volatile: dict[str, Tensor] = field(default_factory=dict)  # non-persistent buffers: not in any checkpoint


def _from_module(model: nn.Module) -> _Model:
    first: dict[int, str] = {}
    out = _Model([])
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.shared[name] = first[id(p)]
            continue
        first[id(p)] = name
        (out.trainable if p.requires_grad else out.frozen).append(name)
    keys = model.state_dict(keep_vars=True)
    out.order = list(keys)
    params = set(out.trainable) | set(out.frozen) | set(out.shared)
    out.buffers = [k for k in keys if k not in params]
    for name, b in model.named_buffers():
        if name not in keys:
            out.volatile[name] = b.detach().clone()
    for name, t in keys.items():
        out.shapes[name], out.dtypes[name] = tuple(t.shape), t.dtype
    return out


def _from_layout(layout: DcpLayout) -> _Model:
    """Without a module: the parameters with optimizer state are trainable, the model's other tensors buffers."""
    out = _Model([k for k in layout.model_keys if k in layout.fields])
    out.buffers = [k for k in layout.model_keys if k not in layout.fields]
    out.order = list(layout.model_keys)
    out.shapes = dict(layout.model_keys)
    return out


def _check(layout: DcpLayout, names: _Model, entries: Mapping[str, Any], where: Path) -> None:
    """Every key the model needs is there with its shape, and no other; the optimizer's state is Adam's."""
    needed = [*names.trainable, *names.frozen, *names.buffers]
    for name in needed:
        key = layout.model + name
        if name not in layout.model_keys:
            raise IncompatibleCheckpointError(f"{where}: missing key {key!r} (the model's {name!r})")
        if layout.model_keys[name] != names.shapes[name]:
            raise IncompatibleCheckpointError(
                f"{where}: key {key!r} has shape {layout.model_keys[name]}, the model's {name!r} has "
                f"{names.shapes[name]}"
            )
    known = set(needed) | set(names.shared)
    extra = [k for k in layout.model_keys if k not in known]
    if extra:
        raise IncompatibleCheckpointError(f"{where}: extra key {layout.model + extra[0]!r}, which the model has not")
    for name in names.trainable:
        if name not in layout.fields:
            raise IncompatibleCheckpointError(
                f"{where}: missing optimizer state {layout.optim}state.{name}.* for the trainable parameter {name!r}"
            )
    for fqn, fields in layout.fields.items():
        state = f"{layout.optim}state.{fqn}"
        if fqn not in names.trainable:
            raise IncompatibleCheckpointError(f"{where}: extra optimizer state {state}.* (no trainable {fqn!r})")
        other = [f for f in fields if f not in ADAM_FIELDS]
        lacking = [f for f in _NEEDED if f not in fields]
        if other or lacking:
            raise IncompatibleCheckpointError(
                f"{where}: {state} has {', '.join(sorted(fields))}: only torch Adam/AdamW states (step, exp_avg, "
                "exp_avg_sq, and AMSGrad's max_exp_avg_sq) can be imported"
            )
        for f in fields:
            size = tuple(getattr(entries[f"{state}.{f}"], "size", ()))
            want = () if f == "step" else names.shapes[fqn]
            if size != want:
                raise IncompatibleCheckpointError(f"{where}: key {state}.{f!r} has shape {size}, expected {want}")


def _groups(values: Mapping[str, Any], layout: DcpLayout, names: _Model, where: Path) -> list[dict[str, Any]]:
    """The param groups, each `{"params": [names], "lr", "betas", ...}`, covering every trainable parameter once."""
    pg = f"{layout.optim}param_groups."
    groups: list[dict[str, Any]] = []
    if layout.grouped_by_name:  # one entry per parameter: parameters with equal hyper-parameters form a group
        for name in names.trainable:
            hypers = {k: values[f"{pg}{name}.{k}"] for k in _HYPERS[:-1] if f"{pg}{name}.{k}" in values}
            same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hypers), None)
            if same is None:
                groups.append({**hypers, "params": [name]})
            else:
                same["params"].append(name)
        return groups
    owner: dict[str, int] = {}
    trainable = set(names.trainable)
    i = 0
    while f"{pg}{i}.lr" in values:
        group = {k: values[f"{pg}{i}.{k}"] for k in _HYPERS if f"{pg}{i}.{k}" in values}
        listed = group.get("params")
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise IncompatibleCheckpointError(f"{where}: {pg}{i}.params is not a list of parameter names")
        group["params"] = [n for n in listed if n in trainable]  # (frozen ones may be listed)
        for n in group["params"]:
            if n in owner:
                raise IncompatibleCheckpointError(f"{where}: parameter {n!r} is in param groups {owner[n]} and {i}")
            owner[n] = i
        groups.append(group)
        i += 1
    unlisted = [n for n in names.trainable if n not in owner]
    if unlisted:
        raise IncompatibleCheckpointError(f"{where}: parameter {unlisted[0]!r} is in no param group ({pg}<i>.params)")
    return [g for g in groups if g["params"]]


def _built_config(groups: list[dict[str, Any]], where: Path, given: bool) -> dict[str, Any]:
    """The DeepSpeed-style config whose optimizer is the checkpoint's: torch's arithmetic (`torch_adam`). The groups
    are checked either way; with a config `given`, Adam vs AdamW is the config's to say."""
    for g in groups:
        for k in ("lr", "betas", "eps", "weight_decay"):
            if k not in g:
                raise IncompatibleCheckpointError(f"{where}: a param group has no {k!r} (not an Adam/AdamW group)")
        if g.get("maximize"):
            raise IncompatibleCheckpointError(f"{where}: maximize=True: fzero's Adam minimises only")
    flags = {(bool(g.get("amsgrad", False)), g.get("decoupled_weight_decay")) for g in groups}
    if len(flags) > 1:
        raise IncompatibleCheckpointError(f"{where}: param groups differ in amsgrad / decoupled_weight_decay")
    ((amsgrad, decoupled),) = flags
    if decoupled is None:  # torch before 2.6 does not record it: Adam and AdamW agree only without weight decay
        if not given and any(float(g["weight_decay"]) for g in groups):
            raise IncompatibleCheckpointError(
                f"{where}: the param groups do not say Adam or AdamW (no decoupled_weight_decay) and weight decay "
                "is on: pass config= with the optimizer type"
            )
        decoupled = True
    first = groups[0]
    params = {"lr": float(first["lr"]), "betas": [float(b) for b in first["betas"]], "eps": float(first["eps"]),
              "weight_decay": float(first["weight_decay"]), "torch_adam": True, "amsgrad": amsgrad}  # fmt: skip
    if not decoupled:
        params["adam_w_mode"] = False
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # (FSDP2 clips nothing by itself; DeepSpeed 0.19.3+'s default is 1.0)
        "optimizer": {"type": "AdamW" if decoupled else "Adam", "params": params},
        "zero_optimization": {"stage": 0},
    }


def _count(values: Mapping[str, Any], layout: DcpLayout, names: _Model, where: Path) -> int:
    """The one update count of every parameter's `step` (torch keeps one per parameter)."""
    steps = {}
    for name in names.trainable:
        value = values[f"{layout.optim}state.{name}.step"]
        steps[name] = float(value.item() if isinstance(value, Tensor) else value)
    first = names.trainable[0]
    for name, s in steps.items():
        if s != steps[first]:
            raise IncompatibleCheckpointError(
                f"{where}: parameters {first!r} and {name!r} have taken {steps[first]:g} and {s:g} steps: fzero "
                "keeps one update count"
            )
    count = steps[first]
    if count < 0 or count != int(count):
        raise CorruptCheckpointError(f"{where}: {layout.optim}state.{first}.step is {count}, not an update count")
    return int(count)


def import_dcp(
    dcp_dir: str | os.PathLike[str],
    ckpt_dir: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    config: dict[str, Any] | None = None,
    tag: str | None = None,
) -> Path:
    """Write the DCP checkpoint `dcp_dir` (an FSDP2 run's, any world size) as an fzero checkpoint under `ckpt_dir`.

    Args:
      dcp_dir: the directory `dcp.save` wrote.
      ckpt_dir: the fzero checkpoint root to write (`ckpt_dir/<tag>/` and `ckpt_dir/latest`).
      model: the module the run trained (its values are not used): its names tell parameters (trainable or frozen)
        from buffers, its tied weights and non-persistent buffers; every key must match it. Without it the model
        is rebuilt from the checkpoint's names and shapes: parameters with optimizer state are trainable, the
        model's other tensors buffers (pass the model when it has frozen or tied parameters).
      config: the DeepSpeed-style config to build the state with (default: AdamW or Adam, as the param groups say,
        with their hyper-parameters and torch's arithmetic, `torch_adam: true`).
      tag: the checkpoint's tag (default ``global_step<N>``, N the update count).

    Returns:
      The fzero checkpoint's path, for `engine.load_checkpoint` / `fzero.load` at any world size and stage.

    Raises:
      fzero.checkpoint.CheckpointError: see the module docstring; nothing is written then.
    """
    where = Path(dcp_dir)
    ds, volatile = _read(where, model, config)
    return _write(ds, volatile, config, ckpt_dir, tag)


def _read(
    where: Path, model: nn.Module | None, config: dict[str, Any] | None
) -> tuple[DeepSpeedState, dict[str, Tensor]]:
    """The DCP checkpoint checked against the model and read: as the record `import_deepspeed`'s helpers take, and
    the model's non-persistent buffers."""
    metadata = read_metadata(where)
    entries = metadata.state_dict_metadata
    layout = find_layout(metadata, where)
    names = _from_module(model) if model is not None else _from_layout(layout)
    if not names.trainable:
        raise IncompatibleCheckpointError(f"{where}: the model has no trainable parameter")
    _check(layout, names, entries, where)
    model_keys = [layout.model + n for n in (*names.trainable, *names.frozen, *names.buffers)]
    state_keys = [f"{layout.optim}state.{n}.{f}" for n in names.trainable for f in layout.fields[n]]
    pg = f"{layout.optim}param_groups."
    group_keys = [k for k in entries if k.startswith(pg) and k[len(pg) :].rpartition(".")[2] in _HYPERS]
    values = read_values(where, metadata, [*model_keys, *state_keys, *group_keys])
    groups = _groups(values, layout, names, where)
    count = _count(values, layout, names, where)
    cfg = _built_config(groups, where, given=config is not None)
    client_state = {"from_dcp": {"layout": layout.name, **scalars(metadata, layout, where)}}
    check_json(client_state, "client_state")

    def tensor(name: str) -> Tensor:
        t = values.pop(layout.model + name)  # (dropped as taken: the state is held once)
        want = names.dtypes.get(name, t.dtype)  # with a module: its dtype (the state must be that model's)
        return t.to(want) if t.is_floating_point() and want.is_floating_point else t

    moments = {f: {n: values.pop(f"{layout.optim}state.{n}.{f}") for n in names.trainable} for f in ADAM_FIELDS[1:]
               if all(f in layout.fields[n] for n in names.trainable)}  # fmt: skip
    ds = DeepSpeedState(
        path=where, stage=0, world=1,
        params={n: tensor(n) for n in names.trainable}, moments=moments, step=count,
        frozen={n: tensor(n) for n in names.frozen}, buffers={n: tensor(n) for n in names.buffers},
        shared=dict(names.shared), groups=[list(g["params"]) for g in groups],
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in groups], order=names.order,
        loss_scaler={}, counters={"global_steps": count, "global_samples": count, "skipped_steps": 0},
        lr_scheduler=None, client_state=client_state, config=cfg, version=torch.__version__,
    )  # fmt: skip
    return ds, names.volatile


def _write(
    ds: DeepSpeedState,
    volatile: dict[str, Tensor],
    config: dict[str, Any] | None,
    ckpt_dir: str | os.PathLike[str],
    tag: str | None,
) -> Path:
    """A one-rank stage-0 engine holding `ds`, saved with `engine.save_checkpoint` (as `import_deepspeed` does)."""
    skeleton = skeleton_module(ds)
    for name, value in volatile.items():  # in no checkpoint, but the layout lists them
        module, (*owners, leaf) = skeleton, name.split(".")
        for part in owners:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, value, persistent=False)
    named = dict(skeleton.named_parameters())
    params = [{"params": [named[n] for n in names], "lr": float(h["lr"]), "eps": float(h["eps"]),
               "betas": tuple(float(b) for b in h["betas"]), "weight_decay": float(h["weight_decay"])}
              for names, h in zip(ds.groups, ds.param_groups, strict=True)]  # fmt: skip
    count = ds.step
    try:
        engine, *_ = initialize(model=skeleton, model_parameters=params, config=one_rank_config(ds, config),
                                mesh=SimMesh(1), printer=lambda _: None)  # fmt: skip
        counters = EngineCounters(global_steps=count, global_samples=count * engine.config.train_batch_size,
                                  micro_steps=count * engine.config.gas, skipped_steps=0, applied=count)  # fmt: skip
        state = state_from(engine, ds, counters.micro_steps)
    except (KeyError, ValueError, TypeError) as e:  # the checkpoint's names and shapes do not make one model
        raise IncompatibleCheckpointError(f"{ds.path}: {e}") from None
    engine.restore(state, counters)
    for group, hypers in zip(engine.optimizer.param_groups, ds.param_groups, strict=False):
        group.update({"lr": float(hypers["lr"]), "betas": tuple(float(b) for b in hypers["betas"])})
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state=ds.client_state)
    return Path(ckpt_dir) / (tag or f"global_step{count}")


# ---------------------------------------------------------------------------------------------------------- export
def _adam_prefix(ckpt: Checkpoint) -> str:
    """The optimizer's leaf prefix (``tx_state/shard_update/``): the one with Adam's two moments."""
    prefixes = [k[: -len("exp_avg_sq")] for k in ckpt.entries if k.endswith("/exp_avg_sq")]
    if len(prefixes) != 1 or prefixes[0] + "exp_avg" not in ckpt.entries or prefixes[0] + "count" not in ckpt.entries:
        state = sorted(k for k in ckpt.entries if k.startswith("tx_state/"))
        raise IncompatibleCheckpointError(
            f"{ckpt.path}: no Adam/AdamW optimizer state (leaves .../exp_avg, .../exp_avg_sq, .../count); it has "
            f"{', '.join(state) or 'none'}: only Adam/AdamW states can be written as torch's"
        )
    return prefixes[0]


def _check_boundary(ckpt: Checkpoint) -> None:
    """DCP holds no partial gradients: refuse a checkpoint taken inside an accumulation window."""
    for key in ckpt.entries:
        if key.endswith("/acc") and key[: -len("acc")] + "count" in ckpt.entries:
            held = int(ckpt.value(key[: -len("acc")] + "count"))
            if held:
                raise IncompatibleCheckpointError(
                    f"{ckpt.path}: saved {held} micro-step(s) into a gradient accumulation window ({key}): DCP has no "
                    "place for the partial gradients; export a checkpoint saved at an accumulation boundary"
                )


def _torch_group(h: Mapping[str, Any]) -> dict[str, Any]:
    """Every key the installed torch's Adam/AdamW puts in a param group (so `dcp.load` into any such group finds
    them all), with `h`'s values; `initial_lr` (what LR schedulers add) the base learning rate."""
    decoupled = bool(h.get("decoupled_weight_decay", True))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    kwargs = {k: h[k] for k in ("lr", "eps", "weight_decay", "amsgrad") if k in h}
    if "betas" in h:
        kwargs["betas"] = tuple(float(b) for b in h["betas"])
    group = cls([torch.zeros(1, requires_grad=True)], **kwargs).param_groups[0]
    group = {k: v for k, v in group.items() if k != "params"}
    group["initial_lr"] = float(h.get("initial_lr", group["lr"]))
    return group


def _recorded_hypers(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The optimizer's hyper-parameters an engine checkpoint records (its config's, the engine's current lr)."""
    m = ckpt.manifest
    opt = m.config.get("optimizer") if isinstance(m.config, dict) else None
    if not isinstance(opt, dict):
        return None
    kind = str(opt.get("type", "")).lower()
    if kind not in ADAM_TYPES:
        raise IncompatibleCheckpointError(
            f"{ckpt.path}: optimizer type {opt.get('type')!r}: only Adam/AdamW states can be written as torch's"
        )
    p = opt.get("params") or {}
    decoupled = kind != "adam" or p.get("adam_w_mode", True)
    wd = p.get("weight_decay")
    if wd is None:  # DeepSpeed's default follows the class (fzero.config.optimizers)
        wd = 0.01 if p.get("torch_adam") and kind == "adamw" else 0.0
    h = {"lr": p.get("lr", 1e-3), "betas": p.get("betas", (0.9, 0.999)), "eps": p.get("eps", 1e-8),
         "weight_decay": wd, "amsgrad": bool(p.get("amsgrad", False)),
         "decoupled_weight_decay": bool(decoupled)}  # fmt: skip
    h["initial_lr"] = h["lr"]
    record = (m.user_state or {}).get("engine") if isinstance(m.user_state, dict) else None
    saved = record.get("param_groups") if isinstance(record, dict) else None
    if saved:
        if any(g != saved[0] for g in saved):
            raise IncompatibleCheckpointError(
                f"{ckpt.path}: {len(saved)} param groups with different hyper-parameters, whose members the "
                "checkpoint does not record: pass hypers=[{'params': [names], 'lr': ...}, ...]"
            )
        h.update({k: v for k, v in saved[0].items() if k in ("lr", "betas")})
    return h


def _param_groups(ckpt: Checkpoint, hypers: Any, trainable: list[str]) -> list[dict[str, Any]]:
    """The torch param groups to write: `hypers` (one mapping, or groups with `params`), else the recorded ones."""
    if hypers is None:
        hypers = _recorded_hypers(ckpt)
        if hypers is None:
            raise IncompatibleCheckpointError(
                f"{ckpt.path}: records no optimizer hyper-parameters (a plain fzero.save, without an engine config): "
                "pass hypers={'lr': ..., 'betas': ..., 'eps': ..., 'weight_decay': ...} (command line: --lr ...)"
            )
    if isinstance(hypers, Mapping):
        hypers = [{**hypers, "params": trainable}]
    groups, seen = [], set()
    for i, h in enumerate(hypers):
        names = list(h.get("params", ()))
        unknown = [n for n in names if n not in trainable or n in seen]
        if unknown:
            raise IncompatibleCheckpointError(f"hypers[{i}]: {unknown[0]!r} is not a trainable parameter (or twice)")
        if "lr" not in h:  # (torch's default learning rate would pass silently for the run's)
            raise IncompatibleCheckpointError(f"hypers[{i}]: no 'lr': give the learning rate of the next step")
        seen.update(names)
        groups.append({**_torch_group(h), "params": names})
    if seen != set(trainable):
        missing = next(n for n in trainable if n not in seen)
        raise IncompatibleCheckpointError(f"hypers: the trainable parameter {missing!r} is in no group")
    return groups


def export_dcp(
    ckpt_dir: str | os.PathLike[str],
    dcp_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    hypers: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    verify: bool = True,
) -> Path:
    """Write the fzero checkpoint `ckpt_dir` (any world size and stage) as a DCP checkpoint an FSDP2 run loads with
    `get_state_dict`, `dcp.load` and `set_state_dict`, at any world size.

    Written (one process, `no_dist=True`): ``model.<name>`` for every key of `model.state_dict()`;
    ``optim.state.<name>.{step,exp_avg,exp_avg_sq[,max_exp_avg_sq]}``; ``optim.param_groups.<i>.<key>`` (every key
    of the installed torch's AdamW/Adam group, `params` the names) and the same by name,
    ``optim.param_groups.<name>.<key>`` (for `flatten_optimizer_state_dict=True`); ``lr_scheduler.last_epoch`` and
    ``train_state.step``, the update count.

    Args:
      ckpt_dir: an fzero checkpoint directory, or a root (its ``latest``, or `tag`).
      dcp_dir: the DCP directory to create (absent or empty); it appears whole or not at all.
      tag: which checkpoint of the root.
      hypers: torch's param-group values (`lr`, `betas`, `eps`, `weight_decay`, `amsgrad`, `decoupled_weight_decay`,
        `initial_lr`): one mapping for every parameter, or groups each with `params` (names). Default: those an
        engine checkpoint records (its config's optimizer, the engine's current lr and betas).
      verify: check the shard files' sha256 first.

    Returns:
      `dcp_dir`.

    Raises:
      fzero.checkpoint.CheckpointError: see the module docstring; nothing is written then.
    """
    out = Path(dcp_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty directory; DCP files would mix: choose another")
    try:
        opened = Checkpoint(ckpt_dir, tag, verify=verify)
    except CheckpointNotFoundError as e:
        if (Path(ckpt_dir) / METADATA).is_file():
            raise CheckpointNotFoundError(f"{e} (it is a PyTorch DCP checkpoint: see import_dcp)") from None
        raise
    with opened as ckpt:
        prefix = _adam_prefix(ckpt)
        _check_boundary(ckpt)
        lay = ckpt.layout
        trainable = [leaf.name for leaf in lay.leaves]
        groups = _param_groups(ckpt, hypers, trainable)
        count = int(ckpt.value(prefix + "count"))
        fields = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if prefix + "max_exp_avg_sq" in ckpt.entries else [])
        if any(g["amsgrad"] != (len(fields) == 3) for g in groups):
            raise IncompatibleCheckpointError(f"{ckpt.path}: amsgrad in hypers does not match the state's leaves")
        step = torch.tensor(float(count), dtype=torch.float32)  # torch's: a float32 scalar per parameter
        state: dict[str, dict[str, Tensor]] = {n: {"step": step.clone()} for n in trainable}
        for f in fields:
            for name, t in ckpt.named(prefix + f):
                if name in state:  # (tied names follow their parameter: torch keeps the state under the first)
                    state[name][f] = t
        model = consolidate(ckpt.path, verify=False)  # (verified above)
    optim: dict[str, Any] = {"state": state, "param_groups": groups}
    for g in groups:
        for name in g["params"]:
            optim.update({f"param_groups.{name}.{k}": v for k, v in g.items() if k != "params"})
    tree = {"model": model, "optim": optim, "lr_scheduler": {"last_epoch": count}, "train_state": {"step": count}}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        with single_process():
            dcp.save(tree, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        os.replace(tmp, out)  # (onto an empty directory, or none)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    fsync_dir(out.parent if str(out.parent) else ".")
    return out

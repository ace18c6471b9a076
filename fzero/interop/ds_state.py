"""A DeepSpeed ZeRO checkpoint put back together: whole tensors by parameter name, and DeepSpeed's counters.

How DeepSpeed 0.19 lays out the ranks' optimizer partitions (what its `zero_to_fp32.py` undoes):

- stages 1-2: per parameter group, the parameters (in `param_shapes` order, each followed by its
  `param_alignment_paddings` entry when the file has one) are one flat buffer, cut into equal partitions, one per
  rank. `single_partition_of_fp32_groups[g]` is a rank's partition without the final padding; the Adam moments
  (`base_optimizer_state["state"][g]`) are the same partition with it (`group_paddings`, on the last rank).
- stage 3: every parameter is split on its own into `ceil(numel / W)` elements per rank (the last padded); a
  rank's `fp32_flat_groups` (one per sub-group) are its pieces of each parameter one after the other, in
  `param_shapes` order across the groups; the moments (`optimizer_state_dict["state"][j]`) follow the same layout.

Frozen parameters are whole in the model file (stages 0-2) or split as stage 3 splits the others
(`frozen_param_fragments`, one model file per rank). Tied parameters appear once; `shared_params` names the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checkpoint import CorruptCheckpointError, IncompatibleCheckpointError
from .ds_files import load_file, model_files, optim_files

__all__ = ["DeepSpeedState", "read_deepspeed"]

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # Adam's, and AMSGrad's running maximum
# what DeepSpeed itself puts in the model file: everything else there is the caller's client_state
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "autoep_layers", "ds_autotp_universal_checkpoint_metadata",
    "universal_checkpoint_info",
})  # fmt: skip


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint, consolidated.

    Attributes:
      path: the tag directory read.
      stage, world: the ZeRO stage and data-parallel world size it was saved at.
      params: the fp32 master parameters by name (tied ones once, under the name DeepSpeed kept).
      moments: `{"exp_avg": {name: tensor}, "exp_avg_sq": {...}}` (Adam's; and `max_exp_avg_sq` with AMSGrad),
        same names.
      step: the optimizer's update count (Adam's `step`).
      frozen: parameters without gradients, by name. buffers: the module's buffers, by name.
      shared: `{name: the name it is tied to}`.
      groups: per parameter group, the names of its parameters (DeepSpeed's `param_shapes` order).
      param_groups: per group, the base optimizer's hyper-parameters (lr, betas, eps, weight_decay, ...).
      order: every name of the module's state_dict, in the model's own order.
      loss_scaler: the loss scaler's fields (`cur_scale`, and with dynamic scaling `cur_iter`, ...).
      counters: `global_steps`, `global_samples`, `skipped_steps`.
      lr_scheduler: the scheduler's `state_dict()` (None without one).
      client_state: what the caller passed to `save_checkpoint(client_state=...)`.
      config: the DeepSpeed config the run used. version: DeepSpeed's version.
    """

    path: Path
    stage: int
    world: int
    params: dict[str, Tensor]
    moments: dict[str, dict[str, Tensor]]
    step: int
    frozen: dict[str, Tensor]
    buffers: dict[str, Tensor]
    shared: dict[str, str]
    groups: list[list[str]]
    param_groups: list[dict[str, Any]]
    order: list[str]
    loss_scaler: dict[str, Any]
    counters: dict[str, int]
    lr_scheduler: dict[str, Any] | None
    client_state: dict[str, Any]
    config: dict[str, Any]
    version: str


def _need(d: dict[str, Any], key: str, where: Path) -> Any:
    if key not in d:
        raise CorruptCheckpointError(f"{where}: no {key!r} entry (not a DeepSpeed ZeRO checkpoint of version 0.19?)")
    return d[key]


def _shapes(model: dict[str, Any], where: Path) -> list[dict[str, torch.Size]]:
    shapes = _need(model, "param_shapes", where)
    if isinstance(shapes, dict):  # one group saved bare
        shapes = [shapes]
    return [{k: torch.Size(v) for k, v in g.items()} for g in shapes]


def _sliced(flats: list[Tensor], shapes: list[dict[str, torch.Size]], paddings: Any, world: int,
            where: Path) -> dict[str, Tensor]:  # fmt: skip
    """Stages 1-2: each group's whole flat buffer (`flats[g]`) cut into its parameters."""
    out = {}
    align = 2 * world  # DeepSpeed pads each group to a multiple of 2 W (what zero_to_fp32.py checks too)
    for g, (flat, group) in enumerate(zip(flats, shapes, strict=True)):
        offset = 0
        pads = paddings[g] if paddings is not None else [0] * len(group)
        for (name, shape), pad in zip(group.items(), pads, strict=True):
            n = shape.numel()
            if offset + n > flat.numel():
                raise CorruptCheckpointError(
                    f"{where}: group {g} holds {flat.numel()} elements, fewer than its parameters' shapes need "
                    f"({name!r} ends at {offset + n})"
                )
            out[name] = flat.narrow(0, offset, n).view(shape).clone()
            offset += n + pad
        if math.ceil(flat.numel() / align) != math.ceil(offset / align):
            raise CorruptCheckpointError(
                f"{where}: group {g} has {flat.numel() - offset} elements beyond its parameters"
            )
    return out


def _zipped(per_rank: list[Tensor], shapes: list[dict[str, torch.Size]], where: Path) -> dict[str, Tensor]:
    """Stage 3: each parameter's pieces (`ceil(numel / W)` per rank, consecutively in every rank's flat) joined."""
    world, out, offset = len(per_rank), {}, 0
    for name, shape in ((k, v) for group in shapes for k, v in group.items()):
        n = shape.numel()
        part = math.ceil(n / world)
        if offset + part > per_rank[0].numel():
            raise CorruptCheckpointError(f"{where}: the ranks' partitions end before parameter {name!r}")
        out[name] = torch.cat([flat.narrow(0, offset, part) for flat in per_rank])[:n].view(shape).clone()
        offset += part
    if offset != per_rank[0].numel():
        raise CorruptCheckpointError(
            f"{where}: the ranks' partitions hold {per_rank[0].numel()} elements each; the parameters use {offset}"
        )
    return out


def _base_state(osd: dict[str, Any], stage: int, where: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The base optimizer's per-(sub)group states and param_groups, in group order."""
    base = _need(osd, "optimizer_state_dict" if stage == 3 else "base_optimizer_state", where)
    if isinstance(base, list):  # an elastic checkpoint: one plain state per group
        return base, []
    states, groups = _need(base, "state", where), _need(base, "param_groups", where)
    return [states[i] for i in sorted(states)], groups


def _moments_of(states_per_rank: list[list[dict[str, Any]]], where: Path) -> tuple[str, ...]:
    """The moments the states hold (Adam's two, and AMSGrad's maximum when present), every state the same."""
    if not any(states_per_rank):
        raise IncompatibleCheckpointError(
            f"{where}: the optimizer has no state yet (saved before its first update?): nothing to import beyond the "
            "weights; load the weights with load_module_only from a consolidated file instead"
        )
    keys = {frozenset(s) for states in states_per_rank for s in states}
    if len(keys) != 1 or not {"exp_avg", "exp_avg_sq", "step"} <= next(iter(keys)) <= {*MOMENTS, "step"}:
        have = sorted(set().union(*keys))
        raise IncompatibleCheckpointError(
            f"{where}: the optimizer state holds {have}: only Adam/AdamW states (exp_avg, exp_avg_sq, step, and "
            "AMSGrad's max_exp_avg_sq) can be imported"
        )
    return tuple(k for k in MOMENTS if k in next(iter(keys)))


def _step(states_per_rank: list[list[dict[str, Any]]], where: Path) -> int:
    steps = {int(s["step"]) for states in states_per_rank for s in states if "step" in s}
    if len(steps) != 1:
        raise CorruptCheckpointError(f"{where}: the optimizer partitions disagree on the step count ({sorted(steps)})")
    return steps.pop()


def _scaler(osd: dict[str, Any]) -> dict[str, Any]:
    scaler = osd.get("loss_scaler")
    fields = dict(vars(scaler)) if scaler is not None and hasattr(scaler, "__dict__") else {}
    fields["dynamic"] = bool(osd.get("dynamic_loss_scale", fields.get("dynamic", False)))
    return fields


def read_deepspeed(path: Path) -> DeepSpeedState:
    """Read and consolidate the DeepSpeed ZeRO checkpoint in the tag directory `path` (see the module docstring).

    Raises:
      fzero.checkpoint.CheckpointError: a file is missing, unsafe, damaged or inconsistent with the others (the
        subclass and message name it), or the optimizer is not Adam/AdamW.
    """
    mfiles, ofiles = model_files(path), optim_files(path)
    models = [load_file(p) for p in mfiles]
    optims = [_need(load_file(p), "optimizer_state_dict", p) for p in ofiles]
    model, world = models[0], len(optims)
    parallel = model.get("checkpoint_parallel_dimensions") or {}
    if model.get("mp_world_size", 1) != 1 or any(parallel.get(k, 1) != 1 for k in ("pp_degree", "tp_degree")):
        raise IncompatibleCheckpointError(
            f"{mfiles[0]}: saved with tensor or pipeline parallelism (mp_world_size {model.get('mp_world_size')}, "
            f"{parallel}): fzero imports data-parallel ZeRO checkpoints only"
        )
    if not isinstance(model.get("module"), dict):
        raise IncompatibleCheckpointError(f"{mfiles[0]}: holds no module state_dict (a pipeline-parallel checkpoint?)")
    if "zero_stage" not in optims[0] and ofiles[0].name.startswith("bf16_"):
        raise IncompatibleCheckpointError(
            f"{ofiles[0]}: DeepSpeed's BF16_Optimizer (bf16 at stage 0-1 with fp32 gradient accumulation) lays its "
            "partitions out otherwise; importing it is not supported"
        )
    stage = int(_need(optims[0], "zero_stage", ofiles[0]))
    if stage not in (1, 2, 3):
        raise IncompatibleCheckpointError(f"{ofiles[0]}: ZeRO stage {stage}; stages 1, 2 and 3 can be imported")
    saved_world = model.get("dp_world_size", world)
    if saved_world != world:
        raise CorruptCheckpointError(f"{path}: {world} optimizer files, but the run had {saved_world} ranks")
    if stage == 3 and len(models) != world:
        raise CorruptCheckpointError(f"{path}: stage 3 has one model file per rank: {len(models)} for {world} ranks")
    shapes = _shapes(model, mfiles[0])
    bases = [_base_state(o, stage, p) for o, p in zip(optims, ofiles, strict=True)]
    join: Callable[[list[list[Tensor]]], dict[str, Tensor]]
    if stage == 3:
        masters = [torch.cat([t.float().flatten() for t in _need(o, "fp32_flat_groups", p)])
                   for o, p in zip(optims, ofiles, strict=True)]  # fmt: skip
        params = _zipped(masters, shapes, path)

        def join(per_rank: list[list[Tensor]]) -> dict[str, Tensor]:
            return _zipped([torch.cat(groups) for groups in per_rank], shapes, path)
    else:
        parts = [[t.float().flatten() for t in _need(o, "single_partition_of_fp32_groups", p)]
                 for o, p in zip(optims, ofiles, strict=True)]  # fmt: skip
        paddings = optims[0].get("param_alignment_paddings")
        params = _sliced([torch.cat(g) for g in zip(*parts, strict=True)], shapes, paddings, world, path)

        def join(per_rank: list[list[Tensor]]) -> dict[str, Tensor]:
            # the moments carry the final padding the fp32 partitions were saved without
            lean = [
                [m[: p.numel()] for m, p in zip(ms, ps, strict=True)] for ms, ps in zip(per_rank, parts, strict=True)
            ]
            return _sliced([torch.cat(g) for g in zip(*lean, strict=True)], shapes, paddings, world, path)

    states = [b[0] for b in bases]
    moments = {key: join([[st[key].float().flatten() for st in s] for s in states])
               for key in _moments_of(states, path)}  # fmt: skip
    module = model["module"]  # (a dict: checked above)
    buffer_names = model.get("buffer_names", [])
    shared = dict(model.get("shared_params") or {})
    frozen_shapes = {k: torch.Size(v) for k, v in (model.get("frozen_param_shapes") or {}).items()}
    if model.get("frozen_param_shapes") is None and stage < 3:  # stage 1 records none: what the module has beyond
        frozen_shapes = {k: v.shape for k, v in module.items() if k not in params and k not in buffer_names
                         and k not in shared}  # fmt: skip
    if stage == 3 and frozen_shapes:
        frozen = _zipped([torch.cat([m["frozen_param_fragments"][k].flatten() for k in frozen_shapes]) for m in models],
                         [frozen_shapes], path)  # fmt: skip
    else:
        frozen = {k: module[k].clone() if k in module else model["frozen_param_fragments"][k] for k in frozen_shapes}
    ds_config = model.get("ds_config") or {}
    return DeepSpeedState(
        path=path,
        stage=stage,
        world=world,
        params=params,
        moments=moments,
        step=_step(states, path),
        frozen=frozen,
        buffers={k: module[k].clone() for k in buffer_names if k in module},
        shared=shared,
        groups=[list(g) for g in shapes],
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in bases[0][1]],
        order=list(module),
        loss_scaler=_scaler(optims[0]),
        counters={k: int(model.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")},
        lr_scheduler=model.get("lr_scheduler"),
        client_state={k: v for k, v in model.items() if k not in _ENGINE_KEYS},
        config=ds_config,
        version=str(model.get("ds_version", "unknown")),
    )

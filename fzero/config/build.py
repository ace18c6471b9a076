"""From a validated DeepSpeed config to fzero's pieces: the optimizer, its LR schedule, the precision policy, the
loss scale, and the ZeRO preset chain.

| DeepSpeed | fzero |
|---|---|
| `optimizer.type` Adam (`adam_w_mode` true, the default), AdamW | `fzero.adamw(fused=True)` |
| `optimizer.type` Adam with `adam_w_mode: false` | `fzero.adam(fused=True)` (L2 weight decay) |
| `optimizer.params.torch_adam` | torch.optim.AdamW's default weight decay (0.01); no C kernel under offload |
| param groups (`model_parameters` dicts, a client optimizer's groups) | `fzero.param_groups(groups=...)` |
| `optimizer.params.bias_correction: false` (Adam, AdamW, Lamb) | the optimizer's `bias_correction=False` |
| `optimizer.type` SGD | `fzero.sgd` |
| `optimizer.type` Lamb | `fzero.lamb` (FusedLamb's arithmetic; the trust ratio per parameter tensor at every stage) |
| `optimizer.type` Lion | `fzero.lion` (`fzero.cpu_lion` where the master weights are on the CPU) |
| `optimizer.type` Adagrad | `fzero.adagrad` (`fzero.cpu_adagrad` where the master weights are on the CPU) |
| `prescale_gradients`, `gradient_predivide_factor` | the presets' `average=fzero.Average(...)` |
| `scheduler` WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle | `fzero.optim.schedules` (lr, and beta1 for OneCycle) |
| `zero_optimization.stage` 0-3 | `fzero.zero0` .. `zero3` |
| `fp16` / `bf16` | `precision="fp16"` / `"bf16"` (+ `communication_data_type`, `data_types.grad_accum_dtype`) |
| `torch_autocast` | the engine's autocast, `Policy.reduce_overrides`, `TorchGradScale` (`fzero.config.autocast`) |
| `fp16.loss_scale` 0 (dynamic) / > 0 | `DynamicLossScale.create(...)` / a static scale |
| `bf16.check_grad_overflow` | `skip_nonfinite` |
| `bf16.bf16_master_weights_and_grads` (+ `bf16_optimizer_states`) | bf16 `param_dtype`, `accum_dtype`; `stored_in` |
| `gradient_clipping` | `clip` |
| `zero_optimization.offload_optimizer.device: cpu` | `shard_update(..., offload="cpu")` with the CPU Adam |
| `zero_optimization.offload_optimizer.device: nvme` | `offload=Offload("nvme", path=...)`, CPU Adam |
| stage 3, `zero_hpz_partition_size: N` > 1 (ZeRO++ hpZ) | `zero3(hpz=True)` on a `(W / N, N)` mesh |
| stage 3, `zero_quantized_weights` | `zero3(qwz=True, qwz_frozen=True)` (every gather int8) |
| stage 3, `zero_quantized_nontrainable_weights` | `zero3(qwz_frozen=True)` (frozen parameters' gathers) |
| stage 3, `zero_quantized_gradients` (qgZ), several nodes | `zero3(qgz=("replicate", "shard"))`: int8 across nodes |
| stage 3, `mics_shard_size: S` > 0 (MiCS) | `zero3(hybrid=True)` on a `(W / S, S)` mesh; S == W: the 1-D preset |
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import optim
from ..host import accelerator
from ..optim import Hyper, Optimizer, hyper_value
from ..sharding.units import GatherPolicy
from ..state.loss_scale import DynamicLossScale
from ..state.precision import Policy, get_policy
from ..transforms import Average, Transform, zero0, zero1, zero2, zero3
from . import Config, ConfigError
from .autocast import autocast_loss_scale
from .optimizers import OPTIMIZERS, optimizer_type
from .zeropp import zeropp_arguments

__all__ = [
    "GroupSpec",
    "OptimizerSpec",
    "build_optimizer",
    "build_policy",
    "build_schedule",
    "build_schedules",
    "build_transform",
    "optimizer_kind",
    "optimizer_spec",
    "scheduled",
]

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}  # fmt: skip
PRESETS = {0: zero0, 1: zero1, 2: zero2, 3: zero3}


@dataclass(frozen=True)
class GroupSpec:
    """One param group of the optimizer: its trainable parameters' names and every hyper-parameter it uses (the
    optimizer's keywords; `lr` and Adam's `betas` may be schedules)."""

    names: tuple[str, ...]
    hypers: dict[str, Any]


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer the config (or a client optimizer) asks for, before it is built.

    Attributes:
      kind: the fzero optimizer (`fzero.config.optimizers.optimizer_type(kind)` is its row of the table): "adamw",
        "adam", "sgd", "lamb", "lion", "adagrad" or "muon".
      lr: the learning rate: a number, or a function of the number of applied updates (a schedule).
      hypers: the other hyper-parameters a param group may set, as keywords of the optimizer (`betas` may hold a
        schedule for beta1).
      base_lr: the configured learning rate before any schedule.
      groups: the param groups, when there are several (`lr` and `hypers` are then the optimizer's defaults, which
        no parameter uses: every trainable parameter is in a group).
      torch_adam: DeepSpeed's `torch_adam`: torch's Adam arithmetic, so no C kernel under offload.
      options: keywords of the optimizer that hold for every group (`bias_correction`, `eps_inside_sqrt`).
    """

    kind: str
    lr: Hyper
    hypers: dict[str, Any]
    base_lr: float
    groups: tuple[GroupSpec, ...] | None = None
    torch_adam: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def per_group(self) -> list[dict[str, Any]]:
        """Every group's hyper-parameters (`lr` included), in order; one entry without groups."""
        if self.groups is None:
            return [{"lr": self.lr, **self.hypers}]
        return [dict(g.hypers) for g in self.groups]

    def with_per_group(self, hypers: Sequence[dict[str, Any]]) -> OptimizerSpec:
        """This spec with each group's hyper-parameters replaced (e.g. its lr by a schedule)."""
        if len(hypers) != len(self.per_group()):
            raise ValueError(f"expected {len(self.per_group())} groups' hyper-parameters, got {len(hypers)}")
        if self.groups is None:
            h = dict(hypers[0])
            return replace(self, lr=h.pop("lr"), hypers=h)
        return replace(
            self, groups=tuple(GroupSpec(g.names, dict(h)) for g, h in zip(self.groups, hypers, strict=True))
        )

    def build(self, offload: bool = False, cpu: bool = False) -> Optimizer:
        """The optimizer with its param groups (`fzero.param_groups`): Adam, AdamW, Lion and Adagrad run the
        native fused kernel (`fzero.cpu_adam(w)`, `cpu_lion`, `cpu_adagrad`, as DeepSpeed runs its CPU optimizers)
        where the master weights live on the CPU (`offload`, or `cpu`: a CPU run), and Adam and AdamW torch's fused
        kernel where they live on a GPU (`adamw(fused=True)`, as DeepSpeed runs its FusedAdam there), unless
        `torch_adam` asks for torch's operations."""
        name, kw, row = self.kind, dict(self.options), optimizer_type(self.kind)
        if not self.torch_adam and row.fused:
            kw["fused"] = True  # (the kernel follows the master weights' device, update by update)
        elif (offload or cpu) and not self.torch_adam and row.native:
            name = f"cpu_{name}"
        groups = None
        if self.groups is not None:
            groups = optim.param_groups(groups=[(g.names, g.hypers) for g in self.groups], missing="error")
        return getattr(optim, name)(lr=self.lr, **self.hypers, **kw, groups=groups)


def _per_group(p: dict[str, Any], key: str, n: int, path: str) -> list[Any]:
    """A scheduler parameter for each of `n` groups: a list of `n`, or one value for all (DeepSpeed's
    `_format_param`, whose error this is)."""
    value = p[key]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(
                f"{path}.{key}",
                f"expected {n} value{'s' if n != 1 else ''} (one per param group, as DeepSpeed's scheduler checks), "
                f"got a list of {len(value)}",
            )
        return list(value)
    return [value] * n


def build_schedules(
    cfg: Config, base_lrs: Sequence[float], betas: bool = True
) -> tuple[list[Hyper], list[Hyper] | None]:
    """The configured LR schedule of every param group (functions of applied updates) and, for OneCycle with
    momentum cycling, every group's beta1 schedule; `(base_lrs, None)` without a `scheduler` block.

    As DeepSpeed 0.19's schedulers (`runtime/lr_schedules.py`) treat several groups: `warmup_min_lr`,
    `warmup_max_lr`, `cycle_min_lr`, `cycle_max_lr`, `cycle_min_mom`, `cycle_max_mom` are one value for every group
    or a list with one per group; `WarmupLR`'s (and `WarmupDecayLR`'s) `warmup_max_lr: null` is each group's own lr;
    `WarmupCosineLR` scales each group's own lr; OneCycle ignores the groups' lrs. Without betas (SGD) OneCycle's
    momentum cycling is off, with a warning, as in DeepSpeed.

    Args:
      cfg: the validated config.
      base_lrs: each group's learning rate before any schedule.
      betas: whether the optimizer has Adam's betas (OneCycle cycles beta1).

    Raises:
      ConfigError: a per-group list whose length is not the number of groups, naming the key.
    """
    block = cfg["scheduler"]
    n = len(base_lrs)
    if block is None:
        return list(base_lrs), None
    kind, p = block["type"], dict(block["params"])
    p.pop("last_batch_iteration")
    path = "scheduler.params"
    if kind in ("WarmupLR", "WarmupDecayLR"):
        lows = _per_group(p, "warmup_min_lr", n, path)
        highs = list(base_lrs) if p["warmup_max_lr"] is None else _per_group(p, "warmup_max_lr", n, path)
        rest = {k: p[k] for k in ("warmup_num_steps", "warmup_type")}
        if kind == "WarmupLR":
            return [optim.warmup_lr(lo, hi, **rest) for lo, hi in zip(lows, highs, strict=True)], None
        return [
            optim.warmup_decay_lr(p["total_num_steps"], lo, hi, **rest) for lo, hi in zip(lows, highs, strict=True)
        ], None
    if kind == "WarmupCosineLR":
        return [optim.warmup_cosine_lr(lr=base, **p) for base in base_lrs], None
    cycle = {k: p[k] for k in ("cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
                               "cycle_second_stair_count", "decay_step_size")}  # fmt: skip
    lows, highs = _per_group(p, "cycle_min_lr", n, path), _per_group(p, "cycle_max_lr", n, path)
    lrs: list[Hyper] = [
        optim.one_cycle(lo, hi, p["decay_lr_rate"], **cycle) for lo, hi in zip(lows, highs, strict=True)
    ]
    if not p["cycle_momentum"]:
        return lrs, None
    if not betas:  # DeepSpeed disables OneCycle's momentum cycling for optimizers without betas
        warnings.warn("scheduler.params.cycle_momentum is ignored with an optimizer without betas (SGD, Muon), as in "
                      "DeepSpeed", stacklevel=3)  # fmt: skip
        return lrs, None
    lows, highs = _per_group(p, "cycle_min_mom", n, path), _per_group(p, "cycle_max_mom", n, path)
    return lrs, [
        optim.one_cycle_momentum(lo, hi, p["decay_mom_rate"], **cycle) for lo, hi in zip(lows, highs, strict=True)
    ]


def build_schedule(cfg: Config, base_lr: float) -> tuple[Hyper, Hyper | None]:
    """`build_schedules` for one param group."""
    lrs, moms = build_schedules(cfg, [base_lr])
    return lrs[0], None if moms is None else moms[0]


def scheduled(spec: OptimizerSpec, cfg: Config) -> OptimizerSpec:
    """`spec` with the config's scheduler on every group (DeepSpeed builds it on whatever optimizer it has, the
    config's or a client's), on each of the optimizer's learning rates (Muon's two halves: DeepSpeed schedules them
    as two param groups, Muon's then Adam's); OneCycle's momentum cycling sets Adam's `betas` to `(beta1 schedule,
    0.99)`. Without a `scheduler` block, `spec` itself."""
    if cfg["scheduler"] is None:
        return spec
    keys, groups = optimizer_type(spec.kind).lrs, spec.per_group()
    lists = any(isinstance(v, list) for v in cfg["scheduler"]["params"].values())
    if len(keys) > 1 and spec.groups is not None and lists:
        raise ConfigError("scheduler.params", "per-group lists with Muon's param groups are not supported "
                          "(DeepSpeed counts a half only where the group has such parameters)")  # fmt: skip
    bases = [hyper_value(h[k], 0) for h in groups for k in keys]
    lrs, moms = build_schedules(cfg, bases, betas="betas" in groups[0])
    out = []
    for i, h in enumerate(groups):
        h = {**h, **{k: lrs[len(keys) * i + j] for j, k in enumerate(keys)}}
        if moms is not None:
            h["betas"] = (moms[len(keys) * i], 0.99)  # DeepSpeed's OneCycle sets beta2 to 0.99
        out.append(h)
    return spec.with_per_group(out)


def optimizer_kind(cfg: Config) -> str | None:
    """Which fzero optimizer the config's `optimizer` block is: "adamw", "adam", "sgd", "lamb", "lion", "adagrad" or
    "muon" (None without one)."""
    block = cfg["optimizer"]
    if block is None:
        return None
    return OPTIMIZERS[block["type"]].kind_for(block["params"].get("adam_w_mode", True))


def optimizer_spec(
    cfg: Config, groups: Sequence[tuple[Sequence[str], Mapping[str, Any]]] | None = None, *, schedule: bool = True
) -> OptimizerSpec | None:
    """The config's `optimizer` (with its schedule), or None without an `optimizer` block.

    Args:
      cfg: the validated config.
      groups: param groups, as `(trainable parameter names, {hyper: value})`, the values overriding the config's
        (torch's and DeepSpeed's rule: a group's keys override the optimizer's arguments); None: one group.
      schedule: apply the config's `scheduler` (False: the constant hyper-parameters, e.g. for a client scheduler).

    Raises:
      KeyError: a group sets a key that is not a hyper-parameter of this optimizer.
      ConfigError: a scheduler's per-group list does not match the groups.
    """
    kind = optimizer_kind(cfg)
    if kind is None:
        return None
    row = OPTIMIZERS[cfg["optimizer"]["type"]]
    if row.mup:
        raise ConfigError("optimizer.type", f"{cfg['optimizer']['type']} scales each parameter's lr by its width "
                          "multiplier (mup.set_base_shapes on the model): build it with fzero.initialize")  # fmt: skip
    p = cfg["optimizer"]["params"]
    lr, hypers, options = row.config_hypers(p, kind)
    spec = OptimizerSpec(kind, lr, hypers, lr, torch_adam=p.get("torch_adam", False), options=options)
    if groups is not None and len(groups) > 1:
        base = spec.per_group()[0]
        allowed = set(base)  # the optimizer's keywords (`group_hypers` translated DeepSpeed's names)
        specs = []
        for names, given in groups:
            over = row.group_hypers(given)
            unknown = sorted(set(over) - allowed)
            if unknown:
                raise KeyError(f"a param group sets {', '.join(unknown)}: not hyper-parameters of {kind}")
            specs.append(GroupSpec(tuple(names), {**base, **over}))
        spec = replace(spec, groups=tuple(specs))
    elif groups:
        spec = spec.with_per_group([{**spec.per_group()[0], **row.group_hypers(groups[0][1])}])
    return scheduled(spec, cfg) if schedule else spec


def build_optimizer(cfg: Config) -> Optimizer | None:
    """The config's optimizer with its schedule, or None without an `optimizer` block."""
    spec = optimizer_spec(cfg)
    return None if spec is None else spec.build(offload=cfg.offload, cpu=accelerator.name() == "cpu")


def build_policy(cfg: Config) -> Policy:
    """The precision policy: `fp16` / `bf16` / the model's dtype, with `communication_data_type` and
    `data_types.grad_accum_dtype` overriding the reduce and accumulation dtypes."""
    policy = get_policy(None if cfg.precision == "fp32" else cfg.precision)
    if cfg["bf16"]["bf16_master_weights_and_grads"]:  # bf16 master weights, their gradients accumulated in bf16
        policy = replace(policy, param_dtype=torch.bfloat16, accum_dtype=torch.bfloat16)
    reduce, accum = cfg["communication_data_type"], cfg["data_types"]["grad_accum_dtype"]
    if reduce is not None:
        policy = replace(policy, reduce_dtype=_DTYPES[reduce])
    if accum is not None:
        policy = replace(policy, accum_dtype=_DTYPES[accum])
    return policy


def build_gather_policy(cfg: Config) -> GatherPolicy:
    """The per-unit collectives' schedule from DeepSpeed's knobs: a prefetch bucket of 0 disables prefetching
    (otherwise one unit ahead), `stage3_max_live_parameters` bounds the gathered elements,
    `stage3_param_persistence_threshold` keeps small units gathered for the whole step, `stage3_max_reuse_distance`
    keeps units gathered from their forward into their backward (DeepSpeed's rule; unset, 0, not DeepSpeed's 1e9,
    which holds a small model's every unit gathered at the forward's end: stage 3 saves memory out of the box);
    `overlap_comm` overlaps each unit's reduction with the backward, at most `reduce_bucket_size` elements in flight
    (unset: decided for the mesh by `fzero.sharding.units.overlap_pays`, on for several processes; DeepSpeed's
    default is on at stage 3 only)."""
    zero = cfg["zero_optimization"]
    overlap = zero["overlap_comm"]
    return GatherPolicy(
        prefetch=1 if zero["stage3_prefetch_bucket_size"] > 0 else 0,
        max_live_elements=max(1, int(zero["stage3_max_live_parameters"])),
        persistence_threshold=int(zero["stage3_param_persistence_threshold"]),
        reuse_distance=int(zero["stage3_max_reuse_distance"] or 0),
        overlap_reduce=None if overlap is None else bool(overlap),
        reduce_bucket_elements=int(zero["reduce_bucket_size"]),
    )


def build_loss_scale(cfg: Config) -> Any:
    """The `loss_scale` argument of the presets: DeepSpeed's dynamic scaler or a static scale under fp16, a
    `torch.amp.GradScaler`'s under an fp16 `torch_autocast` (`fzero.config.autocast`), None (no scaling) otherwise."""
    fp16 = cfg["fp16"]
    if cfg["torch_autocast"]["enabled"]:  # a torch.amp.GradScaler's scale under an fp16 autocast, else none
        return autocast_loss_scale(cfg)
    if not fp16["enabled"]:
        return None
    if fp16["loss_scale"] != 0:
        return float(fp16["loss_scale"])
    return DynamicLossScale.create(
        initial_scale_power=fp16["initial_scale_power"],
        loss_scale_window=fp16["loss_scale_window"],
        hysteresis=fp16["hysteresis"],
        consecutive_hysteresis=fp16["consecutive_hysteresis"],
        min_loss_scale=float(fp16["min_loss_scale"]),
    )


def build_transform(cfg: Config, optimizer: Optimizer, policy: Policy | None = None) -> Transform:
    """The ZeRO preset chain the config describes, around `optimizer`.

    Without optimizer offload this is exactly `fzero.zero{stage}(optimizer, accumulate=gas, precision=...,
    loss_scale=..., clip=..., skip_nonfinite=...)`, so the engine and a functional `train_step` built from the same
    preset compute the same values. `offload_optimizer.device: cpu` is the preset's `offload="cpu"`, `nvme` its
    `offload=fzero.Offload("nvme", path=nvme_path, ...)`. At stage 3 the ZeRO++ and MiCS keys add
    `zeropp_arguments(cfg)`; where `zero_mesh_shape(cfg)` is 2-D the chain must run on a mesh of that shape
    (`fzero.initialize` builds it). `policy` replaces `build_policy(cfg)` (the engine's, which under `torch_autocast`
    names the parameters reduced in the autocast dtype: `fzero.config.autocast.autocast_policy`).
    """
    policy = build_policy(cfg) if policy is None else policy
    if cfg["bf16"]["bf16_master_weights_and_grads"]:  # float32 arithmetic, bf16 storage (DeepSpeed's CPU Adam's)
        states = torch.bfloat16 if cfg["bf16"]["bf16_optimizer_states"] else None
        optimizer = optim.stored_in(optimizer, torch.bfloat16, states)
    loss_scale = build_loss_scale(cfg)
    clip = cfg.gradient_clipping or None
    skip = cfg["bf16"]["check_grad_overflow"] if cfg.precision == "bf16" else True
    average = Average(cfg["prescale_gradients"], float(cfg["gradient_predivide_factor"]))
    return PRESETS[cfg.stage](
        optimizer,
        average=None if average.is_default else average,
        accumulate=cfg.gas,
        precision=policy,
        loss_scale=loss_scale,
        clip=clip,
        skip_nonfinite=skip,
        offload=cfg.offload_policy,
        **zeropp_arguments(cfg),
    )

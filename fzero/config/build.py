"""From a validated DeepSpeed config to fzero's pieces: the optimizer, its LR schedule, the precision policy, the
loss scale, and the ZeRO preset chain.

| DeepSpeed | fzero |
|---|---|
| `optimizer.type` Adam (`adam_w_mode` true, the default), AdamW | `fzero.adamw` |
| `optimizer.type` Adam with `adam_w_mode: false` | `fzero.adam` (L2 weight decay) |
| `optimizer.type` SGD | `fzero.sgd` |
| `scheduler` WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle | `fzero.optim.schedules` (lr, and beta1 for OneCycle) |
| `zero_optimization.stage` 0-3 | `fzero.zero0` .. `zero3` |
| `fp16` / `bf16` | `precision="fp16"` / `"bf16"` (+ `communication_data_type`, `data_types.grad_accum_dtype`) |
| `fp16.loss_scale` 0 (dynamic) / > 0 | `DynamicLossScale.create(...)` / a static scale |
| `bf16.check_grad_overflow` | `skip_nonfinite` |
| `gradient_clipping` | `clip` |
| `zero_optimization.offload_optimizer.device: cpu` | `shard_update(..., offload="cpu")` with the CPU Adam |
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import optim
from ..loss_scale import DynamicLossScale
from ..optim import Hyper, Optimizer
from ..precision import Policy, get_policy
from ..stage3 import GatherPolicy
from ..transforms import (
    Transform,
    zero0,
    zero1,
    zero2,
    zero3,
)
from . import Config

__all__ = ["OptimizerSpec", "build_optimizer", "build_policy", "build_schedule", "build_transform"]

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}  # fmt: skip
PRESETS = {0: zero0, 1: zero1, 2: zero2, 3: zero3}


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer the config asks for, before it is built.

    Attributes:
      kind: "adamw", "adam" or "sgd".
      lr: the learning rate: a number, or a function of the number of applied updates (a schedule).
      hypers: the other hyper-parameters, as keywords of `fzero.adamw` / `adam` / `sgd` (`betas` may hold a
        schedule for beta1).
      base_lr: the configured learning rate before any schedule.
    """

    kind: str
    lr: Hyper
    hypers: dict[str, Any]
    base_lr: float

    def build(self, offload: bool = False) -> Optimizer:
        """The optimizer (the CPU Adam where the build has one and `offload` asks for it)."""
        name = self.kind
        if offload and name in ("adam", "adamw") and hasattr(optim, f"cpu_{name}"):
            name = f"cpu_{name}"
        return getattr(optim, name)(lr=self.lr, **self.hypers)


def build_schedule(cfg: Config, base_lr: float) -> tuple[Hyper, Hyper | None]:
    """The configured LR schedule (a function of applied updates) and, for OneCycle with momentum cycling, the
    beta1 schedule; `(base_lr, None)` without a `scheduler` block."""
    block = cfg["scheduler"]
    if block is None:
        return base_lr, None
    kind, p = block["type"], dict(block["params"])
    p.pop("last_batch_iteration")
    if kind in ("WarmupLR", "WarmupDecayLR") and p["warmup_max_lr"] is None:
        p["warmup_max_lr"] = base_lr  # DeepSpeed 0.19's WarmupLR (and WarmupDecayLR through it): the optimizer's lr
    if kind == "WarmupLR":
        return optim.warmup_lr(**p), None
    if kind == "WarmupDecayLR":
        return optim.warmup_decay_lr(**p), None
    if kind == "WarmupCosineLR":
        return optim.warmup_cosine_lr(lr=base_lr, **p), None
    cycle = {k: p[k] for k in ("cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
                               "cycle_second_stair_count", "decay_step_size")}  # fmt: skip
    lr = optim.one_cycle(p["cycle_min_lr"], p["cycle_max_lr"], p["decay_lr_rate"], **cycle)
    if not p["cycle_momentum"]:
        return lr, None
    mom = optim.one_cycle_momentum(p["cycle_min_mom"], p["cycle_max_mom"], p["decay_mom_rate"], **cycle)
    return lr, mom


def optimizer_spec(cfg: Config) -> OptimizerSpec | None:
    """The config's `optimizer` (with its schedule), or None without an `optimizer` block."""
    block = cfg["optimizer"]
    if block is None:
        return None
    kind, p = block["type"], block["params"]
    lr, mom = build_schedule(cfg, p["lr"])
    if kind == "SGD":
        if mom is not None:  # DeepSpeed disables OneCycle's momentum cycling for optimizers without betas
            warnings.warn(
                "scheduler.params.cycle_momentum is ignored with SGD (no betas), as in DeepSpeed", stacklevel=3
            )
        hypers = {k: p[k] for k in ("momentum", "dampening", "weight_decay", "nesterov")}
        return OptimizerSpec("sgd", lr, hypers, p["lr"])
    betas: tuple[Any, Any] = (p["betas"][0], p["betas"][1])
    if mom is not None:
        betas = (mom, 0.99)  # DeepSpeed's OneCycle sets beta2 to 0.99
    decoupled = kind == "AdamW" or p["adam_w_mode"]
    hypers = {"betas": betas, "eps": p["eps"], "weight_decay": p["weight_decay"]}
    return OptimizerSpec("adamw" if decoupled else "adam", lr, hypers, p["lr"])


def build_optimizer(cfg: Config) -> Optimizer | None:
    """The config's optimizer with its schedule, or None without an `optimizer` block."""
    spec = optimizer_spec(cfg)
    return None if spec is None else spec.build(offload=cfg.offload)


def build_policy(cfg: Config) -> Policy:
    """The precision policy: `fp16` / `bf16` / the model's dtype, with `communication_data_type` and
    `data_types.grad_accum_dtype` overriding the reduce and accumulation dtypes."""
    policy = get_policy(None if cfg.precision == "fp32" else cfg.precision)
    reduce, accum = cfg["communication_data_type"], cfg["data_types"]["grad_accum_dtype"]
    if reduce is not None:
        policy = replace(policy, reduce_dtype=_DTYPES[reduce])
    if accum is not None:
        policy = replace(policy, accum_dtype=_DTYPES[accum])
    return policy


def build_gather_policy(cfg: Config) -> GatherPolicy:
    """Stage 3's unit gathering from DeepSpeed's knobs: a prefetch bucket of 0 disables prefetching (otherwise one
    unit ahead), `stage3_max_live_parameters` bounds the gathered elements, `stage3_param_persistence_threshold`
    keeps small units gathered for the whole step."""
    zero = cfg["zero_optimization"]
    return GatherPolicy(
        prefetch=1 if zero["stage3_prefetch_bucket_size"] > 0 else 0,
        max_live_elements=max(1, int(zero["stage3_max_live_parameters"])),
        persistence_threshold=int(zero["stage3_param_persistence_threshold"]),
    )


def build_loss_scale(cfg: Config) -> Any:
    """The `loss_scale` argument of the presets: DeepSpeed's dynamic scaler or a static scale under fp16, None
    (no scaling) otherwise."""
    fp16 = cfg["fp16"]
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


def build_transform(cfg: Config, optimizer: Optimizer) -> Transform:
    """The ZeRO preset chain the config describes, around `optimizer`.

    Without optimizer offload this is exactly `fzero.zero{stage}(optimizer, accumulate=gas, precision=...,
    loss_scale=..., clip=..., skip_nonfinite=...)`, so the engine and a functional `train_step` built from the same
    preset compute the same values. `offload_optimizer.device: cpu` is the preset's `offload="cpu"`.
    """
    policy = build_policy(cfg)
    loss_scale = build_loss_scale(cfg)
    clip = cfg.gradient_clipping or None
    skip = cfg["bf16"]["check_grad_overflow"] if cfg.precision == "bf16" else True
    return PRESETS[cfg.stage](
        optimizer,
        accumulate=cfg.gas,
        precision=policy,
        loss_scale=loss_scale,
        clip=clip,
        skip_nonfinite=skip,
        offload="cpu" if cfg.offload else None,
    )

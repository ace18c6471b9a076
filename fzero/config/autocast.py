"""DeepSpeed's `torch_autocast` block: `torch.autocast` around the engine's forward, fp32 master weights, the gradients
of "lower-precision-safe" modules reduced in the autocast dtype, fp16 with a `torch.amp.GradScaler`.

    "torch_autocast": {"enabled": true, "dtype": "bfloat16",
                       "lower_precision_safe_modules": ["torch.nn.Linear", "torch.nn.Conv2d"]}

What DeepSpeed 0.19.8 does (`runtime/torch_autocast.py`, `runtime/config.py` `get_torch_autocast_*`,
`runtime/engine.py`, `runtime/zero/stage_1_and_2.py`, `runtime/zero/stage3.py`), and fzero with it:

- `enabled` (default false): `autocast_if_enabled(engine)` around every engine forward; the same
  (`fzero.engine.autocast`).
- `dtype`: DeepSpeed's `DtypeEnum` spellings (`torch.bfloat16`, `bf16`, `bfloat16`; `torch.float16`, `fp16`,
  `float16`, `half`), else "Invalid dtype for torch autocast: ..."; the same, and the float32 and int8 names DeepSpeed
  also accepts are refused (no lower precision).
- `lower_precision_safe_modules` (default Linear, Conv1d/2d/3d): class paths whose modules' own parameters get a
  `comm_dtype`; the same classes (exact class, not subclasses), resolved among modules already imported (a config
  never imports code).
- Reduction at stages 1-3: one bucket per `comm_dtype`, those gradients in the autocast dtype, the others in the
  parameter's dtype, `communication_data_type` ignored; the same (`Policy.reduce_overrides`,
  `fzero.transforms.mixed_reduce`; the others in the compute dtype: float32, or bfloat16 under `bf16.enabled`;
  `communication_data_type` ignored with a `ConfigWarning`).
- Reduction at stage 0: every gradient in `communication_data_type`; the policy's reduce dtype.
- fp16 at stage 0: the engine's `torch_autocast_z0_gradscaler` (loss scaled, `unscale_` before clipping, `step`
  skips a non-finite step, `update`); `fzero.state.grad_scale.TorchGradScale`.
- fp16 at stages 1-3: the optimizer's GradScaler, but an overflow found in the optimizer's own norm skips the step
  without `update` (the scale never backs off); `TorchGradScale(update_on_overflow=False)`.
- `zero_quantized_weights`: DeepSpeed asserts "Cannot enable both torch autocast and zero quantized weights"; a
  `ConfigError` with those words.

Refused (`UnsupportedConfigError` naming the key), where DeepSpeed's arithmetic is not one fzero can reproduce:
`fp16.enabled` with `torch_autocast` (two loss scalers); `bf16.enabled` with an fp16 autocast; fp16 autocast at stages
1-3 with `gradient_clipping` > 0 (DeepSpeed clips the loss-scaled gradients against the bound: set it to 0); at
stages 1-3, ZeRO++ qgZ, hpZ, MiCS, `prescale_gradients` and `gradient_predivide_factor` (per-parameter reduce dtypes
reduce over every rank, the mean after the sum).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..state.grad_scale import TorchGradScale
from ..state.precision import Policy
from .schema import Bool, ConfigError, ConfigWarning, Field, ListOf, Nullable, Section, Str, UnsupportedConfigError

__all__ = [
    "AUTOCAST",
    "DEFAULT_MODULES",
    "autocast_dtype",
    "autocast_loss_scale",
    "autocast_policy",
    "autocast_top_checks",
    "lower_precision_params",
    "resolve_modules",
]

# DeepSpeed's `DtypeEnum` spellings (runtime/config.py), which `torch_autocast.dtype` is looked up in
_SPELLINGS = {
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
}
_NOT_LOW = ("torch.float32", "fp32", "float32", "float", "torch.int8", "int8")
# `LOWER_PRECISION_SAFE_MODULES`, as `get_default_autocast_lower_precision_modules()` names them
DEFAULT_MODULES = tuple(f"{c.__module__}.{c.__name__}" for c in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))


def _block_checks(values: dict[str, Any], path: str) -> None:
    dtype = values["dtype"]
    where = f"{path}.dtype"
    if dtype in _NOT_LOW:
        raise UnsupportedConfigError(
            where,
            f"{dtype!r} is not supported: not a lower precision (torch.autocast on the CPU disables itself for it; "
            "DeepSpeed accepts the name); use bfloat16 or float16",
        )
    if dtype is not None and dtype not in _SPELLINGS:
        raise ConfigError(where, f"Invalid dtype for torch autocast: {dtype} (DeepSpeed's spellings: "
                          f"{', '.join(_SPELLINGS)})")  # fmt: skip
    if values["enabled"] and dtype is None:
        # (DeepSpeed's engine would tag the parameters with a comm_dtype of None and fail in its reduction)
        raise ConfigError(f"{path}.enabled", "needs torch_autocast.dtype: 'bfloat16' or 'float16'")


AUTOCAST = Section(
    {
        "enabled": Field(Bool(), False, effect="torch.autocast around the engine's forward (fzero.config.autocast)"),
        "dtype": Field(Nullable(Str()), None, effect="the autocast dtype: bfloat16 or float16, DeepSpeed's spellings"),
        "lower_precision_safe_modules": Field(
            Nullable(ListOf(Str())),
            None,
            effect="module classes whose parameters' gradients are reduced in the autocast dtype (stages 1-3)",
        ),
    },
    checks=(_block_checks,),
)


def autocast_dtype(cfg: Any) -> torch.dtype | None:
    """The autocast dtype of a validated config (a `Config` or its values), None where `torch_autocast` is off."""
    block = cfg["torch_autocast"]
    return _SPELLINGS[block["dtype"]] if block["enabled"] else None


def autocast_top_checks(values: dict[str, Any]) -> None:
    """The rules that read the config's top level (see the module docstring).

    Raises:
      ConfigError, UnsupportedConfigError: naming the key that cannot go with `torch_autocast`.
    """
    dtype = autocast_dtype(values)
    if dtype is None:
        return
    zero, stage = values["zero_optimization"], values["zero_optimization"]["stage"]
    if values["fp16"]["enabled"]:
        raise UnsupportedConfigError(
            "fp16.enabled",
            "is not supported with torch_autocast.enabled: DeepSpeed would run two loss scalers (fp16's and "
            "torch_autocast's GradScaler); use one",
        )
    if values["bf16"]["enabled"] and dtype == torch.float16:
        raise UnsupportedConfigError(
            "torch_autocast.dtype",
            "float16 with bf16.enabled is not supported (bf16 parameters under an fp16 autocast); use bfloat16, or "
            "turn bf16 off",
        )
    if stage == 3 and zero["zero_quantized_weights"]:
        raise ConfigError(
            "zero_optimization.zero_quantized_weights",
            "Cannot enable both torch autocast and zero quantized weights (DeepSpeed's assertion)",
        )
    if stage == 0:
        return
    if dtype == torch.float16 and values["gradient_clipping"] > 0:
        raise UnsupportedConfigError(
            "gradient_clipping",
            f"{values['gradient_clipping']:g} is not supported with torch_autocast float16 at ZeRO stage {stage}: "
            "DeepSpeed 0.19.8's ZeRO optimizer compares the norm of the loss-scaled gradients with the bound (its "
            "own loss scale is 1 there), so it clips far more than asked; set gradient_clipping to 0",
        )
    refused = {
        "zero_optimization.zero_quantized_gradients": stage == 3 and zero["zero_quantized_gradients"],
        "zero_optimization.zero_hpz_partition_size": stage == 3 and zero["zero_hpz_partition_size"] > 1,
        "zero_optimization.mics_shard_size": stage == 3 and zero["mics_shard_size"] > 0,
        "prescale_gradients": values["prescale_gradients"],
        "gradient_predivide_factor": values["gradient_predivide_factor"] != 1.0,
    }
    for key, on in refused.items():
        if on:
            raise UnsupportedConfigError(
                key,
                "is not supported with torch_autocast at ZeRO stages 1-3: the per-parameter reduce dtypes reduce "
                "over every rank, the mean after the sum",
            )
    if values["communication_data_type"] is not None:
        warnings.warn("communication_data_type is ignored with torch_autocast at ZeRO stages 1-3, as in DeepSpeed "
                      "0.19.8: the lower-precision-safe modules' gradients are reduced in the autocast dtype, the "
                      "others in the parameters' dtype", ConfigWarning, stacklevel=4)  # fmt: skip


def resolve_modules(paths: list[str] | tuple[str, ...] | None) -> tuple[type, ...]:
    """The classes `lower_precision_safe_modules` names (None: DeepSpeed's default, Linear and Conv1d/2d/3d).

    A path `package.module.Class` is looked up in `package.module` only if that module is already imported (as the
    model's own classes are): a config never imports code. `torch.nn.Linear` and `torch.nn.modules.linear.Linear`
    name the same class, as with DeepSpeed's import.

    Raises:
      ConfigError: naming the entry that does not resolve to a class.
    """
    if paths is None:
        return (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    out = []
    for i, path in enumerate(paths):
        where = f"torch_autocast.lower_precision_safe_modules[{i}]"
        package, _, name = path.rpartition(".")
        module = sys.modules.get(package) if package else None
        if module is None:
            raise ConfigError(where, f"Failed to import lower precision safe module {path}: module {package!r} is "
                              "not imported (fzero resolves the classes among imported modules and never imports a "
                              "module a config names: import it before initialize)")  # fmt: skip
        cls = getattr(module, name, None)
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise ConfigError(where, f"Failed to import lower precision safe module {path}: {package!r} has no "
                              f"torch.nn.Module class {name!r}")  # fmt: skip
        out.append(cls)
    return tuple(out)


def lower_precision_params(model: nn.Module, classes: tuple[type, ...]) -> list[str]:
    """The names of the trainable parameters whose gradients DeepSpeed reduces in the autocast dtype: the own
    parameters (`recurse=False`) of every module whose class is exactly one of `classes` (`init_autocast_params`).
    A tied parameter is named once, by `named_parameters`' name."""
    tagged = {
        id(p) for m in model.modules() if type(m) in classes for p in m.parameters(recurse=False) if p.requires_grad
    }
    return [n for n, p in model.named_parameters() if id(p) in tagged]


def autocast_policy(cfg: Any, model: nn.Module, policy: Policy) -> Policy:
    """`policy` with the lower-precision-safe parameters' gradients reduced in the autocast dtype and the others in
    the parameters' (compute) dtype, at ZeRO stages 1-3, as DeepSpeed's `get_param_comm_dtype` picks them:
    `Policy.reduce_overrides`. `policy` itself where `torch_autocast` is off or at stage 0 (DeepSpeed's stage 0
    reduces every gradient in `communication_data_type`).

    Raises:
      ConfigError: a `lower_precision_safe_modules` entry that does not resolve.
    """
    dtype = autocast_dtype(cfg)
    if dtype is None:
        return policy
    classes = resolve_modules(cfg["torch_autocast"]["lower_precision_safe_modules"])
    if cfg["zero_optimization"]["stage"] == 0:
        return policy
    names = lower_precision_params(model, classes)
    return replace(policy, reduce_dtype=policy.compute_dtype, reduce_overrides=tuple((n, dtype) for n in names))


def autocast_loss_scale(cfg: Any) -> TorchGradScale | None:
    """The loss scale of an fp16 autocast: a default `torch.amp.GradScaler`'s (`TorchGradScale`), which at ZeRO
    stages 1-3 neither backs off nor resets on an overflowing step, as DeepSpeed's ZeRO optimizers use it; None
    otherwise."""
    if autocast_dtype(cfg) != torch.float16:
        return None
    return TorchGradScale.create(update_on_overflow=cfg["zero_optimization"]["stage"] == 0)

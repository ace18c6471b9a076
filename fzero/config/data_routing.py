"""DeepSpeed's `data_efficiency.data_routing` block (random-LTD), with DeepSpeed 0.19.8's defaults and keys.

    "data_routing": {
      "enabled": true,
      "random_ltd": {
        "enabled": true,
        "total_layer_num": 12, "random_ltd_layer_num": 10, "random_ltd_layer_id": [1, 2, ..., 10],
        "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 128, "max_value": 1024, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 400, "seq_per_step": 8}}
      }
    }

DeepSpeed reads the block with plain dict lookups: it runs random-LTD wherever `random_ltd.enabled` is true (neither
`data_routing.enabled` nor `data_efficiency.enabled` is consulted, here neither), and a missing key is a `KeyError`
when the engine is built or the layers are wrapped, a wrong `schedule_type` a `RuntimeError` at the first forward.
Here, with random-LTD enabled, every key DeepSpeed reads is required and checked at once: a `ConfigError` naming its
dotted path. Disabled, the block's keys are optional (checked where given) and none is kept, as in DeepSpeed. Keys
no version of DeepSpeed reads are reported as unknown (one `ConfigWarning`, or into the caller's list).
`micro_batch_size` and `global_batch_size` may be given but the engine sets them from its batch sizes, as DeepSpeed's
does; `layer_token_lr_schedule.enabled` is refused (DeepSpeed 0.19.8 raises "Work In Progress").

`fzero.config.data_efficiency` parses the rest of `data_efficiency` and calls `parse_data_routing` for this block.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .schema import (
    REQUIRED,
    Bool,
    ConfigError,
    ConfigTypeError,
    ConfigWarning,
    Field,
    Int,
    ListOf,
    Nullable,
    Num,
    Section,
    Str,
)

__all__ = ["DATA_ROUTING", "RANDOM_LTD", "parse_data_routing"]

MODEL_TYPES = ("decoder", "encoder")
HIDDEN_STATE_ORDERS = ("batch_seq_dim", "seq_batch_dim")
SCHEDULE_TYPES = ("fixed_linear",)  # (DeepSpeed 0.19.8's scheduler computes no other)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _schedule_checks(values: dict[str, Any], path: str) -> None:
    low, high = values["min_value"], values["max_value"]
    if low is not None and high is not None and low > high:
        raise ConfigError(_join(path, "min_value"), f"{low} exceeds max_value {high}: the kept length only grows")


def _ltd_checks(values: dict[str, Any], path: str) -> None:
    total, dropping, ids = values["total_layer_num"], values["random_ltd_layer_num"], values["random_ltd_layer_id"]
    if total is not None and dropping is not None and dropping > total:
        raise ConfigError(_join(path, "random_ltd_layer_num"), f"{dropping} exceeds total_layer_num {total}")
    if ids is not None and dropping is not None and len(ids) < dropping:
        raise ConfigError(
            _join(path, "random_ltd_layer_id"),
            f"names {len(ids)} layers, fewer than random_ltd_layer_num {dropping}: each dropping layer is one id",
        )


def _random_ltd(required: bool) -> Section:
    """The `random_ltd` section; `required`: the keys DeepSpeed reads must be given (random-LTD enabled)."""
    need: Any = REQUIRED if required else None

    def req(spec: Any) -> Field:
        return Field(spec if required else Nullable(spec), need)

    schedule_config = Section(
        {
            "require_steps": req(Int(1)),
            "seq_per_step": req(Int(1)),
            "root_degree": Field(Nullable(Num()), None, effect="no effect (fixed_linear is root degree 1)"),
        }
    )
    schedule = Section(
        {
            "min_value": req(Int(1)),
            "max_value": req(Int(1)),
            "schedule_type": req(Str(SCHEDULE_TYPES)),
            "schedule_config": Field(schedule_config, need),
        },
        checks=(_schedule_checks,),
    )
    lr_schedule = Section(
        {
            "enabled": Field(
                Bool(), False, unsupported="the layer-token LR schedule (DeepSpeed 0.19.8: Work In Progress)"
            ),
            "total_layer_tokens": Field(Nullable(Int(0)), None),
            "warmup_type": Field(Nullable(Str()), None),
            "warmup_layer_tokens": Field(Nullable(Int(0)), None),
        }
    )
    return Section(
        {
            "enabled": Field(Bool(), False),
            "total_layer_num": req(Int(1)),
            "random_ltd_layer_num": req(Int(1)),
            "random_ltd_layer_id": req(ListOf(Int(0))),
            "model_mask_name": Field(Nullable(Str()), need),
            "model_type": req(Str(MODEL_TYPES)),
            "hidden_state_order": req(Str(HIDDEN_STATE_ORDERS)),
            "random_ltd_schedule": Field(schedule, need),
            "layer_token_lr_schedule": lr_schedule,
            "micro_batch_size": Field(Nullable(Int(1)), None, effect="set by the engine: its micro batch size"),
            "global_batch_size": Field(Nullable(Int(1)), None, effect="set by the engine: its train_batch_size"),
        },
        checks=(_ltd_checks,),
    )


RANDOM_LTD = _random_ltd(required=True)  # (enabled: every key DeepSpeed reads; for the documentation)
_RANDOM_LTD_OPTIONAL = _random_ltd(required=False)
DATA_ROUTING = Section(
    {
        "enabled": Field(Bool(), False, effect="reported only: DeepSpeed runs random-LTD by random_ltd.enabled"),
        "random_ltd": Field(Section({}, open=True), None),  # (parsed by parse_data_routing, enabled or not)
    }
)


def parse_data_routing(block: Any, path: str, unknown: list[str] | None = None) -> dict[str, Any]:
    """Validate a `data_routing` block.

    Args:
      block: the block as given (None or absent: `{}`).
      path: its dotted path, for the errors (`"data_efficiency.data_routing"`).
      unknown: where to add the dotted paths of keys DeepSpeed does not read; None: one `ConfigWarning` names them.

    Returns:
      `{"enabled": bool, "random_ltd": {...}}`: the `random_ltd` block with every key (defaults filled in), as
      DeepSpeed's `data_efficiency_config["data_routing"]`; disabled, DeepSpeed's `{"enabled": False,
      "layer_token_lr_schedule": {"enabled": False}}`.

    Raises:
      ConfigError: a missing or wrong key (its dotted path in the message); `ConfigTypeError` for a wrong type,
        `UnsupportedConfigError` for `layer_token_lr_schedule.enabled`.
    """
    found: list[str] = []
    block = {} if block is None else block
    if not isinstance(block, Mapping):
        raise ConfigTypeError(path, f"expected an object (JSON {{...}}), got {block!r} ({type(block).__name__})")
    out = DATA_ROUTING.validate(block, path, found)
    where = _join(path, "random_ltd")
    raw = block.get("random_ltd")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigTypeError(where, f"expected an object (JSON {{...}}), got {raw!r} ({type(raw).__name__})")
    enabled = Bool().validate(raw.get("enabled", False), _join(where, "enabled"), found)
    spec = RANDOM_LTD if enabled else _RANDOM_LTD_OPTIONAL
    ltd = spec.validate(raw, where, found)
    if not enabled:  # (the keys given were checked; DeepSpeed's disabled block keeps none of them)
        ltd = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    out["random_ltd"] = ltd
    if unknown is not None:
        unknown.extend(found)
    elif found:
        warnings.warn(f"config keys fzero does not know, ignored: {', '.join(found)}", ConfigWarning, stacklevel=2)
    return out

"""DeepSpeed's data-efficiency blocks: `data_efficiency` (data sampling with curriculum learning; data routing, parsed
by `fzero.config.data_routing`) and the legacy top-level `curriculum_learning` (sequence-length truncation).

DeepSpeed 0.19.8 reads them with plain dict lookups and asserts (`runtime/data_pipeline/config.py`,
`curriculum_scheduler.py`); here every key is declared with DeepSpeed's default and checked where it is read, so a
missing or wrong key is a `ConfigError` naming its dotted path before training starts, rather than an
`AssertionError`, a `KeyError` at the first forward or a `ZeroDivisionError` in the scheduler. What the keys do:

- `data_efficiency.enabled` (default false) and `seed` (1234): DeepSpeed's engine reports the first and never acts on
  it; the seed drives the data sampler's random generator (`numpy.random.default_rng(seed)`).
- `data_efficiency.data_sampling`: `enabled` (false), `num_epochs` (1000), `num_workers` (0), `pin_memory` (false),
  `curriculum_learning` and `dynamic_batching` (refused: variable batch sizes and learning rates). Curriculum data
  sampling runs where `curriculum_learning.enabled` is true, as in DeepSpeed (its engine asks nothing else):
  `data_cluster_path` and `curriculum_metrics` (name -> `{index_to_sample_path, index_to_metric_path,
  difficulty_type, clustering_type}` plus a schedule) are then required.
- a schedule: `min_difficulty`, `max_difficulty`, `schedule_type` (`fixed_linear`, `fixed_root`, `fixed_discrete`,
  `custom`) and its `schedule_config` (`total_curriculum_step` and `difficulty_step`, plus `root_degree` for
  `fixed_root`; `difficulty` and `max_step` lists for `fixed_discrete`; nothing for `custom`, whose function the
  script sets: `engine.set_custom_curriculum_learning_schedule`).
- legacy `curriculum_learning`: `enabled`, `curriculum_type` (`"seqlen"` passes `curriculum_seqlen=difficulty` to the
  model's forward; any other type only advances the schedule) and a schedule. DeepSpeed 0.19.8 itself refuses this
  block ("Legacy top-level 'curriculum_learning' has been removed"); fzero keeps the behaviour of the DeepSpeed
  releases before it, so that Megatron-DeepSpeed's configs train unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..optim import curriculum
from .data_routing import parse_data_routing
from .schema import (
    Bool,
    ConfigError,
    ConfigTypeError,
    Field,
    Int,
    ListOf,
    Nullable,
    Num,
    Section,
    Spec,
    Str,
)

__all__ = ["CURRICULUM_LEGACY", "DATA_EFFICIENCY", "SCHEDULE_TYPES", "check_schedule", "schedule_of"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_NUMBER = Num()
_POSITIVE = Num(0, low_open=True)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _number(block: Mapping[str, Any], key: str, path: str, spec: Num = _NUMBER) -> Any:
    where = _join(path, key)
    if key not in block or block[key] is None:  # (named in the block's error: the key is not there to name)
        raise ConfigError(path, f"{key} is required: expected {spec.expect}")
    return spec.validate(block[key], where, [])


def check_schedule(values: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Check a curriculum schedule (`min_difficulty`, `max_difficulty`, `schedule_type`, `schedule_config`), as
    DeepSpeed's `CurriculumScheduler` reads it, and return its `schedule_config` with only the keys the type reads.

    Args:
      values: the block holding the schedule (a metric of `curriculum_metrics`, the legacy block, or the dict given
        to `CurriculumScheduler`).
      path: the block's dotted path, for the errors.

    Returns:
      The checked `schedule_config`.

    Raises:
      ConfigError: a key missing or out of range, naming its dotted path.
    """
    lo = _number(values, "min_difficulty", path)
    hi = _number(values, "max_difficulty", path)
    if lo > hi:
        raise ConfigError(path, f"max_difficulty {hi} is below min_difficulty {lo}")
    kind = values.get("schedule_type")
    where = _join(path, "schedule_type")
    if kind is None:
        raise ConfigError(path, "schedule_type is required: one of " + ", ".join(map(repr, SCHEDULE_TYPES)))
    Str(SCHEDULE_TYPES).validate(kind, where, [])
    config = values.get("schedule_config")
    cpath = _join(path, "schedule_config")
    if kind == "custom":
        return dict(config or {})
    if not isinstance(config, Mapping):
        raise ConfigTypeError(path, f"schedule_config is required for schedule_type {kind!r}: expected an object")
    if kind == "fixed_discrete":
        lists = {}
        for key in ("difficulty", "max_step"):
            if key not in config:
                raise ConfigError(cpath, f"{key} is required for schedule_type 'fixed_discrete': expected a list")
            lists[key] = ListOf(_NUMBER).validate(config[key], _join(cpath, key), [])
        if not lists["max_step"] or len(lists["difficulty"]) != len(lists["max_step"]) + 1:
            raise ConfigError(
                _join(cpath, "difficulty"),
                f"has {len(lists['difficulty'])} values and max_step {len(lists['max_step'])}: fixed_discrete needs "
                "at least one max_step and one more difficulty than max_step (the last difficulty holds after the "
                "last max_step)",
            )
        return lists
    if "total_step" in config and "total_curriculum_step" not in config:
        raise ConfigError(_join(cpath, "total_step"), "is the old name of total_curriculum_step: rename it")
    out = {key: _number(config, key, cpath, _POSITIVE) for key in ("total_curriculum_step", "difficulty_step")}
    if kind == "fixed_root":
        out["root_degree"] = _number(config, "root_degree", cpath, _POSITIVE)
    return out


def schedule_of(values: Mapping[str, Any]) -> Any:
    """The `fzero.optim.curriculum` schedule of a checked block (`check_schedule`); None for `custom`."""
    kind, config = values["schedule_type"], values["schedule_config"]
    lo, hi = values["min_difficulty"], values["max_difficulty"]
    if kind == "fixed_linear":
        return curriculum.fixed_linear(lo, hi, config["total_curriculum_step"], config["difficulty_step"])
    if kind == "fixed_root":
        return curriculum.fixed_root(
            lo, hi, config["total_curriculum_step"], config["difficulty_step"], config["root_degree"]
        )
    if kind == "fixed_discrete":
        return curriculum.fixed_discrete(config["difficulty"], config["max_step"])
    return None


@dataclass(frozen=True)
class _Object(Spec):
    """A JSON object kept as it is (a schedule's `schedule_config`, checked with its `schedule_type`)."""

    expect = "an object (JSON {...})"

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.type_error(path, value)
        return dict(value)


def _schedule_fields() -> dict[str, Field]:
    # (checked together by `_schedule_check` where the block is enabled: DeepSpeed reads none of them otherwise)
    return {
        "min_difficulty": Field(Nullable(_NUMBER), None),
        "max_difficulty": Field(Nullable(_NUMBER), None),
        "schedule_type": Field(Nullable(Str()), None),
        "schedule_config": Field(Nullable(_Object()), None),
    }


def _schedule_check(values: dict[str, Any], path: str) -> None:
    values["schedule_config"] = check_schedule(values, path)


# ------------------------------------------------------------------------------------------------- data sampling
def _metric_check(values: dict[str, Any], path: str) -> None:
    # DeepSpeed's sampler reads these (KeyError there); the index files where the metric is clustered
    for key in ("difficulty_type", "clustering_type"):
        if values[key] is None:
            raise ConfigError(path, f"{key} is required for a curriculum metric")
    if values["clustering_type"] != "single_cluster":
        if values["index_to_sample_path"] is None:
            raise ConfigError(
                path,
                f"index_to_sample_path is required with clustering_type {values['clustering_type']!r} (the "
                "DataAnalyzer's index_to_sample files; clustering_type 'single_cluster' needs none)",
            )
        if values["difficulty_type"] == "value" and values["index_to_metric_path"] is None:
            raise ConfigError(path, "index_to_metric_path is required with difficulty_type 'value'")


_METRIC = Section(
    {
        **_schedule_fields(),
        "index_to_sample_path": Field(Nullable(Str()), None),
        "index_to_metric_path": Field(Nullable(Str()), None),
        "difficulty_type": Field(Nullable(Str(("value", "percentile"))), None),
        "clustering_type": Field(Nullable(Str()), None),
    },
    checks=(_schedule_check, _metric_check),
)


@dataclass(frozen=True)
class _Metrics(Spec):
    """`curriculum_metrics`: metric name -> a metric block (DeepSpeed iterates the names in the config's order)."""

    expect = "an object {metric name: {...}}"

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.type_error(path, value)
        if not value:
            raise ConfigError(path, "names no metric: give at least one")
        return {str(k): _METRIC.validate(v, _join(path, str(k)), unknown) for k, v in value.items()}


def _sampling_curriculum_check(values: dict[str, Any], path: str) -> None:
    if not values["enabled"]:
        return
    for key in ("data_cluster_path", "curriculum_metrics"):
        if values[key] is None:
            raise ConfigError(path, f"{key} is required where curriculum learning is enabled")


DATA_SAMPLING = Section(
    {
        "enabled": Field(Bool(), False, effect="reported by engine.data_sampling_enabled(); DeepSpeed acts on none"),
        "num_epochs": Field(Int(1), 1000, effect="the curriculum sampler draws num_epochs times the data set"),
        "num_workers": Field(Int(0), 0, effect="the curriculum data loader's worker processes"),
        "pin_memory": Field(Bool(), False, effect="no effect (DeepSpeed reads it and never uses it)"),
        "curriculum_learning": Section(
            {
                "enabled": Field(Bool(), False),
                "data_cluster_path": Field(Nullable(Str()), None),
                "curriculum_metrics": Field(Nullable(_Metrics()), None),
            },
            checks=(_sampling_curriculum_check,),
        ),
        "dynamic_batching": Section(
            {"enabled": Field(Bool(), False, unsupported="dynamic batching (variable batch sizes and learning rates)")},
            open=True,
        ),
    }
)


# -------------------------------------------------------------------------------------------------- data routing
@dataclass(frozen=True)
class _Routing(Spec):
    """`data_routing`: parsed by `fzero.config.data_routing.parse_data_routing` (random-LTD)."""

    expect = "an object (JSON {...})"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        return parse_data_routing(value, path)


def _routing_defaults() -> Any:
    return _Routing().validate({}, "data_efficiency.data_routing", [])


DATA_EFFICIENCY = Section(
    {
        "enabled": Field(Bool(), False, effect="reported by engine.data_efficiency_enabled(); DeepSpeed acts on none"),
        # (numpy.random.default_rng takes a non-negative seed)
        "seed": Field(Int(0), 1234, effect="the curriculum sampler's numpy.random.default_rng(seed)"),
        "data_sampling": DATA_SAMPLING,
        "data_routing": Field(_Routing(), None),
    },
    checks=(lambda values, path: values.__setitem__("data_routing", values["data_routing"] or _routing_defaults()),),
)


# ------------------------------------------------------------------------------------------- legacy curriculum
def _legacy_check(values: dict[str, Any], path: str) -> None:
    if not values["enabled"]:
        return
    if values["curriculum_type"] is None:
        raise ConfigError(
            path,
            "curriculum_type is required where curriculum learning is enabled: 'seqlen' passes curriculum_seqlen to "
            "the forward",
        )
    _schedule_check(values, path)


CURRICULUM_LEGACY = Section(
    {
        "enabled": Field(Bool(), False, effect="the forward's curriculum_seqlen (DeepSpeed before 0.19.8)"),
        "curriculum_type": Field(Nullable(Str()), None),
        **_schedule_fields(),
    },
    checks=(_legacy_check,),
)

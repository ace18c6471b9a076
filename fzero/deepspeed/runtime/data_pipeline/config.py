"""`deepspeed.runtime.data_pipeline.config`: DeepSpeed's readers of the `data_efficiency` block, over fzero's checked
schema (`fzero.config.data_efficiency`): DeepSpeed's defaults, and a `ConfigError` naming the key where DeepSpeed
asserts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ....config.data_efficiency import DATA_EFFICIENCY
from .constants import DATA_EFFICIENCY as DATA_EFFICIENCY_KEY

__all__ = ["get_data_efficiency_config", "get_data_efficiency_enabled", "get_data_efficiency_seed"]


def get_data_efficiency_config(param_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The checked `data_efficiency` block of a DeepSpeed config dict, its defaults filled in.

    Raises:
      ConfigError: a wrong or missing key, named by its dotted path.
    """
    return DATA_EFFICIENCY.validate(param_dict.get(DATA_EFFICIENCY_KEY) or {}, DATA_EFFICIENCY_KEY, [])


def get_data_efficiency_enabled(param_dict: Mapping[str, Any]) -> bool:
    return bool(get_data_efficiency_config(param_dict)["enabled"])


def get_data_efficiency_seed(param_dict: Mapping[str, Any]) -> int:
    return int(get_data_efficiency_config(param_dict)["seed"])

"""`deepspeed.runtime.zero`: DeepSpeed's ZeRO package under its own path; the names are `fzero.deepspeed.zero`'s
(DeepSpeed's `deepspeed.zero` is this package), and `partition_parameters` is DeepSpeed's module of them.

May import: every package (it is part of `fzero.deepspeed`, the top layer).
"""

from __future__ import annotations

from typing import Any

from ...refusal import refuse
from ...zero import UNSUPPORTED
from . import partition_parameters
from .partition_parameters import *  # noqa: F403 (DeepSpeed's package imports its names from this module)

__all__ = partition_parameters.__all__

_ENGINE = "DeepSpeed's ZeRO engine internals: fzero's engine is fzero.deepspeed.DeepSpeedEngine"
_UNSUPPORTED: dict[str, str] = {
    **UNSUPPORTED,
    **dict.fromkeys(
        """
        stage3 stage_1_and_2 parameter_offload partitioned_param_coordinator partitioned_param_profiler
        contiguous_memory_allocator linear tiling offload_states utils muon leaf_module_config
        """.split(),
        _ENGINE,
    ),
    "config": "fzero.config.parse_config reads and validates the config's zero_optimization block",
    "offload_config": "fzero.config.parse_config reads the offload_optimizer / offload_param blocks",
}


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

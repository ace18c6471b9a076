"""`deepspeed.utils`: DeepSpeed's logger (`logging`), its process-group queries (`groups`), `RepeatingLoader`,
`recursive_getattr` / `recursive_setattr` (`module_utils`), `instrument_w_nvtx`, and the `safe_get_*` /
`safe_set_*` accessors of ZeRO-partitioned state (`tensor_fragment`, imported when first used).

    from fzero.deepspeed.utils import logger, log_dist           # was: from deepspeed.utils import ...
    log_dist("saved", ranks=[0])

DeepSpeed's ZeRO-3 leaf-module markers, `OnDevice`, its hp-parameter links and the rest are refused by name.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from ..accelerator import get_accelerator
from ..refusal import refuse
from ..runtime.dataloader import RepeatingLoader
from . import groups
from .groups import *  # noqa: F403 (DeepSpeed's package re-exports its groups module the same way)
from .groups import __all__ as _groups
from .logging import log_dist, log_dist_once, logger, set_log_level_from_string
from .module_utils import recursive_getattr, recursive_setattr

__all__ = [
    *_groups,
    "RepeatingLoader",
    "groups",
    "instrument_w_nvtx",
    "log_dist",
    "log_dist_once",
    "logger",
    "recursive_getattr",
    "recursive_setattr",
    "set_log_level_from_string",
]

# imported from `.tensor_fragment` when first asked for
_TENSOR_FRAGMENT = tuple(
    """
    safe_get_full_fp32_param safe_get_full_grad safe_get_full_optimizer_state safe_set_full_fp32_param
    safe_set_full_optimizer_state safe_get_local_fp32_param safe_get_local_grad safe_get_local_optimizer_state
    safe_set_local_fp32_param safe_set_local_optimizer_state
    """.split()
)

_LEAF = ("fzero gathers whole units (each nn.ModuleList child, or subtrees of a size: fzero.layout.BySize), never "
         "a module's submodules one by one, so every unit is a leaf already")  # fmt: skip
_HP = "DeepSpeed's links between its low- and high-precision flat buffers: use the safe_get_* / safe_set_* functions"
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        set_z3_leaf_modules unset_z3_leaf_modules get_z3_leaf_modules z3_leaf_module z3_leaf_parameter
        set_z3_leaf_module set_z3_leaf_modules_by_name set_z3_leaf_modules_by_suffix
        """.split(),
        _LEAF,
    ),
    **dict.fromkeys(
        """
        tensor_fragment get_full_hp_param get_hp_fragment_mapping fragment_address get_full_hp_grad
        map_to_flat_opt_states set_full_hp_param set_full_hp_grad link_hp_params
        lazy_init_hp_params_optimizer_state
        """.split(),
        _HP,
    ),
    **dict.fromkeys(
        """
        safe_set_full_grad safe_set_local_grad safe_update_full_grad_vectorized
        """.split(),
        "fzero's gradients are the step's, reduced by its chain: a transform changes them "
        "(docs/extending.md); the safe_get_* functions read them",
    ),
    "OnDevice": "build the model on the meta device and pass initializer= to fzero.init, or use "
    "fzero.deepspeed.zero.Init",
    "get_numactl_cmd": "fzero has no launcher: bind cores with numactl or taskset around torchrun yourself",
    "get_caller_func": "fzero has no communication logger (deepspeed.comm.log_summary is refused)",
    **groups._UNSUPPORTED,
}


def instrument_w_nvtx(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` inside an NVTX range named after it (the accelerator's `range_push` / `range_pop`: nothing on the
    CPU), skipped while torch compiles."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ranged = not torch.compiler.is_compiling()
        if ranged:
            get_accelerator().range_push(func.__qualname__)
        out = func(*args, **kwargs)
        if ranged:
            get_accelerator().range_pop()
        return out

    return wrapped


def __getattr__(name: str) -> Any:
    if name in _TENSOR_FRAGMENT:
        return getattr(importlib.import_module(f"{__name__}.tensor_fragment"), name)
    return refuse(__name__, name, _UNSUPPORTED)

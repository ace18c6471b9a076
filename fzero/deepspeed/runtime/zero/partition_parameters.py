"""`deepspeed.runtime.zero.partition_parameters`: DeepSpeed's module of `Init`, `GatheredParameters`,
`register_external_parameter` and the parameter states, at its own path (fzero's are `fzero.deepspeed.zero`'s).
DeepSpeed's handles, quantizers and patching internals here are refused with fzero's alternative.
"""

from __future__ import annotations

import importlib
from typing import Any

from ...refusal import refuse
from ...zero import UNSUPPORTED, Init, ZeroParamStatus, ZeroParamType, gathered
from ...zero.gathered import *  # noqa: F403 (GatheredParameters, register_external_parameter, ...)

__all__ = [*gathered.__all__, "Init", "ZeroParamStatus", "ZeroParamType"]

_INTERNAL = "DeepSpeed's own partitioning machinery: fzero gathers by unit in its engine (fzero.sharding)"
_UNSUPPORTED: dict[str, str] = {
    **UNSUPPORTED,
    **dict.fromkeys(
        """
        AllGatherHandle AllGatherCoalescedHandle MultipleAllGatherHandles AllReduceCoalescedHandle NoGatherHandle
        NoGatherCoalescedHandle CUDAQuantizer QuantizationInfo InsertPostInitMethodToModuleSubClasses free_param
        get_all_subclasses zero_wrapper_for_fp_tensor_constructor get_new_tensor_fn_for_dtype
        get_allgather_dtype print_rank_0 debug_rank0 zero3_linear_wrap get_only_unique_item PartitionedParamStatus
        """.split(),
        _INTERNAL,
    ),
    "AsyncPartitionedParameterSwapper": "the engine offloads to NVMe from the config at initialize",
    **dict.fromkeys(
        "shutdown_init_context restore_init_context".split(),
        "fzero's engine builds its state from a model built under zero.Init without leaving the context",
    ),
}


def __getattr__(name: str) -> Any:
    if name == "see_memory_usage":  # (DeepSpeed's module imports it from deepspeed.runtime.utils)
        return importlib.import_module("fzero.deepspeed.runtime.utils").see_memory_usage
    return refuse(__name__, name, _UNSUPPORTED)

"""`deepspeed.runtime.zero.partition_parameters`: DeepSpeed's module of `Init`, `GatheredParameters`,
`register_external_parameter` and the parameter states, at its own path (fzero's are `fzero.deepspeed.zero`'s).
DeepSpeed's handles, quantizers and patching internals here are refused with fzero's alternative, but for
`zero_wrapper_for_fp_tensor_constructor` and `_orig_torch_arange`: DeepSpeed's `Init` makes `torch.arange` and the
other constructors create tensors in the config's dtype through that wrapper, and code that must keep a dtype
(transformers' `prevent_arange_dtype_change`, entered around every ZeRO-3 `from_pretrained`) replaces the wrapper
for the duration. fzero's `Init` keeps the dtypes the modules create and never calls it; it is DeepSpeed's
function, there to be read and replaced.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from ...refusal import refuse
from ...zero import UNSUPPORTED, Init, ZeroParamStatus, ZeroParamType, gathered
from ...zero.gathered import *  # noqa: F403 (GatheredParameters, register_external_parameter, ...)

__all__ = [*gathered.__all__, "Init", "ZeroParamStatus", "ZeroParamType", "zero_wrapper_for_fp_tensor_constructor"]

_INTERNAL = "DeepSpeed's own partitioning machinery: fzero gathers by unit in its engine (fzero.sharding)"
_UNSUPPORTED: dict[str, str] = {
    **UNSUPPORTED,
    **dict.fromkeys(
        """
        AllGatherHandle AllGatherCoalescedHandle MultipleAllGatherHandles AllReduceCoalescedHandle NoGatherHandle
        NoGatherCoalescedHandle CUDAQuantizer QuantizationInfo InsertPostInitMethodToModuleSubClasses free_param
        get_all_subclasses get_new_tensor_fn_for_dtype
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

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: torch.device | None
) -> Callable[..., torch.Tensor]:
    """DeepSpeed's: `fn` creating its tensor on `target_device` (unless given one) and, if floating, in
    `target_fp_dtype` (see the module docstring: fzero's `Init` does not use it)."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def __getattr__(name: str) -> Any:
    if name == "see_memory_usage":  # (DeepSpeed's module imports it from deepspeed.runtime.utils)
        return importlib.import_module("fzero.deepspeed.runtime.utils").see_memory_usage
    return refuse(__name__, name, _UNSUPPORTED)

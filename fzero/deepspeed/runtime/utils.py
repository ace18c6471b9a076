"""`deepspeed.runtime.utils`: the helpers of DeepSpeed's runtime that training scripts call (`see_memory_usage`,
`move_to_device`, `set_random_seed`, ...), with DeepSpeed's behaviour and printed format.

The rest of the module is DeepSpeed's ZeRO and pipeline machinery (gradient norms and overflow checks over its
flat buffers, partitioning helpers, hooks): refused by name, with what fzero has instead.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..accelerator.cpu_accelerator import available_memory, total_memory
from ..moe.utils import is_moe_param
from ..refusal import refuse

__all__ = [
    "call_to_str",
    "copy_to_device",
    "empty_cache",
    "ensure_directory_exists",
    "filter_empty_parameters",
    "get_ma_status",
    "get_only_unique_item",
    "get_tensor_bytes",
    "inf",
    "is_model_parallel_parameter",
    "is_moe_param",
    "move_to_device",
    "noop_context",
    "noop_decorator",
    "see_memory_usage",
    "set_random_seed",
    "torch_max_memory_reserved",
    "torch_memory_reserved",
]

inf = math.inf
_GB = 1024**3

_NORMS = ("fzero's chain clips and checks for overflow (fzero.clip_by_global_norm, scale_loss); the engine reports "
          "the norm: engine.get_global_grad_norm()")  # fmt: skip
_ZERO = "DeepSpeed's flat-buffer internals: fzero's layout is fzero.layout's (FlatLayout), its collectives fzero.mesh's"
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        clip_grad_norm_ clip_tensors_by_global_norm get_global_norm get_global_norm_of_tensors
        get_flattened_grad_norm get_grad_zeros get_weight_norm get_norm_with_moe_layers
        get_norm_with_moe_layers_fast combine_grad_norm_groups has_inf_or_nan is_invalid_grad_norm
        CheckOverflow mask_nan_or_inf_with_val_inplace
        """.split(),
        _NORMS,
    ),
    **dict.fromkeys(
        """
        align_dense_tensors all_gather_dp_groups all_gather_into_tensor_dp_groups PartitionedTensor
        get_inactive_params is_optimized_parameter DummyOptim get_checkpoint_folder_size
        """.split(),
        _ZERO,
    ),
    **dict.fromkeys(
        """
        partition_uniform partition_balanced prefix_sum_inc PIPE_REPLICATED bwc_pipeline_parallel_group
        bwc_pipeline_parallel_world_size bwc_tensor_model_parallel_rank TLinear transpose
        """.split(),
        "fzero has no pipeline or tensor parallelism",
    ),
    **dict.fromkeys(
        """
        OutputBackwardHookManager register_output_backward_hooks maybe_loss_for_backward
        count_used_parameters_in_backward check_internal_apis_for_count_used_parameters
        is_transformers_cache compare_tensors_in_structures
        """.split(),
        "DeepSpeed's engine internals around backward(); fzero's engine has its own (engine.backward)",
    ),
    **dict.fromkeys(
        """
        offload_adam_states reload_adam_states
        """.split(),
        "offload the optimizer through the config (zero_optimization.offload_optimizer)",
    ),
    **dict.fromkeys(
        """
        memory_status mem_alloced mem_cached
        """.split(),
        "see_memory_usage(message, force=True)",
    ),
}


def torch_memory_reserved(device_index: Any = None) -> int:
    """The accelerator's reserved memory (DeepSpeed binds `get_accelerator().memory_reserved` to this name)."""
    return get_accelerator().memory_reserved(device_index)


def torch_max_memory_reserved(device_index: Any = None) -> int:
    return get_accelerator().max_memory_reserved(device_index)


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force`, print `message` and the memory in use, as DeepSpeed does (on rank 0 only): the accelerator's
    allocated and reserved memory and their peaks (GB), then the host's used memory; the peaks are reset after."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # (as DeepSpeed: Python frees cycles late, so count after a collection)
    acc = get_accelerator()
    print(message)
    # (DeepSpeed's line, whose source continues the f-string over lines: 9 spaces between the fields)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB         "
          f"Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB         "
          f"CA {round(torch_memory_reserved() / _GB, 2)} GB         "
          f"Max_CA {round(torch_max_memory_reserved() / _GB)} GB ")  # fmt: skip
    total, available = total_memory(), available_memory()
    # (psutil's percent: the used share rounded to one decimal)
    print(f"CPU Virtual Memory:  used = {round((total - available) / _GB, 2)} GB, "
          f"percent = {round((total - available) / total * 100, 1)}%")  # fmt: skip
    acc.reset_peak_memory_stats()


def get_ma_status() -> int:
    """The accelerator's allocated memory on rank 0 (0 on the others)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    return get_accelerator().memory_allocated()


def empty_cache() -> None:
    """Free the accelerator's cached memory and reset its peak statistics."""
    get_accelerator().empty_cache()
    get_accelerator().reset_peak_memory_stats()


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """A copy of `item` (nested lists, tuples, dicts) with each leaf that meets `criterion_func` on `device`."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """`item` (nested lists, tuples, dicts) on `device`: leaves meeting `criterion_func` moved in place (their
    `.data` replaced), every other leaf `.to(device)`; with no criterion every leaf `.to(device)`."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


class noop_context:
    """A `with` block that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def noop_decorator(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


def ensure_directory_exists(filename: str) -> None:
    """Create the directory of `filename` (and its parents) if missing."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator (`seed % 2**32`) and torch (`seed % 2**63`)."""
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def is_model_parallel_parameter(p: Any) -> bool:
    """Whether `p` is marked `model_parallel` or `tensor_model_parallel` (fzero trains none such)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def filter_empty_parameters(params: Any) -> Any:
    """`params` (parameters, or param-group dicts) without the parameters of no element; groups left empty are
    dropped."""
    if not isinstance(params, (list, tuple)) or len(params) == 0:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    out = []
    for group in params:
        kept = [p for p in group.get("params", []) if p.numel() > 0]
        if kept:
            out.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
    return out


def get_only_unique_item(items: Any) -> Any:
    """The one distinct element of `items`.

    Raises:
      RuntimeError: none, or more than one.
    """
    unique = set(items)
    if len(unique) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(unique))


def get_tensor_bytes(item: Any) -> int:
    """The bytes of the tensors in `item` (nested lists, tuples, dicts)."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(repr(arg), ..., key=repr(value), ...)` as a string."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""`deepspeed.checkpointing`: DeepSpeed's activation checkpointing, as torch's reentrant checkpoint.

    from fzero.deepspeed import checkpointing                  # was: deepspeed.checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    h = checkpointing.checkpoint(block, h, mask)               # recomputed in the backward

DeepSpeed's `checkpoint` is a reentrant autograd Function that saves its inputs, runs the function without grad,
and in the backward restores the CPU and accelerator random states of the forward, re-runs the function with grad
and back-propagates through it: torch's `torch.utils.checkpoint.checkpoint(use_reentrant=True)` does the same (and
re-enters the forward's autocast state too), so it is used here, with DeepSpeed's keyword arguments (passed to the
function, their tensors differentiated like positional ones). As in DeepSpeed, a block whose inputs all lack
`requires_grad` gets no gradient (torch warns): `non_reentrant_checkpoint` has no such limit. fzero's engine
differentiates through reentrant checkpoints (docs/design.md).

What fzero cannot honour is refused by name: partitioning the checkpoints over model-parallel ranks and the options
that need it (fzero has no model parallelism), moving them to the CPU, and per-checkpoint profiling; as fzero's
config refuses `activation_checkpointing.partition_activations` and `cpu_checkpointing`. `synchronize` is honoured:
the accelerator is synchronised before and after each run of the function (forward and recompute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from ..config import parse_config
from .accelerator import get_accelerator
from .refusal import refuse
from .runtime.utils import copy_to_device, move_to_device, see_memory_usage

__all__ = [
    "checkpoint",
    "configure",
    "copy_to_device",
    "is_configured",
    "move_to_device",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "see_memory_usage",
    "set_num_layers",
]

_MODEL_PARALLEL = "fzero has no model (tensor) parallelism"
_PARTITION = (
    f"partitioned activation checkpointing: it splits checkpoints over model-parallel ranks ({_MODEL_PARALLEL})"
)
_INTERNAL = "DeepSpeed's internals of partitioned and CPU checkpointing; fzero's checkpoint is torch's reentrant one"
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        model_parallel_cuda_manual_seed model_parallel_reconfigure_tp_seed get_cuda_rng_tracker
        CudaRNGStatesTracker bwc_tensor_model_parallel_rank
        """.split(),
        f"{_MODEL_PARALLEL}: seed with get_accelerator().manual_seed(seed)",
    ),
    **dict.fromkeys(
        """
        CheckpointFunction detach_variable extract_tensors merge_tensors partition_activations
        gather_partitioned_activations get_partition_size get_partition_start is_activation_to_checkpoint
        get_partitioned_activations_for_backward get_cpu_activations_for_backward
        get_offloaded_activations_for_backward restore_offloaded_activations contiguous_data_buffers
        contiguous_size_buffers data_offsets size_offsets Timers FORWARD_GLOBAL_TIMER
        """.split(),
        _INTERNAL,
    ),
    "DeepSpeedConfig": "fzero.config.parse_config reads a DeepSpeed config",
}

# DeepSpeed's module-level settings, as `configure` leaves them (read-only here: set them through `configure`)
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False
mpu: Any = None
mp_rank, mp_size, mp_group = 0, 1, None
num_layers: int | None = None
deepspeed_checkpointing_enabled = False


def _model_parallel_size(mpu_: Any) -> int:
    for method in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu_, method):
            return int(getattr(mpu_, method)())
    raise TypeError(f"mpu_ has neither get_tensor_model_parallel_world_size nor get_model_parallel_world_size: "
                    f"{mpu_!r}")  # fmt: skip


def _refuse_option(option: str, reason: str) -> None:
    raise NotImplementedError(f"deepspeed.checkpointing.configure({option}=True) is not supported by fzero: {reason}")


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure activation checkpointing, as DeepSpeed's: the arguments override the config's
    `activation_checkpointing` block (`deepspeed_config`: a path or a dict, a whole DeepSpeed config).

    Args:
      mpu_: None, or a model-parallel unit of model-parallel world size 1.
      deepspeed_config: a DeepSpeed config whose `activation_checkpointing` block is read.
      partition_activations, contiguous_checkpointing, checkpoint_in_cpu, profile: False or None only.
      num_checkpoints: the number of checkpoints (DeepSpeed sizes its contiguous buffers with it).
      synchronize: synchronise the accelerator before and after each run of a checkpointed function.

    Raises:
      NotImplementedError: an option fzero cannot honour (named), or a model-parallel `mpu_`.
    """
    global PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    global mpu, num_layers, deepspeed_checkpointing_enabled
    settings: dict[str, Any] = {}
    if deepspeed_config is not None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        block = parse_config(deepspeed_config, world, warn=False).values["activation_checkpointing"]
        settings = {
            "partition_activations": block.get("partition_activations"),
            "contiguous_checkpointing": block.get("contiguous_memory_optimization"),
            "num_checkpoints": block.get("number_checkpoints"),
            "checkpoint_in_cpu": block.get("cpu_checkpointing"),
            "synchronize": block.get("synchronize_checkpoint_boundary"),
            "profile": block.get("profile"),
        }
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize,
             "profile": profile}  # fmt: skip
    settings.update({k: v for k, v in given.items() if v is not None})
    if settings.get("partition_activations"):
        _refuse_option("partition_activations", _PARTITION)
    if settings.get("contiguous_checkpointing"):
        _refuse_option("contiguous_checkpointing", f"it needs partition_activations, which is refused ({_PARTITION})")
    if settings.get("checkpoint_in_cpu"):
        _refuse_option("checkpoint_in_cpu", "the checkpoints stay on the device of the activations")
    if settings.get("profile"):
        _refuse_option("profile", "time the checkpointed blocks with torch.profiler")
    if mpu_ is not None and _model_parallel_size(mpu_) != 1:
        size = _model_parallel_size(mpu_)
        raise NotImplementedError(f"deepspeed.checkpointing.configure(mpu_) with a model-parallel world size of {size} "
                                  f"is not supported by fzero: {_MODEL_PARALLEL}")  # fmt: skip
    mpu = mpu_ if mpu_ is not None else mpu
    num_layers = settings.get("num_checkpoints")
    SYNCHRONIZE = bool(settings.get("synchronize"))
    PARTITION_ACTIVATIONS = CONTIGUOUS_CHECKPOINTING = CPU_CHECKPOINT = PROFILE_TIME = False
    deepspeed_checkpointing_enabled = True


def is_configured() -> bool:
    """Whether `configure` has been called (DeepSpeed's `checkpoint` works either way)."""
    return deepspeed_checkpointing_enabled


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here (eval forwards without backward); fzero keeps none."""


def set_num_layers(nlayers: int) -> None:
    global num_layers
    num_layers = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Raises `NotImplementedError` for True (partitioned checkpoints); False is already the case."""
    if partition_activation:
        _refuse_option("partition_activations", _PARTITION)


def _synchronized(function: Callable[..., Any]) -> Callable[..., Any]:
    if not SYNCHRONIZE:
        return function

    def run(*args: Any) -> Any:
        get_accelerator().synchronize()
        out = function(*args)
        get_accelerator().synchronize()
        return out

    return run


def _positional(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """`function` and `args` with `kwargs` appended as positional arguments (DeepSpeed's way: their tensors are
    then saved and differentiated like the positional ones)."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def with_kwargs(*all_args: Any) -> Any:
        return function(*all_args[:count], **dict(zip(keys, all_args[count:], strict=True)))

    return with_kwargs, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, its activations not kept: recomputed in the backward with the forward's random
    state (reentrant: the backward must be `.backward()`, not `torch.autograd.grad`).

    Returns:
      What `function` returns.
    """
    function, args = _positional(function, args, kwargs)
    return torch.utils.checkpoint.checkpoint(_synchronized(function), *args, use_reentrant=True,
                                             preserve_rng_state=True)  # fmt: skip


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`checkpoint` without reentrance (saved-tensor hooks): also works when no input requires grad."""
    return torch.utils.checkpoint.checkpoint(_synchronized(function), *args, use_reentrant=False,
                                             preserve_rng_state=True)  # fmt: skip


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

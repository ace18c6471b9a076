"""The config's offload blocks (`zero_optimization.offload_optimizer`, `zero_optimization.offload_param`) and the
`aio` block: DeepSpeed 0.19.8's keys, defaults and meaning (its runtime/zero/offload_config.py and
runtime/swap_tensor/aio_config.py), each mapped onto `fzero.Offload` or named as having no effect, and refused
with a named error where fzero cannot do what it asks. docs/offload.md has the table."""

from __future__ import annotations

from typing import Any

from ..host import accelerator
from .schema import Bool, ConfigError, Field, Int, Nullable, Num, Section, Str, UnsupportedConfigError

__all__ = ["AIO", "OFFLOAD_OPTIMIZER", "OFFLOAD_PARAM", "check_offload"]


def _legacy_offload(value: Any) -> dict[str, Any] | None:
    # `"cpu_offload": true` (DeepSpeed's deprecated alias) means the CPU device
    if isinstance(value, bool):
        return {"device": "cpu" if value else "none"}
    return None


NVME_TIER = "device 'nvme': fzero.Offload's"
# offload_param's own settings count where the optimizer is not on NVMe (with it, the compute copy goes in its files)
PARAM_TIER = "device 'nvme' with offload_optimizer.device not 'nvme': fzero.Offload's"
PIPELINED = "no effect: the NVMe tier always reads ahead and writes behind (fzero.storage.Store)"


def _nvme_path(values: dict[str, Any], path: str) -> None:
    if values["device"] == "nvme" and not values["nvme_path"]:
        raise ConfigError(f"{path}.device", "'nvme' needs nvme_path, the directory of its swap files")


OFFLOAD_OPTIMIZER = Section(
    {
        "device": Field(Str(("none", "cpu", "nvme")), "none"),
        "nvme_path": Field(Nullable(Str()), None, effect=f"{NVME_TIER} path: an existing directory"),
        "buffer_count": Field(Int(3), 4, effect=f"{NVME_TIER} buffers: staging sets of the pipeline (>= 3)"),
        "pin_memory": Field(Bool(), True, effect="no effect: host buffers are pinned whenever an accelerator is"),
        "pipeline": Field(Bool(), False, effect=PIPELINED),
        "pipeline_read": Field(Bool(), False, effect=PIPELINED),
        "pipeline_write": Field(Bool(), False, effect=PIPELINED),
        "fast_init": Field(
            Bool(), False, effect="no effect: the initial state is streamed to the files chunk by chunk"
        ),
        "ratio": Field(
            Num(0, 1), 1.0, unsupported="partial offload (ratio < 1) is not implemented", supported=lambda v: v == 1.0
        ),
        "super_offload": Field(
            Bool(), False, effect="fzero.Offload's speculate: each unit's update runs during the backward, validated"
        ),
        "cpuadam_cores_perc": Field(
            Num(0, 1), 0.8, effect="no effect: the speculative update runs on one thread beside the backward's"
        ),
    },
    coerce=_legacy_offload,
    checks=(_nvme_path,),
)

OFFLOAD_PARAM = Section(
    {
        "device": Field(Str(("none", "cpu", "nvme")), "none"),
        "nvme_path": Field(
            Nullable(Str()), None, effect=f"{PARAM_TIER} path (with it the files go with the optimizer's)"
        ),
        "buffer_count": Field(
            Int(0),
            5,
            effect=f"{PARAM_TIER} buffers: staging sets of the compute copy's writes (>= 3); reads: one unit ahead",
        ),
        "buffer_size": Field(Int(0), 100_000_000, effect="no effect: each unit is read into a buffer of its size"),
        "max_in_cpu": Field(Int(0), 1_000_000_000, effect="no effect"),
        "pin_memory": Field(Bool(), True, effect="no effect: host buffers are pinned whenever an accelerator is"),
    },
    coerce=_legacy_offload,
    checks=(_nvme_path,),
)


def check_offload(zero: dict[str, Any], path: str) -> None:
    """What fzero can do of an `offload_param` (DeepSpeed reads it at stage 3 only, and so does fzero) and of
    `super_offload`.

    Args:
      zero: the validated `zero_optimization` block.
      path: its key path, for the errors.

    Raises:
      ConfigError, UnsupportedConfigError: naming the key at fault.
    """
    param, optimizer = zero["offload_param"]["device"], zero["offload_optimizer"]["device"]
    if zero["offload_optimizer"]["super_offload"]:
        key = f"{path}.offload_optimizer.super_offload"
        if optimizer == "none":
            raise ConfigError(key, "true needs offload_optimizer.device 'cpu' or 'nvme' (it speculates their step)")
        if zero["stage"] < 2:
            raise UnsupportedConfigError(key, f"true at stage {zero['stage']} is not supported: SuperOffload runs at "
                                         "stages 2 and 3 (DeepSpeed: 3), where the backward reduces each unit's "
                                         "gradient and its update can start")  # fmt: skip
    key = f"{path}.offload_param.device"
    if zero["stage"] != 3 or param == "none":
        return
    if param == "cpu" and accelerator.name() == "cuda":
        what = "'cpu' with an accelerator (the compute shard copied to the device unit by unit) is not implemented"
        raise UnsupportedConfigError(key, f"{what} (not supported); on a CPU-only machine it lives there already")
    count = zero["offload_param"]["buffer_count"]
    if param == "nvme" and optimizer != "nvme" and count < 3:  # (its own store's pipeline: see OFFLOAD_PARAM)
        raise ConfigError(f"{path}.offload_param.buffer_count", f"must be at least 3 with device 'nvme' and "
                          f"offload_optimizer.device {optimizer!r} (the staging sets of the compute copy's write "
                          f"pipeline, fzero.Offload's buffers), got {count}")  # fmt: skip


def _aio_checks(values: dict[str, Any], path: str) -> None:
    if values["block_size"] % 4096:
        raise ConfigError(f"{path}.block_size", f"must be a multiple of 4096 bytes (aligned I/O), got "
                          f"{values['block_size']}")  # fmt: skip


AIO = Section(
    {
        "block_size": Field(Int(4096), 1_048_576, effect="bytes per I/O request and per checksum of the NVMe tier"),
        "queue_depth": Field(Int(1), 8, effect="no effect: requests queue on the I/O threads"),
        "intra_op_parallelism": Field(Int(1), 1, effect="I/O threads of the NVMe tier"),
        "single_submit": Field(Bool(), False, effect="no effect: each thread submits its own requests"),
        "overlap_events": Field(Bool(), True, effect="no effect: reads and writes always overlap compute"),
        "use_gds": Field(Bool(), False, unsupported="GPUDirect Storage (NVIDIA cuFile) is not implemented"),
    },
    # DeepSpeed renamed `thread_count` and now ignores it without a word; fzero reads it, and says so
    deprecated={"thread_count": "intra_op_parallelism"},
    checks=(_aio_checks,),
)

"""`deepspeed.ops.adam`: DeepSpeed's Adam classes over fzero's optimizers (`DeepSpeedCPUAdam`: the native CPU
kernel; `FusedAdam`: `fzero.adamw(fused=True)`). ZenFlow's are refused by name."""

from typing import Any

from ...refusal import refuse
from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_ZENFLOW = (
    "ZenFlow (stall-free offloading: the CPU updates the less important gradients' columns a step late) is not part "
    "of fzero: use DeepSpeedCPUAdam / FusedAdam, or offload_optimizer.device 'cpu' in the config"
)
_UNSUPPORTED = {
    "ZenFlowCPUAdam": _ZENFLOW,
    "ZenFlowSelectiveAdamW": _ZENFLOW,
    "ZenFlowSelectiveAdamW_stage3": _ZENFLOW,
    "zenflow_cpu_adam": _ZENFLOW,
    "zenflow_torch_adam": _ZENFLOW,
    "multi_tensor_apply": "DeepSpeed's CUDA multi-tensor launcher is not part of fzero (its optimizers run on flat "
    "buffers, one call per update)",
}


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""`deepspeed.ops.lion`: DeepSpeed's Lion classes over fzero's (`DeepSpeedCPULion`: `fzero.cpu_lion`; `FusedLion`:
`fzero.lion`, `fzero.cpu_lion` in CPU memory)."""

from typing import Any

from ...refusal import refuse
from .cpu_lion import DeepSpeedCPULion
from .fused_lion import FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

_UNSUPPORTED = {
    "multi_tensor_apply": "DeepSpeed's CUDA multi-tensor launcher is not part of fzero (its optimizers run on flat "
    "buffers, one call per update)",
}


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

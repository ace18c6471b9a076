"""`deepspeed.accelerator`: `get_accelerator()` and DeepSpeed's accelerator classes, over torch.

    from fzero.deepspeed.accelerator import get_accelerator     # was: from deepspeed.accelerator import ...
    device = get_accelerator().current_device_name()            # "cuda:0", or "cpu"

The accelerator is the one fzero's engine trains on (`real_accelerator`); its methods are DeepSpeed's
(`cpu_accelerator`, `cuda_accelerator`), with DeepSpeed's op builders refused by name (`abstract_accelerator`).
"""

from __future__ import annotations

from typing import Any

from ..refusal import refuse
from .abstract_accelerator import DeepSpeedAccelerator
from .real_accelerator import UNSUPPORTED, get_accelerator, is_current_accelerator_supported

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported"]


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, UNSUPPORTED)

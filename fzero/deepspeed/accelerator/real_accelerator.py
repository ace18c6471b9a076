"""`deepspeed.accelerator.real_accelerator`: `get_accelerator()`, the accelerator fzero trains on.

The choice is fzero's (`fzero.host.accelerator.name()`): CUDA where torch sees a GPU, else the CPU, and
`DS_ACCELERATOR=cpu` (or `cuda`) in the environment forces it, as in DeepSpeed; so the device a script asks the
accelerator about is the one fzero's engine uses. DeepSpeed's other accelerators (xpu, npu, mps, hpu, ...) are not
supported: `DS_ACCELERATOR` naming one is an error that says so.
"""

from __future__ import annotations

from typing import Any

from ...host import accelerator as host
from ..refusal import refuse
from .abstract_accelerator import DeepSpeedAccelerator
from .cpu_accelerator import CPU_Accelerator
from .cuda_accelerator import CUDA_Accelerator

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "get_accelerator", "is_current_accelerator_supported"]

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]

UNSUPPORTED = {
    "set_accelerator": f"fzero's engine trains on the accelerator the environment names: set {host.VARIABLE}=cpu "
    "or cuda before the script starts",
    "dsa2": "import DeepSpeedAccelerator from fzero.deepspeed.accelerator (dsa2 is DeepSpeed's import alias of it)",
}

ds_accelerator: DeepSpeedAccelerator | None = None  # (DeepSpeed's name for the one made)


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator (created on first call, then the same object): a `CUDA_Accelerator` or a
    `CPU_Accelerator`, as `fzero.host.accelerator.name()` chooses.

    Raises:
      ValueError: `DS_ACCELERATOR` names an accelerator fzero does not run on, or `cuda` where torch sees none.
    """
    global ds_accelerator
    if ds_accelerator is None:
        ds_accelerator = CUDA_Accelerator() if host.name() == "cuda" else CPU_Accelerator()
    return ds_accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, UNSUPPORTED)

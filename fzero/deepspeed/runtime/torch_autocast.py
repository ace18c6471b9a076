"""`deepspeed.runtime.torch_autocast`: DeepSpeed 0.19.8's public functions of its `torch_autocast` mode, over fzero's
(`fzero.config.autocast`, `fzero.engine.autocast`).

A script may read the reduction dtype DeepSpeed tags a parameter with (`get_comm_dtype(p)`: the autocast dtype for
the parameters of Linear / Conv modules, or of the configured `lower_precision_safe_modules`, after `initialize`;
the parameter's dtype otherwise), or wrap its own calls in the engine's autocast (`autocast_if_enabled(engine)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ...config.autocast import DEFAULT_MODULES
from ...engine.autocast import PARAM_COMM_DTYPE_ATTR_NAME, autocast_state
from ..accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it too)
from ..refusal import refuse

__all__ = [
    "LOWER_PRECISION_SAFE_MODULES",
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "is_autocast_initialized",
    "sort_dtypes",
]

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]


def get_default_autocast_lower_precision_modules() -> list[str]:
    """The default `lower_precision_safe_modules`, as class paths (`torch.nn.modules.linear.Linear`, ...)."""
    return list(DEFAULT_MODULES)


def is_autocast_initialized() -> bool:
    """Whether an engine with `torch_autocast` enabled was built in this process."""
    return autocast_state() is not None


def get_autocast_dtype() -> torch.dtype | None:
    """The autocast dtype of the last such engine (None before one)."""
    return autocast_state()


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    """Whether `param` was tagged with a reduction dtype (a lower-precision-safe module's parameter)."""
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """The dtype `param`'s gradient is reduced in at ZeRO stages 1-3: its tag, else its own dtype."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)  # type: ignore[no-any-return]


def get_all_comm_dtypes(params: Iterable[Any]) -> set[torch.dtype]:
    """The set of `get_comm_dtype` over `params`."""
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    """`dtypes` in DeepSpeed's order of reduction (by name)."""
    return sorted(dtypes, key=str)


@contextlib.contextmanager
def autocast_if_enabled(engine: Any) -> Iterator[None]:
    """The engine's forward context: DeepSpeed's nested-autocast rule (`fzero.engine.autocast`)."""
    with engine._autocast():
        yield


_UNSUPPORTED = {
    "init_autocast_params": "the engine tags the parameters itself from the config's torch_autocast block when "
    "fzero.initialize builds it (its reductions follow the config, not tags set later)",
}


def __getattr__(name: str) -> Any:
    """DeepSpeed's module globals, read now (`TORCH_AUTOCAST_INITIALIZED`, `TORCH_AUTOCAST_DTYPE`); the rest refused
    by name."""
    if name == "TORCH_AUTOCAST_INITIALIZED":
        return is_autocast_initialized()
    if name == "TORCH_AUTOCAST_DTYPE":
        return get_autocast_dtype()
    return refuse(__name__, name, _UNSUPPORTED)

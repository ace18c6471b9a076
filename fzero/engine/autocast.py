"""The engine's side of DeepSpeed's `torch_autocast` block (`fzero.config.autocast` has the config and the table of
what DeepSpeed 0.19.8 does): `torch.autocast` around every engine forward, by DeepSpeed's nested-autocast rule, and
the engine's accessors of the block.

`autocast_if_enabled` is DeepSpeed's (`runtime/torch_autocast.py`), rule for rule:

| outside the engine | `torch_autocast.enabled` | the engine's forward runs under |
|---|---|---|
| autocast on | true | `torch.autocast(device, dtype)` of the config (an info line, once) |
| autocast on | false | `torch.autocast(device, enabled=False)` (a warning, once): the engine's own precision holds |
| autocast off | true | `torch.autocast(device, dtype)` of the config |
| autocast off | false | nothing |

"Autocast on outside" is `torch.is_autocast_enabled()` without a device, as DeepSpeed calls it: that is CUDA's
autocast (a CPU autocast around a CPU engine is not seen, and stays on, exactly as in DeepSpeed).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config.autocast import DEFAULT_MODULES, autocast_dtype, resolve_modules

__all__ = [
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "AutocastAccessors",
    "autocast_if_enabled",
    "autocast_state",
    "init_autocast_params",
]

logger = logging.getLogger("fzero")
_WARNED_NESTED = False  # (DeepSpeed's `_WARNED_NESTED_AUTOCAST`: once per process)


@contextlib.contextmanager
def autocast_if_enabled(dtype: torch.dtype | None, device_type: str, rank: int = 0) -> Iterator[None]:
    """DeepSpeed's `autocast_if_enabled` (see the module docstring).

    Args:
      dtype: the config's autocast dtype, None where `torch_autocast` is off.
      device_type: the engine's device type (`"cpu"`, `"cuda"`), which the autocast covers.
      rank: this process's rank (the notes are printed by rank 0).
    """
    global _WARNED_NESTED
    if torch.is_autocast_enabled():
        first, _WARNED_NESTED = not _WARNED_NESTED, True
        if dtype is not None:
            if first and rank == 0:
                logger.info("torch.autocast is already enabled outside DeepSpeed. Switching to the configuration "
                            "defined in `torch_autocast` section of DeepSpeed config.")  # fmt: skip
            with torch.autocast(device_type=device_type, dtype=dtype, enabled=True):
                yield
        else:
            if first and rank == 0:
                warnings.warn("torch.autocast is enabled outside DeepSpeed but disabled within the DeepSpeed engine. "
                              "The engine follows its bf16/fp16 settings; configure the `torch_autocast` section to "
                              "use torch's native autocast instead.", stacklevel=4)  # fmt: skip
            with torch.autocast(device_type=device_type, enabled=False):
                yield
    elif dtype is not None:
        with torch.autocast(device_type=device_type, dtype=dtype, enabled=True):
            yield
    else:
        yield


PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
_INITIALIZED: list[torch.dtype] = []  # (DeepSpeed's TORCH_AUTOCAST_INITIALIZED / TORCH_AUTOCAST_DTYPE globals)


def init_autocast_params(model: torch.nn.Module, cfg: Any) -> None:
    """DeepSpeed's `init_autocast_params`: where `torch_autocast` is on, the own parameters of every module of a
    lower-precision-safe class get the attribute `comm_dtype` (the autocast dtype), which
    `fzero.deepspeed.runtime.torch_autocast.get_comm_dtype` reads; the process remembers the dtype
    (`is_autocast_initialized`, `get_autocast_dtype`). The engine's reductions do not read the attribute: the
    engine's policy names the same parameters (`fzero.config.autocast.autocast_policy`)."""
    dtype = autocast_dtype(cfg)
    if dtype is None:
        return
    classes = resolve_modules(cfg["torch_autocast"]["lower_precision_safe_modules"])
    for module in model.modules():
        if type(module) in classes:
            for p in module.parameters(recurse=False):
                setattr(p, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
    _INITIALIZED[:] = [dtype]


def autocast_state() -> torch.dtype | None:
    """The dtype of the last engine built with `torch_autocast` in this process, None if none was."""
    return _INITIALIZED[0] if _INITIALIZED else None


class AutocastAccessors:
    """DeepSpeed's engine accessors of the `torch_autocast` block (mixed into `fzero.engine.Engine`)."""

    config: Any

    def torch_autocast_enabled(self) -> bool:
        """`torch_autocast.enabled`."""
        return bool(self.config["torch_autocast"]["enabled"])

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype (DeepSpeed's `DtypeEnum` value), None where no dtype is configured."""
        block = self.config["torch_autocast"]
        return None if block["dtype"] is None else autocast_dtype({"torch_autocast": {**block, "enabled": True}})

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The configured class paths, or DeepSpeed's default (Linear, Conv1d/2d/3d, by their module paths)."""
        names = self.config["torch_autocast"]["lower_precision_safe_modules"]
        return list(DEFAULT_MODULES) if names is None else list(names)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        """The context of an engine forward (`autocast_if_enabled`)."""
        dtype = self.torch_autocast_dtype() if self.torch_autocast_enabled() else None
        engine: Any = self  # (an Engine: its device and mesh)
        return autocast_if_enabled(dtype, engine.device.type, engine.mesh.rank)

    def _under_autocast(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` (the module or one of its methods, as the engine calls it) run in `_autocast()`."""

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._autocast():
                return fn(*args, **kwargs)

        return call

"""DeepSpeed's API at DeepSpeed's module paths, over fzero: a DeepSpeed script runs with its import lines changed.

    import fzero.deepspeed as deepspeed                  # was: import deepspeed
    from fzero.deepspeed.ops.adam import FusedAdam       # was: from deepspeed.ops.adam import FusedAdam

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config="ds_config.json",
                                                           model_parameters=model.parameters())

`initialize`, `add_config_arguments`, `init_distributed` and `DeepSpeedEngine` are fzero's engine
(`fzero.engine`); the sub-modules (`accelerator`, `comm`, `zero`, `ops`, `utils`, `checkpointing`, ...) are thin
adapters over the engine and the core, imported when first used, as DeepSpeed's are reachable from `deepspeed`.
`__version__` is the DeepSpeed release whose behaviour they follow. A name DeepSpeed has that fzero does not support
raises `NotImplementedError` naming it and what to use instead (`fzero.deepspeed.refusal`); docs/deepspeed.md has
the table.

May import: every package (it is the top layer, beside `fzero.commands`).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..engine import DeepSpeedEngine, add_config_arguments, init_distributed, initialize
from .refusal import refuse

__version__ = "0.19.8"  # the DeepSpeed release whose API and behaviour this package follows

__all__ = ["DeepSpeedEngine", "__version__", "add_config_arguments", "init_distributed", "initialize"]

# DeepSpeed's sub-packages this package has, imported on first use (as `deepspeed.comm` is reachable after
# `import deepspeed`)
_SUBMODULES = ("accelerator", "checkpointing", "comm", "compression", "moe", "ops", "runtime", "utils", "zero")

# top-level names of DeepSpeed 0.19.8 fzero does not support, and what to use instead
_UNSUPPORTED: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "get_accelerator":  # (DeepSpeed re-exports it at the top level)
        return importlib.import_module(f"{__name__}.accelerator").get_accelerator
    return refuse(__name__, name, _UNSUPPORTED)

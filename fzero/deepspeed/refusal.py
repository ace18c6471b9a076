"""How `fzero.deepspeed` says no: a DeepSpeed name fzero does not support raises `NotImplementedError` naming the
DeepSpeed name and fzero's alternative, never an `AttributeError` that looks like a typo in the user's script.

Each module of the package lists the DeepSpeed names it does not support in a table `{name: alternative}` and
ends with `def __getattr__(name): return refuse(__name__, name, TABLE)`; a name DeepSpeed does not have either stays
an `AttributeError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

__all__ = ["refuse"]


def refuse(module: str, name: str, unsupported: Mapping[str, str]) -> NoReturn:
    """Raise for `module.name`: `NotImplementedError` if DeepSpeed has it (a key of `unsupported`, whose value says
    what to use instead), else `AttributeError`."""
    deepspeed = module.replace("fzero.deepspeed", "deepspeed", 1)
    if name in unsupported:
        raise NotImplementedError(f"{deepspeed}.{name} is not supported by fzero: {unsupported[name]}")
    raise AttributeError(f"module {module!r} has no attribute {name!r} (nor has {deepspeed!r})")

"""`deepspeed.utils.module_utils`: reading and replacing a model's attributes by dotted path, as DeepSpeed's."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for `module_name` "a.b.c" (`getattr` at each step: its `AttributeError` names what is
    missing)."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for `module_name` "a.b.c" (an `nn.Module` registers it as a child)."""
    *path, last = module_name.split(".")
    owner = model
    for name in path:
        owner = getattr(owner, name)
    setattr(owner, last, module)

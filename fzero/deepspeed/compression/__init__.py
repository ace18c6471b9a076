"""`deepspeed.compression`: what remains of DeepSpeed's removed compression library, its `helper` module
(`recursive_getattr`, `recursive_setattr`, now in `fzero.deepspeed.utils.module_utils` as in DeepSpeed 0.19.8)."""

from __future__ import annotations

import importlib
from typing import Any

from ..refusal import refuse


def __getattr__(name: str) -> Any:
    if name == "helper":
        return importlib.import_module(f"{__name__}.helper")
    return refuse(__name__, name, {})

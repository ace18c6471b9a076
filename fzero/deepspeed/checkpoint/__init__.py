"""`deepspeed.checkpoint`: DeepSpeed's checkpoint-conversion package. The helper Accelerate calls when it saves a
model's state dict is in `utils` (`clone_tensors_for_torch_save`); DeepSpeed's universal-checkpoint conversion is
refused by name: fzero reshards its own checkpoints on load (docs/checkpoints.md) and imports DeepSpeed's
(`fzero import-deepspeed`).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..refusal import refuse

_UNIVERSAL = (
    "fzero loads its checkpoints on any world size without a universal conversion (docs/checkpoints.md); "
    "`fzero import-deepspeed` reads DeepSpeed's"
)
_UNSUPPORTED = dict.fromkeys(
    ("DeepSpeedCheckpoint", "ds_to_universal", "universal_checkpoint", "reshape_utils", "constants",
     "zero_checkpoint", "deepspeed_checkpoint"),
    _UNIVERSAL,
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "utils":
        return importlib.import_module(f"{__name__}.utils")
    return refuse(__name__, name, _UNSUPPORTED)

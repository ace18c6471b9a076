"""`deepspeed.utils.zero_to_fp32`: a checkpoint's consolidated fp32 parameters, from Python, with DeepSpeed's names.

    from fzero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpts"))      # the checkpoint `latest` names

They read fzero's checkpoints (what `engine.save_checkpoint` writes; `fzero import-deepspeed` converts DeepSpeed's
own) with `fzero.consolidate`: every rank's shards put together, the master dtype, tied parameters under each name.
The command-line form is the `zero_to_fp32.py` that `save_checkpoint` writes beside the checkpoints.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ...engine.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint
from ..refusal import refuse

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_UNSUPPORTED = {
    "convert_zero_checkpoint_to_state_dict": "convert_zero_checkpoint_to_fp32_state_dict (safetensors, fp32), or "
    "fzero.consolidate(dir, dtype=...) for another dtype",
}


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Move `model` to the CPU, load the checkpoint's consolidated parameters into it (strictly), and return it,
    as DeepSpeed's does."""
    model = model.cpu()
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return model


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

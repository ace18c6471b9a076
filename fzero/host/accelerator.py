"""Which device fzero trains on, and which backend its process group uses: DeepSpeed's accelerator choice.

As DeepSpeed: the GPU when CUDA sees one (`cuda:LOCAL_RANK`, NCCL), else the CPU (gloo); `DS_ACCELERATOR=cpu`
(or `cuda`) in the environment forces the choice, as DeepSpeed's `get_accelerator()` reads it, so one variable moves
a run of either library to the CPU on a machine with a GPU (the test suite sets it: its references run on the CPU).

    >>> import os, fzero.host.accelerator as acc
    >>> os.environ["DS_ACCELERATOR"] = "cpu"
    >>> acc.device(), acc.backend()
    (device(type='cpu'), 'gloo')
"""

from __future__ import annotations

import os

import torch

__all__ = ["VARIABLE", "backend", "device", "name"]

VARIABLE = "DS_ACCELERATOR"
_NAMES = ("cpu", "cuda")


def name() -> str:
    """`"cuda"` or `"cpu"`: the environment's `DS_ACCELERATOR` if set, else `"cuda"` where CUDA sees a device.

    Raises:
      ValueError: `DS_ACCELERATOR` names another accelerator, or `cuda` where torch sees none (naming the variable).
    """
    forced = os.environ.get(VARIABLE, "").strip().lower()
    if not forced:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if forced not in _NAMES:
        raise ValueError(f"{VARIABLE}={os.environ[VARIABLE]!r}: fzero runs on {' or '.join(_NAMES)}")
    if forced == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{VARIABLE}=cuda, but torch sees no CUDA device (torch {torch.__version__})")
    return forced


def device() -> torch.device:
    """The device to train on: `cuda:LOCAL_RANK` (made the current device) or the CPU."""
    if name() == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local}, but CUDA sees {torch.cuda.device_count()} device(s): start one process "
                         f"per GPU (torchrun --nproc-per-node), or set {VARIABLE}=cpu to run on the CPU")  # fmt: skip
    out = torch.device("cuda", local)
    torch.cuda.set_device(out)
    return out


def backend() -> str:
    """The process group's backend for this accelerator: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if name() == "cuda" else "gloo"

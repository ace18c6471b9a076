"""A process's random number generators, as tensors and strings a safetensors file can hold.

Captured: torch's CPU generator, every CUDA device's generator (when CUDA is initialised), Python's `random`, and
NumPy's global generator (when NumPy is imported). Restoring them makes a resumed loop draw the same dropout masks
and shuffles as the uninterrupted one.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch import Tensor

__all__ = ["PREFIX", "capture", "restore", "split"]

PREFIX = "@rng/"  # tensor names in the shard files; state keys never start with "@"


def capture() -> tuple[dict[str, Tensor], dict[str, str]]:
    """This process's generator states: tensors (named ``@rng/...``) and header metadata (``rng.*``)."""
    tensors = {PREFIX + "torch": torch.get_rng_state()}
    meta: dict[str, str] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{PREFIX}cuda/{i}"] = s.cpu()
    version, internal, gauss = random.getstate()
    tensors[PREFIX + "python"] = torch.tensor(internal, dtype=torch.int64)
    meta["rng.python.version"] = str(version)
    meta["rng.python.gauss"] = "none" if gauss is None else float(gauss).hex()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        tensors[PREFIX + "numpy"] = torch.from_numpy(keys.astype("int64"))
        meta.update({"rng.numpy.name": name, "rng.numpy.pos": str(pos), "rng.numpy.has_gauss": str(has_gauss)})
        meta["rng.numpy.cached_gaussian"] = float(cached).hex()
    return tensors, meta


def split(tensors: dict[str, Tensor], meta: dict[str, str]) -> dict[str, Any]:
    """The generator states in the form their libraries take: ``{"torch": ByteTensor, "cuda": [ByteTensor...],
    "python": random.getstate() tuple, "numpy": np.random.get_state() tuple}`` (keys present when captured)."""
    out: dict[str, Any] = {}
    if PREFIX + "torch" in tensors:
        out["torch"] = tensors[PREFIX + "torch"]
    cuda = sorted((int(k.rsplit("/", 1)[1]), v) for k, v in tensors.items() if k.startswith(PREFIX + "cuda/"))
    if cuda:
        out["cuda"] = [v for _, v in cuda]
    if PREFIX + "python" in tensors:
        gauss = meta.get("rng.python.gauss", "none")
        out["python"] = (
            int(meta.get("rng.python.version", "3")),
            tuple(int(x) for x in tensors[PREFIX + "python"].tolist()),
            None if gauss == "none" else float.fromhex(gauss),
        )
    if PREFIX + "numpy" in tensors:
        out["numpy"] = (
            meta.get("rng.numpy.name", "MT19937"),
            tensors[PREFIX + "numpy"].numpy().astype("uint32"),
            int(meta.get("rng.numpy.pos", "0")),
            int(meta.get("rng.numpy.has_gauss", "0")),
            float.fromhex(meta.get("rng.numpy.cached_gaussian", "0x0p+0")),
        )
    return out


def restore(states: dict[str, Any]) -> None:
    """Set this process's generators from `split`'s result (those present)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        if len(states["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states["cuda"])
    if "python" in states:
        random.setstate(states["python"])
    np = sys.modules.get("numpy")
    if "numpy" in states and np is not None:
        np.random.set_state(states["numpy"])

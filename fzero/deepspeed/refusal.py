"""How `fzero.deepspeed` says no: a DeepSpeed name fzero does not support raises `NotImplementedError` naming the
DeepSpeed name and fzero's alternative, never an `AttributeError` that looks like a typo in the user's script.

Each module of the package lists the DeepSpeed names it does not support in a table `{name: alternative}` and
ends with `def __getattr__(name): return refuse(__name__, name, TABLE)`; a name DeepSpeed does not have either stays
an `AttributeError`. A whole DeepSpeed module fzero does not have (`from deepspeed.moe.layer import MoE`, with the
import line changed) is refused the same way on import, by a finder on `sys.meta_path` (`MODULES`), rather than
failing with `ModuleNotFoundError`.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

__all__ = ["MODULES", "install_refusing_finder", "refuse"]

_PIPELINE = "fzero has no pipeline parallelism: it shards data-parallel state (ZeRO stages 0-3) over every rank"
_INFERENCE = "fzero trains; it does not run DeepSpeed-Inference: run the trained model (engine.module) with torch"
_MOE = "fzero has no mixture-of-experts layers: use the model's own (their parameters are sharded as any others)"
_TP = "fzero has no tensor or sequence parallelism: it shards data-parallel state (ZeRO stages 0-3)"

# DeepSpeed 0.19.8's modules (under `deepspeed.`) fzero does not have, and what to use instead; a module below one of
# these is refused with it
MODULES: dict[str, str] = {
    "pipe": _PIPELINE,
    "runtime.pipe": _PIPELINE,
    "inference": _INFERENCE,
    "module_inject": _INFERENCE,
    "model_implementations": _INFERENCE,
    "moe.layer": _MOE,
    "moe.experts": _MOE,
    "moe.sharded_moe": _MOE,
    "moe.mappings": _MOE,
    "sequence": _TP,
    "runtime.tensor_parallel": _TP,
    "linear": _TP,
    "autotuning": "fzero has no autotuner: set the config's batch and ZeRO keys yourself",
    "compile": "engine.compile: see docs/deepspeed.md",
    "profiling": "torch.profiler: fzero's steps are named in profiles (fzero.forward, fzero.backward, ...)",
    "nvme": "the config's offload_optimizer / offload_param with device \"nvme\" (fzero's NVMe tier)",
    "launcher": "start the script with torchrun (fzero reads torchrun's environment)",
    "ops.transformer": "DeepSpeed's fused transformer kernels are not built: use the model's own layers",
    "ops.sparse_attention": "DeepSpeed's sparse attention kernels are not built: use the model's own attention",
    "ops.deepspeed4science": "DeepSpeed4Science's kernels are not built",
    "ops.fp_quantizer": "DeepSpeed's FP quantizer kernels are not built",
}


class _Refusing(importlib.abc.MetaPathFinder):
    """Refuses the import of a module of `MODULES` under `fzero.deepspeed` (see the module docstring)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> None:
        prefix = "fzero.deepspeed."
        if not fullname.startswith(prefix):
            return None
        name = fullname[len(prefix) :]
        for module, alternative in MODULES.items():
            if name == module or name.startswith(module + "."):
                raise NotImplementedError(f"deepspeed.{name} is not supported by fzero: {alternative}")
        return None


def install_refusing_finder() -> None:
    """Put the refusing finder on `sys.meta_path`, first (once)."""
    if not any(isinstance(f, _Refusing) for f in sys.meta_path):
        sys.meta_path.insert(0, _Refusing())


def refuse(module: str, name: str, unsupported: Mapping[str, str]) -> NoReturn:
    """Raise for `module.name`: `NotImplementedError` if DeepSpeed has it (a key of `unsupported`, whose value says
    what to use instead), else `AttributeError`."""
    deepspeed = module.replace("fzero.deepspeed", "deepspeed", 1)
    if name in unsupported:
        raise NotImplementedError(f"{deepspeed}.{name} is not supported by fzero: {unsupported[name]}")
    raise AttributeError(f"module {module!r} has no attribute {name!r} (nor has {deepspeed!r})")

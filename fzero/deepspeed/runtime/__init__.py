"""`deepspeed.runtime`: the module paths of DeepSpeed's runtime that training scripts import.

`utils` (`see_memory_usage`, `move_to_device`, ...), `lr_schedules` (the scheduler objects, over fzero's schedules),
`dataloader` (`RepeatingLoader`, `DeepSpeedDataLoader`), `data_pipeline` (curriculum learning and random-LTD),
`torch_autocast` and `zero` (`zero.Init`, `GatheredParameters`, ...) are imported on first use, as DeepSpeed's are
reachable from `deepspeed.runtime`. DeepSpeed's engine, config, pipeline, inference and precision
modules are refused by name with fzero's counterpart (a `from deepspeed.runtime.pipe import ...` line fails with
`ModuleNotFoundError`: the package cannot intercept the import of a module it lacks).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..refusal import refuse

_SUBMODULES = ("data_pipeline", "dataloader", "lr_schedules", "torch_autocast", "utils", "zero")

_PARALLEL = "fzero has no pipeline, tensor or sequence parallelism: it shards data-parallel state (ZeRO)"
_UNSUPPORTED: dict[str, str] = {
    "engine": "fzero.deepspeed.DeepSpeedEngine is fzero's engine (built by fzero.deepspeed.initialize)",
    "config": "fzero.config.parse_config reads and validates a DeepSpeed config",
    "config_utils": "fzero.config.parse_config reads and validates a DeepSpeed config",
    "constants": "fzero.config.SCHEMA holds every config key with its default",
    "activation_checkpointing": "fzero.deepspeed.checkpointing",
    **dict.fromkeys(
        """
        pipe tensor_parallel sequence_parallel domino
        """.split(),
        _PARALLEL,
    ),
    **dict.fromkeys(
        """
        hybrid_engine hybrid_engine_graph rollout
        """.split(),
        "fzero does not run inference",
    ),
    **dict.fromkeys(
        """
        fp16 bf16_optimizer precision_config keep_in_fp32
        """.split(),
        "precision is the config's fp16 / bf16 block (fzero.state.precision)",
    ),
    **dict.fromkeys(
        """
        checkpoint_engine model_checkpointing state_dict_factory
        """.split(),
        "engine.save_checkpoint / load_checkpoint write fzero's safetensors checkpoints (fzero.checkpoint)",
    ),
    **dict.fromkeys(
        """
        swap_tensor superoffload zenflow
        """.split(),
        "offload through the config (offload_optimizer)",
    ),
    **dict.fromkeys(
        """
        base_optimizer comm compiler python_gc sparse_tensor chunked_cross_entropy weight_quantizer
        """.split(),
        "DeepSpeed's engine internals: fzero's engine and transforms are their own",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return refuse(__name__, name, _UNSUPPORTED)

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
from .refusal import install_refusing_finder, refuse

__version__ = version = "0.19.8"  # the DeepSpeed release whose API and behaviour this package follows
git_hash = __git_hash__ = None  # (DeepSpeed's build information: this is not a build of DeepSpeed)
git_branch = __git_branch__ = None
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

__all__ = [
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "DeepSpeedEngine",
    "__version__",
    "add_config_arguments",
    "git_branch",
    "git_hash",
    "init_distributed",
    "initialize",
    "version",
]

# DeepSpeed's sub-packages this package has, imported on first use (as `deepspeed.comm` is reachable after
# `import deepspeed`)
_SUBMODULES = (
    "accelerator",
    "checkpoint",
    "checkpointing",
    "comm",
    "compression",
    "moe",
    "ops",
    "runtime",
    "utils",
    "zero",
)

# top-level names of DeepSpeed 0.19.8 fzero does not support, and what to use instead
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        init_inference InferenceEngine DeepSpeedInferenceConfig default_inference_config inference module_inject
        replace_transformer_layer
        """.split(),
        "fzero trains; it does not run DeepSpeed-Inference: run the trained model (engine.module) with torch",
    ),
    **dict.fromkeys(
        "PipelineModule PipelineEngine DualPipeVEngine DualPipeVModule pipe".split(),
        "fzero has no pipeline parallelism: it shards data-parallel state (ZeRO stages 0-3) over every rank",
    ),
    **dict.fromkeys(
        """
        set_autotp_mode tp_model_init merge_tp_model_init_into_config record_tp_model_init_args load_ds_config
        """.split(),
        "fzero has no tensor parallelism (AutoTP); fzero.config.parse_config reads a DeepSpeed config",
    ),
    **dict.fromkeys(
        """
        MUON_OPTIMIZER QUERY KV MLA_Q MLA_KV NOT_HEAD_BLOCKED resolve_per_head_muon_after_sharding set_optimizer_flags
        """.split(),
        "DeepSpeed's Muon internals: fzero's Muon is the config's optimizer type \"Muon\" (fzero.muon)",
    ),
    "DeepSpeedHybridEngine": "fzero has no hybrid (training and generation) engine",
    "DeepSpeedConfig": "fzero.config.parse_config reads and validates a DeepSpeed config",
    "DeepSpeedConfigError": "fzero.config.ConfigError (a ValueError naming the key)",
    "DeepSpeedDataLoader": "pass training_data to initialize: it returns a torch DataLoader sharded per rank",
    "DeepSpeedOptimizer": "fzero.deepspeed.ops's optimizer classes, or any torch.optim optimizer",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not built: use the model's own layers",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not built: use the model's own layers",
    "OnDevice": "build the model on the meta device and pass initializer= to fzero.init, or use "
    "fzero.deepspeed.zero.Init",
    "HAS_TRITON": "fzero uses no Triton kernels",
}


# DeepSpeed's top-level names that live in a sub-module (imported with it, on first use)
_FROM = {"get_accelerator": "accelerator", "log_dist": "utils", "logger": "utils", "checkpointing": "checkpointing"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FROM:
        module = importlib.import_module(f"{__name__}.{_FROM[name]}")
        return module if name == _FROM[name] else getattr(module, name)
    return refuse(__name__, name, _UNSUPPORTED)


install_refusing_finder()

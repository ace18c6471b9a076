"""`deepspeed.zero`: building a model partitioned and reaching its partitioned parameters, over fzero's engine.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):     # was: import deepspeed
        model = MyLargeModel()                                     # no rank holds it whole
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.zero_()                              # lands in every rank's partition
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())

`Init` (`init`), `GatheredParameters`, `register_external_parameter`, `unregister_external_parameter` and
`is_zero_param` (`gathered`), `ZeroParamStatus` and `ZeroParamType` (the parameters' `ds_status` and
`ds_param_type`, `fzero.engine.parameters`), and `HfDeepSpeedConfig` (`hf`: tells Hugging Face transformers that
ZeRO-3 is on, so that `from_pretrained` builds under `Init` and loads into the partitions). DeepSpeed's `zero`
is its `runtime.zero` package; `fzero.deepspeed.runtime.zero` is this one under that path. DeepSpeed's other names
here are refused with fzero's alternative.

May import: every package (it is part of `fzero.deepspeed`, the top layer).
"""

from __future__ import annotations

import importlib
from typing import Any

from ...engine.parameters import ZeroParamStatus, ZeroParamType
from ..refusal import refuse
from .gathered import GatheredParameters, is_zero_param, register_external_parameter, unregister_external_parameter
from .hf import HfDeepSpeedConfig
from .init import Init

__all__ = [
    "GatheredParameters",
    "HfDeepSpeedConfig",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "is_zero_param",
    "register_external_parameter",
    "unregister_external_parameter",
]

_UNITS = "fzero gathers by unit (each nn.ModuleList child, or fzero.layout.BySize subtrees)"
UNSUPPORTED: dict[str, str] = {
    "TiledLinear": f"{_UNITS}: split a large layer into modules of its own instead",
    "TiledLinearReturnBias": f"{_UNITS}: split a large layer into modules of its own instead",
    "DeepSpeedZeRoOffload": "parameter offload is the config's offload_param block, run by fzero's engine",
    "DeepSpeedTensorOverride": "fzero keeps the dtype and device the modules create (fzero.deepspeed.zero.init)",
    "unwrap_model_for_generation": "fzero does not run generation: gather what you need with GatheredParameters",
    "MiCS_Init": "use zero.Init with the config's mics_shard_size: the engine builds the MiCS mesh at initialize",
}


def __getattr__(name: str) -> Any:
    if name == "partition_parameters":  # (DeepSpeed's module, reachable from `deepspeed.zero`)
        return importlib.import_module("fzero.deepspeed.runtime.zero.partition_parameters")
    return refuse(__name__, name, UNSUPPORTED)

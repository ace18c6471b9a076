"""`deepspeed.moe`: DeepSpeed's mixture-of-experts package. fzero has no MoE layers or expert parallelism; the
parameter-group helpers training scripts call on dense models are in `utils` (`fzero.deepspeed.moe.utils`), where
every parameter is dense, as DeepSpeed finds it without MoE layers. The layers are refused by name.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..refusal import refuse

_EXPERTS = "fzero has no mixture-of-experts layers or expert parallelism; train a dense model"
_UNSUPPORTED = dict.fromkeys(
    ("layer", "sharded_moe", "experts", "mappings", "ep_count", "ep_experts", "ep_kernels", "ep_repack", "ep_router",
     "ep_tp_dispatch", "fused_expert_layout", "MoE"),
    _EXPERTS,
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "utils":
        return importlib.import_module(f"{__name__}.utils")
    return refuse(__name__, name, _UNSUPPORTED)

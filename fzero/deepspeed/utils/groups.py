"""`deepspeed.utils.groups`: DeepSpeed's process-group queries, for fzero's parallelism: data parallelism only.

fzero shards over the data-parallel ranks, which are the whole world (its hybrid meshes, hpZ and MiCS, split the
sharding, not the data): the data-parallel group is the world group, the model- and sequence-parallel sizes are 1
(ranks 0), and the sequence-data-parallel group is the data-parallel one, as DeepSpeed answers without a model-
parallel unit. Tensor-, expert- and sequence-parallel groups do not exist: refused by name.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it too)
from ..refusal import refuse
from .logging import log_dist

__all__ = [
    "expert_tensor_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "log_dist",
]

mpu: Any = None  # (DeepSpeed's model-parallel unit: fzero takes none)
mesh_device: Any = None
expert_tensor_parallel_world_size = 1

_TENSOR = "fzero has no tensor (model) parallelism: every rank holds whole layers"
_EXPERT = "fzero has no mixture-of-experts layers or expert parallelism"
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        get_tensor_model_parallel_group get_model_parallel_group set_tensor_model_parallel_world_size
        set_tensor_model_parallel_rank bwc_tensor_model_parallel_world_size bwc_pipeline_parallel_world_size
        _init_tp_groups_with_new_group _init_tp_mesh_device _create_model_parallel
        """.split(),
        _TENSOR,
    ),
    **dict.fromkeys(
        """
        initialize DeprecatedException _create_expert_and_data_parallel _get_expert_parallel_ranks
        _create_expert_data_and_model_parallel _get_max_expert_size _get_max_expert_size_name
        _get_max_expert_parallel_group _get_expert_parallel_group _get_expert_parallel_group_ranks
        _get_expert_parallel_group_dict _get_expert_data_parallel_group
        _get_expert_data_parallel_group_ranks _get_expert_data_parallel_group_dict
        _get_expert_broadcast_src_rank _get_expert_parallel_world_size _get_expert_data_parallel_world_size
        _get_expert_parallel_rank _get_expert_parallel_src_rank _get_expert_data_parallel_rank
        _get_expert_model_parallel_world_size _get_local_all_to_all_group
        """.split(),
        _EXPERT,
    ),
    "_get_sequence_parallel_group": "fzero has no sequence parallelism (its config refuses sequence_parallel_size)",
    **dict.fromkeys(
        """
        _create_zero_param_parallel_group _get_zero_param_intra_parallel_group
        _zero_param_parallel_is_initialized _get_zero_param_intra_parallel_rank_in_mygroup
        _get_zero_param_intra_parallel_group_world_size _get_zero_param_intra_parallel_group_ranks
        """.split(),
        "fzero's hpZ (zero_hpz_partition_size) shards over an axis of its mesh: engine.mesh",
    ),
}


def _require(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"deepspeed.utils.groups.{what}: torch.distributed is not initialised; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) first")  # fmt: skip


def _get_data_parallel_group() -> Any:
    """The data-parallel group: the world group. (DeepSpeed clones it with `new_group` so that older torch's
    `get_global_rank` accepts it; torch's accepts the world group itself.)"""
    _require("_get_data_parallel_group")
    return dist.group.WORLD


def _get_data_parallel_group_ranks() -> range:
    _require("_get_data_parallel_group_ranks")
    return range(dist.get_world_size())


def _get_data_parallel_world_size() -> int:
    _require("_get_data_parallel_world_size")
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    _require("_get_data_parallel_rank")
    return dist.get_rank()


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    _require("_get_sequence_parallel_world_size")
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def _get_broadcast_src_rank() -> int:
    """The world rank of the data-parallel group's rank 0: 0."""
    _require("_get_broadcast_src_rank")
    return 0


def _clone_world_group() -> Any:
    return _get_data_parallel_group()


def get_data_parallel_group() -> Any:
    return _get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _get_data_parallel_rank()


def get_model_parallel_world_size() -> int:
    return 1


def get_tensor_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_src_rank() -> int:
    """The world rank of this rank's tensor-parallel group's first rank: this rank (groups of one)."""
    _require("get_tensor_model_parallel_src_rank")
    return dist.get_rank()


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""`deepspeed.comm`: DeepSpeed's collectives and process-group queries, over `torch.distributed`.

    from fzero.deepspeed import comm as dist                  # was: from deepspeed import comm as dist
    dist.init_distributed()                                   # torchrun's environment, or one rank without it
    dist.all_reduce(t, op=dist.ReduceOp.AVG)

The functions are in `comm` (DeepSpeed's signatures, torch's results), the reduce operations in `reduce_op`.
DeepSpeed's communication logger (`log_summary`, `configure(enabled=True)`, ...), its backend objects and its
inference collectives are refused by name; fzero's own record of what moved is its mesh's ledger.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import GradBucket

from ..accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it too)
from ..refusal import refuse
from .comm import *  # noqa: F403 (DeepSpeed's module re-exports its functions the same way)
from .comm import __all__ as _functions
from .reduce_op import ReduceOp

__all__ = [
    *_functions,
    "CCL_BACKEND",
    "GLOO_BACKEND",
    "HCCL_BACKEND",
    "MPI_BACKEND",
    "NCCL_BACKEND",
    "SCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "GradBucket",
    "ReduceOp",
    "configure",
]

NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

_LOGGER = ("fzero has no communication logger; its mesh counts every collective's bytes: "
           "`with engine.mesh.record() as ledger: ...`")  # fmt: skip
_BACKENDS = "fzero calls torch.distributed directly: use it (or this module's functions) for the process group"
_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        """
        log_summary reset_log has_comm_data get_comm_operation_count get_logged_comm_ops comms_logger
        CommsLogger timed_op timers timer_summary get_caller_func get_default_args get_tensor_position
        get_tensor_kwarg get_msg_size_from_args get_debug_log_name COMMS_LOGGER COMMS_LOGGER_DEBUG
        COMMS_LOGGER_DEBUG_DEFAULT COMMS_LOGGER_ENABLED COMMS_LOGGER_ENABLED_DEFAULT COMMS_LOGGER_FORMAT
        COMMS_LOGGER_PROF_ALL COMMS_LOGGER_PROF_ALL_DEFAULT COMMS_LOGGER_PROF_OPS
        COMMS_LOGGER_PROF_OPS_DEFAULT COMMS_LOGGER_VERBOSE COMMS_LOGGER_VERBOSE_DEFAULT
        """.split(),
        _LOGGER,
    ),
    **dict.fromkeys(
        """
        cdb TorchBackend CCLBackend ProcessGroup set_backend init_deepspeed_backend nccl_backend mpi_backend
        ccl_backend hccl_backend
        """.split(),
        _BACKENDS,
    ),
    **dict.fromkeys(
        """
        mpi_discovery in_aml in_aws_sm in_dlts patch_aml_env_for_torch_nccl_backend
        patch_aws_sm_env_for_torch_nccl_backend DEFAULT_AML_MASTER_PORT DEFAULT_AML_NCCL_SOCKET_IFNAME
        """.split(),
        "fzero reads the launcher's environment (torchrun, or the deepspeed launcher's RANK/WORLD_SIZE/MASTER_*); "
        "start MPI, AzureML or SageMaker jobs through torchrun",
    ),
    "inference_all_reduce": "fzero does not run inference: all_reduce is the same reduction",
    "initialize_mesh_device": "fzero's meshes are its own (fzero.DistMesh); torch.distributed.device_mesh."
    "init_device_mesh builds a torch DeviceMesh",
    "enable_symm_mem_for_group": "torch.distributed._symmetric_memory.enable_symm_mem_for_group",
}


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None,
              debug: bool | None = None) -> None:  # fmt: skip
    """DeepSpeed's communication-logger settings: turning the logger on is refused (fzero has none); anything
    else leaves nothing to do.

    Raises:
      NotImplementedError: `enabled`, `prof_all` or `prof_ops` asks for logging.
    """
    if enabled or prof_all or prof_ops:
        raise NotImplementedError(f"deepspeed.comm.configure(enabled=True) is not supported by fzero: {_LOGGER}")


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

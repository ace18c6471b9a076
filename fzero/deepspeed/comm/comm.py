"""DeepSpeed's collectives and process-group queries (`deepspeed.comm.comm`), over `torch.distributed`.

Each function has DeepSpeed's signature and hands its arguments to the `torch.distributed` call DeepSpeed's torch
backend makes, so results are the same bitwise. DeepSpeed's extra arguments `prof`, `log_name` and `debug` feed its
communication logger only; fzero has none (`deepspeed.comm.log_summary` is refused), so they are accepted and have
no effect, as in DeepSpeed with the logger off (its default).

`init_distributed` is fzero's (`fzero.engine.init_distributed`): the launcher's environment, or without a launcher a
group of one process (rank 0, `127.0.0.1`); DeepSpeed 0.19.8 asks mpi4py for the layout there, which gives the same
one-rank group where mpi4py is installed and fails where it is not.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ...engine import init_distributed
from ...host import process_group
from .reduce_op import ReduceOp, torch_op

__all__ = [
    "P2POp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_rank",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

# DeepSpeed's default collective timeout (its `deepspeed.constants.default_pg_timeout`), as it reads it at import
default_pg_timeout = datetime.timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", default=10)))


def _require(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"deepspeed.comm.{what}: torch.distributed is not initialised; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) first")  # fmt: skip


# ---------------------------------------------------------------------------------------------- the process group
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world), -1 if not a member."""
    _require("get_rank")
    return dist.get_rank(group=group)


def get_world_size(group: Any = None) -> int:
    """The number of processes in `group` (default: the world), -1 if not a member."""
    _require("get_world_size")
    return dist.get_world_size(group=group)


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (`LOCAL_RANK`; 0 without a launcher)."""
    _require("get_local_rank")
    return get_local_rank_from_launcher()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The world rank of `group`'s rank `group_rank` (torch's `get_global_rank`: `group` must be a group, not
    None)."""
    _require("get_global_rank")
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The world ranks of `group`'s members in group-rank order (DeepSpeed's loop: [] for `group=None`)."""
    _require("get_all_ranks_from_group")
    ranks: list[int] = []
    try:
        while True:
            ranks.append(dist.get_global_rank(group, len(ranks)))
    except (RuntimeError, ValueError):
        pass
    return ranks


def get_world_group() -> Any:
    _require("get_world_group")
    return dist.group.WORLD


def new_group(ranks: Any) -> Any:
    """A new process group of the world ranks `ranks` (every process of the world must call it)."""
    _require("new_group")
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    """Destroy `group`, or with None the default group and every other (freed at once: `fzero.host.process_group`
    explains why that matters)."""
    if group is None or group is dist.group.WORLD:
        process_group.shutdown()
    else:
        dist.destroy_process_group(group)


def get_local_rank_from_launcher() -> int:
    """`LOCAL_RANK`, else Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK`, else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_world_rank_from_launcher() -> int:
    """`RANK`, else Open MPI's `OMPI_COMM_WORLD_RANK`, else 0."""
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))


def get_world_size_from_launcher() -> int:
    """`WORLD_SIZE`, else Open MPI's `OMPI_COMM_WORLD_SIZE`, else 1."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def has_all_gather_into_tensor() -> bool:
    _require("has_all_gather_into_tensor")
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    _require("has_reduce_scatter_tensor")
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    _require("has_all_reduce_coalesced")
    return hasattr(dist, "all_reduce_coalesced")


def has_coalescing_manager() -> bool:
    _require("has_coalescing_manager")
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


# -------------------------------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:  # fmt: skip
    """Reduce `tensor` over `group` in place with `op` (DeepSpeed's or torch's `ReduceOp`)."""
    return dist.all_reduce(tensor, op=torch_op(op), group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
                         debug: Any = None) -> Any:  # fmt: skip
    return dist.all_reduce_coalesced(tensors, op=torch_op(op), group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:  # fmt: skip
    return dist.reduce(tensor, dst=dst, op=torch_op(op), group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Any = None) -> Any:  # fmt: skip
    """Copy world rank `src`'s `tensor` into every rank's `tensor`."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None,
                          prof: bool = False, log_name: str = "broadcast_object_list",
                          debug: Any = None) -> Any:  # fmt: skip
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:  # fmt: skip
    """Every rank's `tensor` into `tensor_list` (one per rank, in rank order)."""
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> Any:  # fmt: skip
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:  # fmt: skip
    """Every rank's `tensor`, concatenated in rank order, into `output_tensor`."""
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False,
                 debug: Any = None) -> Any:  # fmt: skip
    _require("allgather_fn")
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _Works:
    """Several pending collectives waited on as one (DeepSpeed's coalesced calls return one handle)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None,
                         async_op: bool = False) -> Any:  # fmt: skip
    """`all_gather_into_tensor` of each input into its output; with `async_op` one handle for all of them."""
    _require("all_gather_coalesced")
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    works = _Works([dist.all_gather_into_tensor(o, i, group=group, async_op=True)
                    for o, i in zip(output_tensors, input_tensors, strict=True)])  # fmt: skip
    if async_op:
        return works
    works.wait()
    return None


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter",
                   debug: Any = None) -> Any:  # fmt: skip
    return dist.reduce_scatter(output, input_list, op=torch_op(op), group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:  # fmt: skip
    """Reduce `tensor` over the ranks with `op`; rank r keeps the r-th equal slice in `output_tensor`."""
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=torch_op(op), group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:  # fmt: skip
    _require("reduce_scatter_fn")
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Any = None) -> Any:  # fmt: skip
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)  # fmt: skip


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_to_all",
               debug: Any = None) -> Any:  # fmt: skip
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:  # fmt: skip
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter",
            debug: Any = None) -> Any:  # fmt: skip
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None, prof: bool = False,
            log_name: str = "barrier", debug: Any = None) -> Any:  # fmt: skip
    """Wait until every rank of `group` (default: the world) reaches it."""
    return dist.barrier(group=dist.group.WORLD if group is None else group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False,
                      prof: bool = False, log_name: str = "monitored_barrier", debug: Any = None) -> Any:  # fmt: skip
    return dist.monitored_barrier(group=dist.group.WORLD if group is None else group, timeout=timeout,
                                  wait_all_ranks=wait_all_ranks)  # fmt: skip


# ------------------------------------------------------------------------------------------------ point to point
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False, log_name: str = "send",
         debug: Any = None) -> Any:  # fmt: skip
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> Any:  # fmt: skip
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False, log_name: str = "isend",
          debug: Any = None) -> Any:  # fmt: skip
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Any = None) -> Any:  # fmt: skip
    return dist.irecv(tensor, src=src, group=group, tag=tag)


class P2POp:
    """A point-to-point operation for `batch_isend_irecv`: `op` is `isend` or `irecv` (this module's), `peer` the
    world rank of the destination or source."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> None:
        if op is not isend and op is not irecv:
            raise ValueError(f"op must be deepspeed.comm.isend or deepspeed.comm.irecv, got {op!r}")
        self.op = "isend" if op is isend else "irecv"
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


def batch_isend_irecv(p2p_op_list: list[P2POp], prof: bool = False, log_name: str = "batch_isend_irecv",
                      debug: Any = None) -> list[Any]:  # fmt: skip
    """Launch the operations as one batch; returns their requests."""
    ops = [dist.P2POp(getattr(dist, p.op), p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
    return dist.batch_isend_irecv(ops)

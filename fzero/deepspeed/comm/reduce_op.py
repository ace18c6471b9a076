"""DeepSpeed's `deepspeed.comm.ReduceOp`: its own enum, converted to torch's `ReduceOp` at each collective (torch's
own values are accepted as well, as DeepSpeed accepts them)."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch.distributed as dist

__all__ = ["ReduceOp", "torch_op"]


class ReduceOp(Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def torch_op(op: Any) -> Any:
    """`op` as a `torch.distributed.ReduceOp`.

    Raises:
      ValueError: `op` is `ReduceOp.UNUSED` or neither DeepSpeed's nor torch's reduce operation.
    """
    if isinstance(op, dist.ReduceOp):  # (torch's members, ReduceOp.SUM etc., are instances of it)
        return op
    if isinstance(op, ReduceOp) and op is not ReduceOp.UNUSED:
        return getattr(dist.ReduceOp, op.name)
    raise ValueError(f"op must be a deepspeed.comm.ReduceOp (not UNUSED) or a torch.distributed.ReduceOp, got {op!r}")

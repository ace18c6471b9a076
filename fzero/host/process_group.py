"""The default process group's lifetime: created with a timeout, destroyed deterministically before exit.

Why an explicit shutdown: building any torch optimizer imports `torch._dynamo`, which imports
`torch.distributed.nn.functional`, whose functions take `group=group.WORLD` as a default argument. Imported after
`init_process_group`, those defaults hold the process group itself, so `destroy_process_group()` does not free it:
the gloo group's threads are then torn down by the garbage collector during the interpreter's finalization, which
now and then aborts the process ("terminate called without an active exception", SIGABRT). `shutdown()` destroys
the group and drops those stale references, so the group is freed at that line, while the interpreter is whole;
`shutdown_at_exit()` arranges for it to run before the interpreter exits (`DistMesh` and `init_distributed` do).

The node layout (`node_layout`, `local_world_size`, `local_rank`) is what the launcher says: torchrun's
`LOCAL_WORLD_SIZE` and `LOCAL_RANK` (DeepSpeed's own launcher sets `LOCAL_SIZE`, which DeepSpeed's CPU accelerator
reads as its device count; DeepSpeed's CUDA accelerator counts the GPUs). Ranks are numbered node by node (rank
`node * L + LOCAL_RANK`), as torchrun numbers them and DeepSpeed's node groups assume.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import sys
import types
from typing import Any

import torch.distributed as dist

__all__ = [
    "as_timedelta",
    "init_process_group",
    "local_rank",
    "local_world_size",
    "node_layout",
    "set_timeout",
    "shutdown",
    "shutdown_at_exit",
]

Timeout = float | int | datetime.timedelta


def as_timedelta(timeout: Timeout, what: str = "timeout") -> datetime.timedelta:
    """A timeout in seconds (int or float) or a `timedelta`, as a positive `timedelta`.

    Raises:
      TypeError, ValueError: not a number of seconds or a `timedelta`, not finite, or not positive.
    """
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{what} must be a number of seconds or a datetime.timedelta, got {timeout!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def set_timeout(timeout: Timeout, group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """Set the timeout of every later collective of `group` (default: the world group); returns it.

    A collective that waits longer than this for another rank fails on the ranks still waiting (gloo raises; NCCL
    aborts per its own `TORCH_NCCL_*` settings)."""
    delta = as_timedelta(timeout)
    target = group if group is not None else dist.group.WORLD
    if target is None:
        raise RuntimeError("set_timeout: torch.distributed is not initialised (no process group)")
    target.set_timeout(delta)
    return delta


def init_process_group(
    backend: str,
    *,
    timeout: Timeout | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """`torch.distributed.init_process_group`, with `timeout` in seconds or a `timedelta`, and the group shut
    down deterministically before the interpreter exits (see the module docstring)."""
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method, "rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = as_timedelta(timeout)
    dist.init_process_group(**kwargs)
    shutdown_at_exit()


def _drop_stale_references() -> None:
    """With no process group left, reset to None the function defaults in torch's distributed modules that still
    hold a (destroyed) group: None is what they hold when imported before any group exists, and it means the
    default group at call time."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for fn in list(vars(module).values()):
            if type(fn) is not types.FunctionType:  # type(): touches no attribute, so no deprecation warning
                continue
            defaults = fn.__defaults__
            if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
                fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in defaults)
            kw = fn.__kwdefaults__
            if kw and any(isinstance(v, dist.ProcessGroup) for v in kw.values()):
                fn.__kwdefaults__ = {k: None if isinstance(v, dist.ProcessGroup) else v for k, v in kw.items()}


def shutdown() -> None:
    """Destroy the default process group (and every subgroup) now, if one exists, and free it at once (see the
    module docstring). Safe to call more than once, and after `torch.distributed.destroy_process_group()`."""
    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _drop_stale_references()


_registered = False


def shutdown_at_exit() -> None:
    """Run `shutdown()` when the interpreter exits normally or on an uncaught exception (before its finalization,
    which is where a leftover gloo group aborts the process). Idempotent."""
    global _registered
    if not _registered:
        atexit.register(shutdown)
        _registered = True


def env_timeout() -> datetime.timedelta | None:
    """DeepSpeed's `DEEPSPEED_TIMEOUT` environment variable (minutes), if set."""
    value = os.environ.get("DEEPSPEED_TIMEOUT")
    if value is None or not value.strip():
        return None
    try:
        return as_timedelta(float(value) * 60, "DEEPSPEED_TIMEOUT (minutes)")
    except (TypeError, ValueError) as e:
        raise ValueError(f"DEEPSPEED_TIMEOUT must be a positive number of minutes, got {value!r}") from e


# ---------------------------------------------------------------------------------------------------- node layout
def _env_int(name: str, low: int) -> int | None:
    """The environment variable `name` as an int >= `low`, or None where it is unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.lstrip("-").isdigit() or int(value) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _size_name() -> str:
    """The variable `local_world_size()` read: torchrun's, unless only the `deepspeed` launcher's is set."""
    return "LOCAL_WORLD_SIZE" if os.environ.get("LOCAL_WORLD_SIZE", "").strip() else "LOCAL_SIZE"


def local_world_size() -> int | None:
    """The processes the launcher started on this node: `LOCAL_WORLD_SIZE` (torchrun), else `LOCAL_SIZE` (the
    `deepspeed` launcher); None where neither is set.

    Raises:
      ValueError: a variable that is not a positive integer, or both set and different, naming them.
    """
    torchrun, deepspeed = _env_int("LOCAL_WORLD_SIZE", 1), _env_int("LOCAL_SIZE", 1)
    if torchrun is not None and deepspeed is not None and torchrun != deepspeed:
        raise ValueError(f"LOCAL_WORLD_SIZE={torchrun} and LOCAL_SIZE={deepspeed} disagree on the processes per node")
    return torchrun if torchrun is not None else deepspeed


def local_rank() -> int:
    """This process's index on its node: `LOCAL_RANK` (0 where unset).

    Raises:
      ValueError: not a non-negative integer, or not below `local_world_size()`, naming both.
    """
    rank, size = _env_int("LOCAL_RANK", 0) or 0, local_world_size()
    if size is not None and rank >= size:
        raise ValueError(f"LOCAL_RANK={rank} is not below {_size_name()}={size} (the processes on this node)")
    return rank


def node_layout(world: int) -> tuple[int, int]:
    """`(nodes, ranks per node)` of `world` ranks started by a launcher: `ranks per node = local_world_size()`, and
    one node of `world` ranks where the launcher does not say (a plain process, `torch.multiprocessing`).

    Args:
      world: the ranks (the world group's size).

    Returns:
      `(world // L, L)`.

    Raises:
      ValueError: `L` does not divide `world` (WORLD_SIZE), `LOCAL_RANK` is not below `L`, or `RANK` is not
        `node * L + LOCAL_RANK` (the ranks of a node are not consecutive), naming the variables.
    """
    size = local_world_size()
    if size is None:
        return 1, world
    if world % size:
        raise ValueError(f"{_size_name()}={size} does not divide the world size {world} (WORLD_SIZE): a launcher "
                         "starts the same number of processes on every node")  # fmt: skip
    rank, local = _env_int("RANK", 0), local_rank()
    if rank is not None and _env_int("LOCAL_RANK", 0) is not None and rank % size != local:
        raise ValueError(f"RANK={rank} with LOCAL_RANK={local} and {_size_name()}={size}: the ranks of a node must be "
                         f"consecutive (RANK = node * {size} + LOCAL_RANK), as torchrun numbers them")  # fmt: skip
    return world // size, size

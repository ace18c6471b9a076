"""The default process group's lifetime: created with a timeout, destroyed deterministically before exit.

Why an explicit shutdown: building any torch optimizer imports `torch._dynamo`, which imports
`torch.distributed.nn.functional`, whose functions take `group=group.WORLD` as a default argument. Imported after
`init_process_group`, those defaults hold the process group itself, so `destroy_process_group()` does not free it:
the gloo group's threads are then torn down by the garbage collector during the interpreter's finalization, which
now and then aborts the process ("terminate called without an active exception", SIGABRT). `shutdown()` destroys
the group and drops those stale references, so the group is freed at that line, while the interpreter is whole;
`shutdown_at_exit()` arranges for it to run before the interpreter exits (`DistMesh` and `init_distributed` do).
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

__all__ = ["as_timedelta", "init_process_group", "set_timeout", "shutdown", "shutdown_at_exit"]

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

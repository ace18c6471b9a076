"""`deepspeed.utils.logging`: DeepSpeed's logger and its rank-aware logging functions.

`logger` is the `logging.Logger` named "DeepSpeed" (level WARNING, not propagated, one handler printing to stdout
in DeepSpeed's format), so `logger.setLevel` and handlers a script adds act on DeepSpeed's logger as before. In a
process that imported DeepSpeed too, it is the same logger and gets no second handler. `log_dist(message, ranks)`
logs `"[Rank r] message"` on the ranks listed (every rank for `[-1]`; every process before `torch.distributed` is
initialised, as rank -1).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from argparse import Namespace
from typing import Any

import torch.distributed as dist

from ..refusal import refuse

__all__ = [
    "LoggerFactory",
    "get_current_level",
    "get_dist_msg",
    "get_log_level_from_string",
    "log_dist",
    "log_dist_once",
    "log_levels",
    "logger",
    "print_configuration",
    "print_dist",
    "print_json_dist",
    "set_log_level_from_string",
    "should_log_le",
    "warning_once",
]

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
_UNSUPPORTED = {"required_torch_version": "compare torch.__version__ yourself (DeepSpeed's internal helper)"}


class LoggerFactory:
    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.WARNING) -> logging.Logger:
        """The logger `name` at `level`, not propagated, with a stdout handler in DeepSpeed's format.

        Raises:
          ValueError: `name` is None.
        """
        if name is None:
            raise ValueError("name for logger cannot be None")
        out = logging.getLogger(name)
        out.setLevel(level)
        out.propagate = False
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter(_FORMAT))
        out.addHandler(handler)
        return out


# DeepSpeed's logger, one handler whoever created it first (DeepSpeed itself, in a process that imports both)
_existing = logging.getLogger("DeepSpeed")
logger = _existing if _existing.handlers else LoggerFactory.create_logger("DeepSpeed", logging.WARNING)


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    """`logger.warning`, each distinct message once per process."""
    logger.warning(*args, **kwargs)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _initialized() else -1


def get_dist_msg(message: str, ranks: list[int] | None = None) -> str | None:
    """`"[Rank r] message"` where it should be logged, else None: before `torch.distributed` is initialised
    always (rank -1), after it on the ranks in `ranks` (all of them if `ranks[0] == -1`)."""
    should = not _initialized()
    if ranks and not should:
        should = ranks[0] == -1 or _rank() in set(ranks)
    return f"[Rank {_rank()}] {message}" if should else None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` at `level` on the ranks `ranks` (see `get_dist_msg`)."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """`log_dist`, each distinct message (and ranks and level) once per process."""
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


setattr(logger, "warning_once", warning_once)  # noqa: B010 (DeepSpeed's attributes on its logger object)
setattr(logger, "log_dist_once", log_dist_once)  # noqa: B010


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """`print` the `log_dist` message, whatever the logger's level."""
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


def print_json_dist(message: dict[str, Any], ranks: list[int] | None = None, path: str | None = None) -> None:
    """Write `message` with its `rank` added as JSON to `path` (fsynced), on the ranks `log_dist` would log on."""
    if get_dist_msg("", ranks) is None:
        return
    if path is None:
        raise ValueError("print_json_dist: path is required")
    message["rank"] = _rank()
    with open(path, "w") as f:
        json.dump(message, f)
        f.flush()
        os.fsync(f.fileno())


def print_configuration(args: Namespace, name: str) -> None:
    """Log `name:` and each of `args`' attributes (sorted, dot-padded) at INFO."""
    logger.info(f"{name}:")
    for arg in sorted(vars(args)):
        logger.info(f"  {arg} {'.' * (29 - len(arg))} {getattr(args, arg)}")


def get_log_level_from_string(log_level_str: str) -> int:
    """`"info"` -> `logging.INFO` (any case).

    Raises:
      ValueError: not one of debug, info, warning, error, critical.
    """
    key = log_level_str.lower()
    if key not in log_levels:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. Valid log levels are "
                         f"{log_levels.keys()}.")  # fmt: skip
    return log_levels[key]


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of `custom_logger` (default: DeepSpeed's `logger`) and of its handlers."""
    target = logger if custom_logger is None else custom_logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at most `max_log_level_str` ("info": True at INFO or DEBUG).

    Raises:
      ValueError: not a string, or not a level's name.
    """
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

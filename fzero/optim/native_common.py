"""What the native-kernel optimizers (`cpu_adam(w)`, `cpu_lion`, `cpu_adagrad`) share: the features they fuse, the
check of their master weights, and their scalars for one update, one per parameter group where there are groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .groups import Segments

__all__ = ["FEATURES", "PerGroup", "check_params", "scalars"]

FEATURES = frozenset({"grad_scale", "grad_dtype", "out"})

PerGroup = float | list[float]
"""A kernel scalar: one value for the whole buffer, or one per parameter group."""


def check_params(name: str, params: object) -> None:
    """The kernels keep float32 master weights in CPU memory.

    Raises:
      TypeError, ValueError: naming the optimizer, and the `shard_update` arguments that give such weights.
    """
    if not isinstance(params, Tensor):
        raise TypeError(f"{name}: params must be a tensor, got {type(params).__name__}")
    if params.dtype != torch.float32 or params.device.type != "cpu":
        raise ValueError(
            f"{name} keeps float32 master weights in CPU memory, got params of dtype {params.dtype} on "
            f"{params.device}: use shard_update(..., dtype=torch.float32, offload='cpu')"
        )


def scalars(
    values: Callable[[Mapping[str, Any], int], tuple[float, ...]],
    defaults: Mapping[str, Any],
    applied: int,
    segments: Segments | None,
) -> tuple[tuple[PerGroup, ...], tuple[Tensor, Tensor] | None]:
    """The kernel's scalars for the update after `applied` applied updates (`values(hypers, applied)`, schedules
    evaluated): one each without groups; with `segments`, a list per scalar with each group's own, and the segment
    table `(ends, group)` the kernel takes."""
    if segments is None:
        return values(defaults, applied), None
    per = [values({**defaults, **o}, applied) for o in segments.overrides]
    return tuple([v[i] for v in per] for i in range(len(per[0]))), segments.tensors()

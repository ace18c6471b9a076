"""What the native-kernel optimizers (`cpu_adam(w)`, `cpu_lion`, `cpu_adagrad`) share: the features they fuse, the
check of their master weights, their scalars for one update (one per parameter group where there are groups), and
the optimizer around a kernel (`native_optimizer`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .. import native
from .base import Optimizer
from .groups import ParamGroups, Segments

__all__ = ["FEATURES", "PerGroup", "check_params", "native_optimizer", "scalars"]

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


def native_optimizer(
    name: str,
    init: Callable[[Tensor], Any],
    kernel: Callable[..., None],
    values: Callable[[Mapping[str, Any], int], tuple[float, ...]],
    defaults: Mapping[str, Any],
    check: Callable[[Mapping[str, Any]], None] | None,
    groups: ParamGroups | None,
) -> Optimizer:
    """The optimizer that runs `kernel` on float32 master weights in CPU memory, with the fused `FEATURES`.

    Args:
      name: the optimizer's name, for the messages.
      init: its state for given parameters: `(count, *buffers)`, a NamedTuple, the buffers shaped like them.
      kernel: `kernel(step, scalars, params, grads, *buffers, params_out, *buffers_out, grad_scale=, out=,
        segments=)`, one update: `step` its 1-based number, `scalars` what `values` gives (with groups, each a list
        per group), the `*_out` tensors where the new values go (None: in place), `segments` the kernel's table.
      values: the kernel's scalars for the update after `applied` applied updates (schedules evaluated).
      defaults, check, groups: the `Optimizer`'s.
    """
    native.isa()  # choose the path now: a missing extension warns at construction, not mid-training

    def init_state(params: Tensor) -> Any:
        check_params(name, params)
        return init(params)

    def update(
        grads: Tensor,
        state: Any,
        params: Tensor,
        *,
        donate: bool = False,
        grad_scale: float = 1.0,
        out: Tensor | None = None,
        segments: Segments | None = None,
    ) -> tuple[Tensor, Any]:
        check_params(name, params)
        applied = int(state.count)
        per_group, table = scalars(values, defaults, applied, segments)
        buffers = tuple(state[1:])
        new = (params, *buffers)
        outputs: tuple[Tensor | None, ...] = (None,) * len(new)  # None: in place
        if not donate:  # pure: the kernel reads the inputs and writes fresh buffers, in the same single pass
            new = outputs = tuple(torch.empty_like(x) for x in new)
        kernel(applied + 1, per_group, params, grads.contiguous(), *buffers, *outputs, grad_scale=grad_scale, out=out,
               segments=table)  # fmt: skip
        return new[0], type(state)(torch.tensor(applied + 1, dtype=torch.int64), *new[1:])

    return Optimizer(init_state, update, FEATURES, defaults=defaults, groups=groups, check=check, name=name)

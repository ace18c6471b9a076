"""ZeRO stages 0-3 as chains of the same transforms.

| preset  | chain                                                          | sharded per rank at rest        |
|---------|----------------------------------------------------------------|---------------------------------|
| `zero0` | accumulate, all_reduce, scale_loss, [clip], shard_update, gather | nothing                       |
| `zero1` | accumulate, reduce_scatter, scale_loss, [clip], shard_update, gather | optimizer state, master     |
| `zero2` | reduce_scatter, accumulate, scale_loss, [clip], shard_update, gather | + accumulated gradients     |
| `zero3` | reduce_scatter, accumulate, scale_loss, [clip], shard_update, gather(lazy) | + compute parameters  |

Stage 1 accumulates full local gradients and reduce-scatters once per step; stage 2 reduce-scatters every
micro-step and accumulates shards. (DeepSpeed's stage 1 all-reduces and keeps its slice: the same values for the
owned slice, twice the traffic.) Every preset takes:

- `accumulate`: micro-steps per update;
- `precision`: None (the model's dtype throughout), `"fp32"`, `"bf16"`, `"fp16"` or a `Policy` (master and
  optimizer state in `param_dtype`, the gathered compute copy in `compute_dtype`, reductions in `reduce_dtype`,
  accumulation in `accum_dtype`; a policy's `reduce_overrides` reduce the named parameters' gradients in their own
  dtypes: `fzero.transforms.mixed_reduce`);
- `loss_scale`: default `"dynamic"` under fp16, none otherwise (see `scale_loss`);
- `clip`: the global-norm bound, or None;
- `skip_nonfinite`: skip steps with inf/nan gradients on every rank (default on);
- `hybrid`: stages 1-3 only: False (shard over every rank), True (shard over the mesh axis `"shard"`, average the
  shards over `"replicate"`: FSDP's HSDP, on `SimMesh(shape={"replicate": R, "shard": S})` or a `DistMesh` of
  that shape), or a pair `(replicate_axis, shard_axis)` of other names; see docs/hybrid.md;
- `qgz`: reduce gradients with `quantized_reduce_scatter` (ZeRO++'s qgZ: int8 with blockwise scales; lossy, its
  error bound in its docstring): `True` quantizes every exchange of the reduction (over every rank, or both hybrid
  axes), except with `hpz`, where it is ZeRO++'s hierarchical form; a pair `(outer, inner)` of a 2-D mesh's axes
  (nodes, a node's ranks: `("replicate", "shard")`) is that form for parameters sharded over every rank: fp32
  within the node, int8 only across nodes, nothing quantized on one node (docs/hybrid.md);
- `qwz`: gather the compute parameters int8 (qwZ): at stages 1-2 with `quantized_gather`, at the end of each step
  instead of lazily, unit by unit, in the next forward; at stage 3 each unit's gather, forward and backward
  (`gather(quantize=16)`); stage 3 also takes `qwz_frozen` (the frozen parameters' gathers) and `hpz` (hpZ's
  secondary copies; see `zero3`);
- `average`: where the gradients' mean divides by the world size (`fzero.Average`: after the sum by default,
  DeepSpeed's `prescale_gradients` and `gradient_predivide_factor` otherwise);
- `offload`: `"cpu"` keeps the master parameters and optimizer state in host memory and runs the optimizer there
  (ZeRO-Offload; pair it with `fzero.cpu_adamw`), the compute copy written in the same pass;
  `fzero.Offload("nvme", path=...)` keeps them in swap files on disk (ZeRO-Infinity's optimizer tier).
"""

from __future__ import annotations

from typing import Any

from ..optim import Optimizer
from ..state.precision import Policy, get_policy
from .accumulate import accumulate as accumulate_
from .base import Transform, identity
from .chain import chain
from .clipping import clip_by_global_norm
from .collective import Average, all_reduce, gather, reduce_scatter
from .mixed_reduce import mixed_all_reduce, mixed_reduce_scatter
from .quantize import quantized_gather, quantized_reduce_scatter
from .scaling import scale_loss
from .update import shard_update

__all__ = ["zero0", "zero1", "zero2", "zero3"]


def _preset(
    stage: int,
    optimizer: Optimizer,
    accumulate: int,
    precision: str | Policy | None,
    loss_scale: Any,
    clip: float | None,
    skip_nonfinite: bool,
    offload: Any,
    hybrid: bool | tuple[str, str] = False,
    qgz: bool | tuple[str, str] = False,
    qwz: bool = False,
    average: Average | None = None,
    hpz: bool | tuple[str, str] = False,
    qwz_frozen: bool = False,
) -> Transform:
    policy = get_policy(precision)
    axis, replicate = _hybrid_axes(hybrid)
    secondary, outer = _hybrid_axes(hpz)
    if qgz and average is not None and not average.is_default:
        raise ValueError("qgz=True quantizes the gradients with its own scales and divides after the sum; it takes "
                         "no prescale or predivide (average=)")  # fmt: skip
    if secondary is not None and axis is not None:
        raise ValueError("zero3(hybrid=..., hpz=...): hybrid sharding already gathers within the shard axis, so hpZ's "
                         "secondary copy would hold what the shard holds; use one of the two")  # fmt: skip
    levels = _qgz_levels(qgz, secondary, outer)
    overrides = dict(policy.reduce_overrides)
    if overrides and (qgz or axis is not None or (average is not None and not average.is_default)):
        raise ValueError("a precision policy with reduce_overrides (per-parameter reduce dtypes) reduces over every "
                         "rank with the mean after the sum: it takes no qgz, hybrid axes or average=")  # fmt: skip
    rs = (
        quantized_reduce_scatter(axis=axis, replicate=replicate, levels=levels)
        if qgz
        else mixed_reduce_scatter(policy.reduce_dtype, overrides)
        if overrides
        else reduce_scatter(policy.reduce_dtype, axis, replicate, average)
    )
    if loss_scale is None:
        loss_scale = "dynamic" if policy.half else "none"
    acc = accumulate_(accumulate, dtype=policy.accum_dtype)
    if stage == 0:
        ar = mixed_all_reduce(policy.reduce_dtype, overrides) if overrides else all_reduce(policy.reduce_dtype, average)
        reduce = [acc, ar]
    elif stage == 1:
        reduce = [acc, rs]
    else:
        reduce = [rs, acc]
    return chain(
        *reduce,
        scale_loss(loss_scale, skip_nonfinite=skip_nonfinite),
        clip_by_global_norm(clip) if clip else identity(),
        shard_update(
            optimizer,
            dtype=policy.param_dtype,
            offload=offload,
            compute_dtype=policy.compute_dtype,
        ),
        _gather(stage, policy, qwz, qwz_frozen, secondary),
    )


def _qgz_levels(qgz: bool | tuple[str, str], secondary: str | None, outer: str | None) -> tuple[str, str] | None:
    """The `(outer, inner)` axes of a hierarchical qgZ: `qgz`'s pair, or hpZ's axes with `qgz=True`; else None."""
    if isinstance(qgz, bool):
        return (outer, secondary) if qgz and secondary is not None and outer is not None else None
    if isinstance(qgz, tuple) and len(qgz) == 2 and all(isinstance(a, str) for a in qgz) and qgz[0] != qgz[1]:
        return qgz
    raise ValueError(f"qgz must be False, True or a pair (outer_axis, inner_axis) of two names, got {qgz!r}")


QWZ_BLOCK = 16  # elements per scale of stage 3's qwZ: the layout's `align`, so no block straddles two parameters


def _gather(stage: int, policy: Policy, qwz: bool, qwz_frozen: bool, secondary: str | None) -> Transform:
    """The preset's gather: qwZ at the end of the step (stages 1-2) or unit by unit (stage 3), hpZ at stage 3."""
    if stage < 3:
        return quantized_gather(dtype=policy.compute_dtype) if qwz else gather(policy.compute_dtype, lazy=stage > 0,
                                                                               keep=stage > 0)  # fmt: skip
    return gather(
        policy.compute_dtype,
        lazy=True,
        quantize=QWZ_BLOCK if qwz else None,
        quantize_frozen=QWZ_BLOCK if qwz_frozen else None,
        secondary=secondary,
    )


def _hybrid_axes(hybrid: bool | tuple[str, str]) -> tuple[str | None, str | None]:
    """`(shard axis, replicate axis)` of a preset's `hybrid` argument."""
    if hybrid is False:
        return None, None
    if hybrid is True:
        return "shard", "replicate"
    if isinstance(hybrid, tuple) and len(hybrid) == 2 and all(isinstance(a, str) for a in hybrid):
        return hybrid[1], hybrid[0]
    raise ValueError(f"hybrid must be False, True or a pair (replicate_axis, shard_axis) of names, got {hybrid!r}")


def zero0(optimizer: Optimizer, accumulate: int = 1, precision: str | Policy | None = None, loss_scale: Any = None,
          clip: float | None = None, skip_nonfinite: bool = True, offload: Any = None,
          *, average: Average | None = None) -> Transform:  # fmt: skip
    """Plain data parallelism: gradients all-reduced, everything replicated.

    Example:
        >>> import fzero
        >>> [name for name, _ in fzero.zero0(fzero.adamw()).children]
        ['identity', 'all_reduce', 'scale_loss', 'identity#1', 'shard_update', 'gather']
    """
    return _preset(0, optimizer, accumulate, precision, loss_scale, clip, skip_nonfinite, offload, average=average)


def zero1(optimizer: Optimizer, accumulate: int = 1, precision: str | Policy | None = None, loss_scale: Any = None,
          clip: float | None = None, skip_nonfinite: bool = True, offload: Any = None,
          hybrid: bool | tuple[str, str] = False, qgz: bool | tuple[str, str] = False, qwz: bool = False,
          *, average: Average | None = None) -> Transform:  # fmt: skip
    """ZeRO-1: optimizer state and master parameters sharded; full gradients accumulated locally.

    Example:
        >>> import fzero
        >>> [name for name, _ in fzero.zero1(fzero.adamw(), accumulate=4).children][:2]
        ['accumulate', 'reduce_scatter']
    """
    return _preset(
        1, optimizer, accumulate, precision, loss_scale, clip, skip_nonfinite, offload, hybrid, qgz, qwz, average
    )


def zero2(optimizer: Optimizer, accumulate: int = 1, precision: str | Policy | None = None, loss_scale: Any = None,
          clip: float | None = None, skip_nonfinite: bool = True, offload: Any = None,
          hybrid: bool | tuple[str, str] = False, qgz: bool | tuple[str, str] = False, qwz: bool = False,
          *, average: Average | None = None) -> Transform:  # fmt: skip
    """ZeRO-2: gradients reduce-scattered every micro-step and accumulated as shards.

    Example:
        >>> import fzero
        >>> [name for name, _ in fzero.zero2(fzero.adamw(), accumulate=4).children][:2]
        ['reduce_scatter', 'accumulate']
    """
    return _preset(
        2, optimizer, accumulate, precision, loss_scale, clip, skip_nonfinite, offload, hybrid, qgz, qwz, average
    )


def zero3(optimizer: Optimizer, accumulate: int = 1, precision: str | Policy | None = None, loss_scale: Any = None,
          clip: float | None = None, skip_nonfinite: bool = True, offload: Any = None,
          hybrid: bool | tuple[str, str] = False, qgz: bool | tuple[str, str] = False, qwz: bool = False,
          *, average: Average | None = None, hpz: bool | tuple[str, str] = False,
          qwz_frozen: bool = False) -> Transform:  # fmt: skip
    """ZeRO-3: compute parameters also sharded at rest; the step gathers one unit at a time inside the forward and
    the backward (`fzero.GatherPolicy`).

    ZeRO++ at stage 3 (docs/hybrid.md): `qwz` gathers each unit as int8 with a scale per 16 elements, in the
    forward and the backward (`qwz_frozen`: the frozen parameters' too); `hpz=True` (or a pair `(replicate_axis,
    shard_axis)`) keeps, after each unit's forward gather over every rank, a secondary copy sharded over the
    `shard` axis, from which the backward gathers the unit again within that axis only (hpZ: bitwise the same
    step); with `qgz` too, the gradients are reduced within `shard` first (fp32), then across `replicate` (int8), as
    with `qgz=("replicate", "shard")` without hpZ.

    Example:
        >>> import fzero
        >>> fzero.zero3(fzero.adamw(), precision="bf16").children[-1][0]  # gather(bfloat16, lazy=True)
        'gather'
    """
    return _preset(
        3, optimizer, accumulate, precision, loss_scale, clip, skip_nonfinite, offload, hybrid, qgz, qwz, average,
        hpz, qwz_frozen,
    )  # fmt: skip

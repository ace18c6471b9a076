"""Precision policies: which dtype each part of the training state and step uses (jmp's `Policy`, for ZeRO).

Fields set to None keep the model's dtype (`get_policy(None)`: no casts at all, the presets' default).

| field | holds | under "bf16" / "fp16" |
|---|---|---|
| `param_dtype` | master parameters and optimizer state | float32 |
| `compute_dtype` | the gathered parameters the forward and backward use | bfloat16 / float16 |
| `reduce_dtype` | gradients while they are reduced across ranks | float32 |
| `accum_dtype` | gradients accumulated over micro-steps | float32 |
| `reduce_overrides` | `(parameter name, dtype)` pairs: those gradients reduced in that dtype instead | none |

Accumulating (or reducing) in bf16 silently loses small updates: a bf16 sum keeps 8 significant bits, so adding a
micro-batch gradient 300x smaller than the running sum changes nothing. Hence float32 by default.

The fp32 master starts from the model's own weights. DeepSpeed casts the module to bf16/fp16 before its optimizer
copies the master from it, so its master starts from the rounded weights; `round_params(model, torch.bfloat16)`
before `fzero.init` reproduces that (the engine's `fzero_precision.round_initial_master`).

Example:
    >>> get_policy("bf16")
    Policy(param=float32, compute=bfloat16, reduce=float32, accum=float32)
    >>> get_policy("p=f32,c=bf16,r=bf16")
    Policy(param=float32, compute=bfloat16, reduce=bfloat16, accum=float32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import nn

__all__ = ["Policy", "get_policy", "round_params"]

_NAMES = {
    "f32": torch.float32, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "f64": torch.float64, "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip
_FIELDS = {"p": "param_dtype", "c": "compute_dtype", "r": "reduce_dtype", "a": "accum_dtype"}
_FIELDS.update({v.removesuffix("_dtype"): v for v in list(_FIELDS.values())})


def _dtype(text: str, where: str) -> torch.dtype:
    try:
        return _NAMES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} in {where}; expected one of {sorted(set(_NAMES))}") from None


@dataclass(frozen=True)
class Policy:
    """Immutable dtypes of the training state and step (see the module docstring)."""

    param_dtype: torch.dtype | None = torch.float32
    compute_dtype: torch.dtype | None = torch.float32
    reduce_dtype: torch.dtype | None = torch.float32
    accum_dtype: torch.dtype | None = torch.float32
    # per-parameter reduce dtypes (DeepSpeed's torch_autocast `comm_dtype`): `fzero.transforms.mixed_reduce`
    reduce_overrides: tuple[tuple[str, torch.dtype], ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "reduce_dtype", "accum_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
                raise TypeError(f"Policy.{name} must be a floating torch.dtype or None, got {dtype!r}")
        for pair in self.reduce_overrides:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            if not ok or not isinstance(pair[1], torch.dtype) or not pair[1].is_floating_point:
                raise TypeError(f"Policy.reduce_overrides must hold (parameter name, floating torch.dtype) pairs, "
                                f"got {pair!r}")  # fmt: skip

    def __repr__(self) -> str:
        short = lambda d: "model" if d is None else str(d).removeprefix("torch.")  # noqa: E731
        return (
            f"Policy(param={short(self.param_dtype)}, compute={short(self.compute_dtype)}, "
            f"reduce={short(self.reduce_dtype)}, accum={short(self.accum_dtype)}"
            + (f", {len(self.reduce_overrides)} reduce overrides)" if self.reduce_overrides else ")")
        )

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast the floating-point tensors of a pytree (e.g. a batch's inputs) to the compute dtype; the step does
        not cast inputs itself, since a batch also holds targets whose precision is the loss's business."""
        if self.compute_dtype is None:
            return tree
        cast = lambda x: x.to(self.compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
        return optree.tree_map(cast, tree)

    @property
    def half(self) -> bool:
        """Whether the compute dtype is float16 (the case that needs loss scaling)."""
        return self.compute_dtype == torch.float16


def get_policy(spec: str | Policy | None) -> Policy:
    """A `Policy` from `"fp32"`, `"bf16"`, `"fp16"`, or `"p=f32,c=bf16,r=f32,a=f32"` (fields omitted: float32;
    long names `param=`, `compute=`, `reduce=`, `accum=` also accepted). `None` keeps the model's own dtype
    everywhere (no casts)."""
    if spec is None:
        return Policy(None, None, None, None)
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"precision must be a string such as 'bf16' or a Policy, got {type(spec).__name__}")
    if "=" not in spec:
        compute = _dtype(spec, "precision")
        return Policy(compute_dtype=compute)
    fields: dict[str, Any] = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in _FIELDS:
            raise ValueError(f"unknown field {key.strip()!r} in precision {spec!r}; expected p, c, r, a")
        fields[_FIELDS[key.strip()]] = _dtype(value, f"precision {spec!r}")
    return Policy(**fields)


def round_params(model: nn.Module, dtype: torch.dtype | str) -> nn.Module:
    """Round every floating-point parameter of `model` (trainable and frozen, each tied tensor once) to `dtype` and
    back, in place: `p = p.to(dtype).to(p.dtype)`. Buffers are left as they are.

    Use it before `fzero.init` to start the master weights where DeepSpeed's start under bf16/fp16 (DeepSpeed casts
    the whole module to the compute dtype, and its optimizer copies the fp32 master from that); the compute copy,
    the rounded master, is then the same as fzero's default gives.

    Args:
      model: the module (on any device but `meta`).
      dtype: the dtype to round through: a floating `torch.dtype`, or a precision name such as `"bf16"` (its
        policy's compute dtype).

    Returns:
      `model`.

    Example:
      >>> m = nn.Linear(1, 1)
      >>> with torch.no_grad():
      ...     _ = m.weight.fill_(1 + 2**-10)
      >>> round_params(m, "bf16").weight.item()
      1.0
    """
    target = get_policy(dtype).compute_dtype if isinstance(dtype, str) else dtype
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise TypeError(f"round_params: dtype must be a floating torch.dtype or a precision name, got {dtype!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:
                raise ValueError(f"round_params: parameter {name!r} is on the meta device (it has no values yet)")
            if p.is_floating_point():
                p.copy_(p.to(target))
    return model

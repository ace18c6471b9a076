"""The checks of the kernels' tensor arguments: a C kernel trusts its pointers, so each is checked before a call."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["DTYPE", "F32", "LOW", "check_aliasing", "check_step", "check_tensor"]

DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The gradient dtypes the kernels load, by the C code of each."""
LOW = {torch.bfloat16: 1, torch.float16: 2}
"""The dtypes of the low-precision copy of the parameters (`out=`), by the C code of each."""
F32 = (torch.float32,)
"""The dtype of the master weights and the moments."""


def check_tensor(where: str, name: str, t: object, numel: int, dtypes: Collection[torch.dtype]) -> Tensor:
    """`t`, checked to be a contiguous CPU tensor of `numel` elements and one of `dtypes`.

    Args:
      where: the calling function's name, for the messages.
      name: the argument's name, for the messages.
      t: the argument.
      numel: the number of elements it must have (the parameters').
      dtypes: the dtypes it may have.

    Returns:
      `t`, as a tensor.

    Raises:
      TypeError: not a tensor, or of another dtype. ValueError: not on the CPU, not contiguous, another length.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{where}: {name} has dtype {t.dtype}, expected {allowed}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: {name} is on {t.device}; the CPU kernel needs CPU tensors (offload the "
                         "optimizer with shard_update(..., offload='cpu'))")  # fmt: skip
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} (shape {tuple(t.shape)}) is not contiguous")
    if t.numel() != numel:
        raise ValueError(f"{where}: {name} has {t.numel()} elements, but params has {numel}")
    return t


def _span(t: Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def check_aliasing(where: str, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor]) -> None:
    """Outputs must not overlap each other, and an output may overlap an input only by being that very tensor's
    memory (in place): anything else would read values the same call already overwrote.

    Args:
      where: the calling function's name, for the messages.
      inputs, outputs: the tensors by argument name; output `x_out` may be input `x` in place.

    Raises:
      ValueError: naming the overlapping pair.
    """
    outs = [(k, _span(t)) for k, t in outputs.items() if t.numel()]
    for i, (a, (a0, a1)) in enumerate(outs):
        for b, (b0, b1) in outs[i + 1 :]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{where}: outputs {a} and {b} overlap in memory")
    for k, (o0, o1) in outs:
        for name, t in inputs.items():
            if not t.numel():
                continue
            i0, i1 = _span(t)
            if o0 < i1 and i0 < o1 and not (o0 == i0 and name == k.removesuffix("_out")):
                raise ValueError(f"{where}: output {k} overlaps input {name} (only in-place updates of the same "
                                 "buffer are allowed)")  # fmt: skip


class StepTensors(NamedTuple):
    """An optimizer step's tensors after `check_step`: where to write, and the copy-out."""

    outputs: dict[str, Tensor]
    """`params_out`, then `<state>_out` for each state, in order: the given tensor, or the input itself (in place)."""
    out: Tensor | None
    """The low-precision copy of the new parameters, if asked for."""


def check_step(
    where: str,
    params: object,
    grads: object,
    states: Mapping[str, object],
    outputs: Mapping[str, object | None],
    out: object | None,
) -> StepTensors:
    """Check an optimizer step's tensors before a kernel gets their pointers: `params` and every state float32,
    `grads` float32 / bfloat16 / float16, each output (`params_out`, `<state>_out`; None: in place) float32, `out`
    bfloat16 / float16, all contiguous CPU tensors of `params.numel()` elements, and no overlap except in place.

    Args:
      where: the calling function's name, for the messages.
      params, grads: the master weights and the gradients.
      states: the optimizer's state tensors by argument name (e.g. `{"exp_avg": m}`), updated like `params`.
      outputs: `params_out` and `<state>_out` for each state, by name; None for in place.
      out: the optional low-precision copy-out.

    Returns:
      `StepTensors(outputs, out)`, the outputs resolved.

    Raises:
      TypeError, ValueError: naming the tensor at fault (see `check_tensor`, `check_aliasing`).
    """
    n = params.numel() if isinstance(params, Tensor) else 0
    p = check_tensor(where, "params", params, n, F32)
    inputs = {"params": p, "grads": check_tensor(where, "grads", grads, n, DTYPE)}
    for name, t in states.items():
        inputs[name] = check_tensor(where, name, t, n, F32)
    resolved: dict[str, Tensor] = {}
    for name in ("params", *states):
        given = outputs.get(f"{name}_out")
        resolved[f"{name}_out"] = inputs[name] if given is None else check_tensor(where, f"{name}_out", given, n, F32)
    low = check_tensor(where, "out", out, n, LOW) if out is not None else None
    check_aliasing(where, inputs, resolved if low is None else {**resolved, "out": low})
    return StepTensors(resolved, low)

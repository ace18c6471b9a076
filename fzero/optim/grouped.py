"""One elementwise update, written once, run on a whole buffer or on each parameter group's segments of it.

The torch-op optimizers (`adam(w)`, `sgd`, `lion`, `adagrad`) write their arithmetic once, as a `step` on lists of
tensors through `Ops` (`torch._foreach_`'s signatures), and `update_by_group` runs it:

- without parameter groups, on the whole tensors with `PER_TENSOR`: each op is torch's single-tensor op, what
  `torch.optim`'s `foreach=False` runs (so the update is theirs bitwise on every device: on a GPU a foreach kernel
  rounds some ops otherwise, e.g. it divides by a scalar where the single-tensor op multiplies by its reciprocal);
- with groups, on each group's segments with `FOREACH`: one `torch._foreach_` call per op for all of them, with the
  group's hyper-parameters.

On the CPU both are the same single-tensor kernels, so a segment's update is bitwise the ungrouped update of its
slice with its group's values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .base import InitFn, Optimizer
from .groups import ParamGroups, Segments

__all__ = ["FOREACH", "PER_TENSOR", "Ops", "elementwise", "owned", "update_by_group"]


class Ops:
    """Elementwise ops on lists of tensors, called as `torch._foreach_<name>` is (`ops.lerp_(ms, gs, w)`): a list
    argument pairs with the tensors, anything else is shared.

    Args:
      foreach: one `torch._foreach_` call per op; else torch's single-tensor op (`Tensor.<name>`, or for an
        in-place op without a method, `torch.<op>(..., out=tensor)`) on each tensor in turn.
    """

    def __init__(self, foreach: bool) -> None:
        self.foreach = foreach

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):  # (copy, pickle and the like probe for these: they are not ops)
            raise AttributeError(name)
        if self.foreach:
            return getattr(torch, f"_foreach_{name}")
        op = getattr(Tensor, name, None)
        if op is None:  # no such method (`maximum_`): torch's function, writing into its first argument
            fn = getattr(torch, name.removesuffix("_"))

            def op(x: Tensor, *args: Any, **kw: Any) -> Tensor:
                return fn(x, *args, **kw, out=x)

        def each(xs: list[Tensor], *args: Any, **kw: Any) -> list[Tensor]:
            return [op(x, *(a[i] if isinstance(a, (list, tuple)) else a for a in args), **kw) for i, x in enumerate(xs)]

        return each


PER_TENSOR = Ops(foreach=False)
FOREACH = Ops(foreach=True)


def owned(donate: bool, *tensors: Tensor) -> list[Tensor]:
    """The tensors an update may write: the given ones when donated, else copies (a pure update)."""
    return list(tensors) if donate else [t.clone() for t in tensors]


def update_by_group(
    step: Callable[..., None],
    grads: Tensor,
    state: Any,
    params: Tensor,
    donate: bool,
    segments: Segments | None,
    defaults: Mapping[str, Any],
) -> tuple[Tensor, Any]:
    """One update of `params` and `state`'s buffers by `step`, per parameter group.

    Args:
      step: `step(h, applied, ops, ps, gs, *buffers)`: the update in place on the lists `ps` (parameters), `gs`
        (gradients) and one list per buffer of the state, with the group's hyper-parameters `h` (the defaults with
        its overrides), `applied` the updates already applied, and `ops` (`PER_TENSOR` or `FOREACH`) for its ops.
      grads, params: the gradients and the parameters (a flat buffer, or any tensor without `segments`).
      state: `(count, *buffers)`, a NamedTuple whose buffers are shaped like `params` (an unused one may be empty).
      donate: update `params` and the buffers in place; else copies of them.
      segments: the parameter groups' segments of the buffer; None: one group, the defaults.
      defaults: the optimizer's hyper-parameters.

    Returns:
      The new parameters, and the state of `state`'s type with `count + 1` and the new buffers.
    """
    applied = int(state.count)
    p, *buffers = owned(donate, params, *state[1:])
    if segments is None:
        step(defaults, applied, PER_TENSOR, [p], [grads], *([b] for b in buffers))
    else:
        flat = [x.reshape(-1) for x in (p, grads, *buffers)]
        for group, ranges in segments.pieces().items():
            pieces = ([x[a:b] for a, b in ranges] for x in flat)
            step({**defaults, **segments.overrides[group]}, applied, FOREACH, *pieces)
    return p, type(state)(torch.tensor(applied + 1, dtype=torch.int64), *buffers)


def elementwise(
    name: str,
    init: InitFn,
    step: Callable[..., None],
    defaults: Mapping[str, Any],
    check: Callable[[Mapping[str, Any]], None],
    groups: ParamGroups | None,
) -> Optimizer:
    """The optimizer whose update runs `step` by `update_by_group` (see there); `name`, `init`, `defaults`, `check`
    and `groups` are the `Optimizer`'s."""

    def update(
        grads: Tensor, state: Any, params: Tensor, *, donate: bool = False, segments: Segments | None = None
    ) -> tuple[Tensor, Any]:
        return update_by_group(step, grads, state, params, donate, segments, defaults)

    return Optimizer(init, update, defaults=defaults, groups=groups, check=check, name=name)

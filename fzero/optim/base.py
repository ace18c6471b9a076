"""The optimizer protocol, and the states the torch-op and native-kernel forms of one optimizer share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from torch import Tensor

__all__ = ["AMSGradState", "AdagradState", "AdamState", "Hyper", "LionState", "Optimizer", "hyper_value"]

Hyper = float | Callable[[int], float]
"""A hyper-parameter: a constant, or a pure function of the number of updates already applied."""


class InitFn(Protocol):
    def __call__(self, params: Tensor) -> Any: ...


class UpdateFn(Protocol):
    def __call__(
        self, grads: Tensor, state: Any, params: Tensor, *, donate: bool = False, segments: Any = None
    ) -> tuple[Tensor, Any]: ...


class Optimizer(NamedTuple):
    """A functional optimizer on one flat tensor.

    Attributes:
      init: `init(params) -> state`, the state shaped like `params`.
      update: `update(grads, state, params, *, donate=False, segments=None) -> (new_params, new_state)`. Pure
        unless `donate`, in which case `params` and the state's tensors are overwritten in place (and returned).
        `segments` (`fzero.optim.groups.Segments`): per-group hyper-parameters over runs of the flat buffer.
      defaults: the optimizer's hyper-parameters by name (what a parameter group may override).
      groups: parameter groups (`fzero.param_groups`), resolved against the layout's names by `shard_update`.
      check: validates a group's hyper-parameters (raises as the constructor would).
      features: what `update` can fuse into its pass over memory, each a keyword or ability it accepts beyond the
        protocol (empty for the torch-op optimizers; `shard_update` does the work itself then):
        `"grad_scale"`: `update(..., grad_scale=f)` multiplies the gradients by `f` as it reads them;
        `"grad_dtype"`: gradients may be bfloat16 / float16, upcast on load;
        `"out"`: `update(..., out=t)` also writes the new parameters into `t` (bfloat16 / float16), bitwise
        `new_params.to(t.dtype)`;
        `"tensors"`: `update(..., tensors=t)` takes `fzero.optim.tensors.Tensors`, where each parameter tensor lies
        in the buffer and how its pieces' sums meet across ranks (per-tensor norms: Lamb).
      name: what it is, by the name of the fzero function that makes it (`"adamw"`, `"cpu_adamw"`, `"lamb"`, ...;
        `"cpu_adamw|fused_adamw"` for one that picks by the master weights' device): for reports and tests.
    """

    init: InitFn
    update: UpdateFn
    features: frozenset[str] = frozenset()
    defaults: Mapping[str, Any] = {}
    groups: Any = None
    check: Callable[[Mapping[str, Any]], None] | None = None
    name: str = ""

    def group_hypers(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """A group's hyper-parameters: the optimizer's defaults with the group's overrides."""
        return {**self.defaults, **overrides}


def hyper_value(h: Hyper, applied: int) -> float:
    """The value of a hyper-parameter for the update that follows `applied` applied updates."""
    return float(h(applied)) if callable(h) else h


def check_hyper(name: str, value: Hyper, low: float, high: float | None = None, *, open_high: bool = True) -> None:
    """Validate a constant hyper-parameter eagerly (schedules are checked when evaluated by torch-like rules)."""
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a callable of the step, got {type(value).__name__}")
    # written as torch's `not low <= x`, so that nan is refused too
    bad = not low <= value or (high is not None and not (value < high if open_high else value <= high))
    if bad:
        interval = f"[{low}, {high})" if high is not None and open_high else f"[{low}, {high}]" if high else f">= {low}"
        raise ValueError(f"invalid {name}: {value} (expected {interval})")


class AdamState(NamedTuple):
    """`count`: updates applied (0-d int64); `exp_avg`, `exp_avg_sq`: the first and second moments."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count: the name checkpoints and the engine use
    exp_avg: Tensor
    exp_avg_sq: Tensor


class LionState(NamedTuple):
    """`count`: updates applied (0-d int64); `exp_avg`: the momentum."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count: the name checkpoints and the engine use
    exp_avg: Tensor


class AdagradState(NamedTuple):
    """`count`: updates applied (0-d int64); `sum`: the running sum of squared gradients (torch's `state_sum`)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count: the name checkpoints and the engine use
    sum: Tensor


class AMSGradState(NamedTuple):
    """Adam's state with AMSGrad's running maximum of the second moment, `max_exp_avg_sq` (torch's name)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count: the name checkpoints and the engine use
    exp_avg: Tensor
    exp_avg_sq: Tensor
    max_exp_avg_sq: Tensor

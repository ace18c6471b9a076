"""`deepspeed.utils.tensor_fragment`'s `safe_get_*` / `safe_set_*`: a parameter's master value, gradient and
optimizer state, read from and written into the engine's state, whatever the ZeRO stage.

    from fzero.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    w = safe_get_full_fp32_param(engine.module.head.weight)           # every rank: a collective
    m = safe_get_full_optimizer_state(engine.module.head.weight, "exp_avg")

DeepSpeed hangs its optimizer on each parameter; fzero's engine registers its module's parameters in a weak
registry (`fzero.engine.parameters.owner`), through which these functions find the state. A parameter of no engine
gets None from the getters (as in DeepSpeed) and a `ValueError` from the setters (DeepSpeed silently ignores it).

- `full`: the whole value, all-gathered (call it on every rank); the setters take the whole value, the same on every
  rank, each rank keeping its part. Frozen parameters: None (DeepSpeed's), and the setters leave them.
- `local`: this rank's fragment, no communication: the part of the parameter in this rank's shard. fzero shards
  units rather than parameters, so its size is not DeepSpeed's `ceil(numel / world)` (and may be 0); the ranks'
  fragments in rank order are the parameter. DeepSpeed defines these for ZeRO-3 only; fzero at every stage.
- `grad`: after `engine.backward(loss)` and before `engine.step()`, the gradient as DeepSpeed holds it there:
  reduced over the ranks, averaged over the accumulation window so far, float32 (scaled by the fp16 loss scale, as
  DeepSpeed's). Reading it at stage 3 finishes the micro-step's reduction: read after the last backward.
- the master is the engine's (float32). A parameter's setters write its compute copy too (cast), so the next
  forward computes with the new value; DeepSpeed's copy follows at its next update (fzero, computing with the master
  itself where it keeps no copy, cannot wait like that). An optimizer state's setters write that state.

DeepSpeed's setters of gradients (`safe_set_full_grad`, `safe_set_local_grad`,
`safe_update_full_grad_vectorized`) and its fragment-mapping internals are refused with fzero's alternative.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...engine.parameters import ParameterAccess, owner
from ..refusal import refuse

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
]

_GRADS = ("fzero's gradients are the step's, reduced by its transform chain: write a transform to change them "
          "(docs/extending.md); safe_get_full_grad / safe_get_local_grad read them")  # fmt: skip
_MAPPING = "DeepSpeed's links between its flat buffers: the safe_get_* / safe_set_* functions read and write them"
_UNSUPPORTED: dict[str, str] = {
    "safe_set_full_grad": _GRADS,
    "safe_set_local_grad": _GRADS,
    "safe_update_full_grad_vectorized": _GRADS,
    **dict.fromkeys(
        """
        fragment_address tensor_fragment map_to_flat_opt_states get_full_hp_param set_full_hp_param
        get_full_hp_grad set_full_hp_grad get_hp_fragment_mapping
        """.split(),
        _MAPPING,
    ),
}


def _engine(param: Any, what: str) -> ParameterAccess:
    engine = owner(param) if isinstance(param, Tensor) else None
    if engine is None:
        raise ValueError(f"{what}: the parameter is not one of an engine's (pass a parameter of engine.module, after "
                         "deepspeed.initialize)")  # fmt: skip
    return engine


def safe_get_full_fp32_param(param: Tensor) -> Tensor | None:
    """The full fp32 master value of `param` (a collective), or None (frozen, or no engine's)."""
    engine = owner(param)
    return None if engine is None else engine.full_fp32_param(param)


def safe_set_full_fp32_param(param: Tensor, value: Tensor) -> None:
    """Write the full master value of `param` (`value` the same on every rank), and its compute copy."""
    _engine(param, "safe_set_full_fp32_param").set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """The full value of `param`'s optimizer state `optim_state_key` (e.g. "exp_avg"; a collective), or None."""
    engine = owner(param)
    return None if engine is None else engine.full_fp32_param(param, optim_state_key)


def safe_set_full_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Write the full value of `param`'s optimizer state `optim_state_key` (`value` the same on every rank)."""
    _engine(param, "safe_set_full_optimizer_state").set_full_fp32_param(param, value, optim_state_key)


def safe_get_full_grad(param: Tensor) -> Tensor | None:
    """The full gradient of `param` between `backward` and `step` (see the module docstring; a collective), or
    None (frozen, or no engine's).

    Raises:
      ValueError: outside that window (DeepSpeed's message).
    """
    engine = owner(param)
    return None if engine is None else engine.full_grad(param)


def safe_get_local_fp32_param(param: Tensor) -> Tensor | None:
    """This rank's fragment of `param`'s fp32 master value (flat), or None."""
    engine = owner(param)
    return None if engine is None else engine.local_fp32_param(param)


def safe_set_local_fp32_param(param: Tensor, value: Tensor) -> None:
    """Write this rank's fragment of `param`'s master value (`value`: `safe_get_local_fp32_param(param)`'s size)."""
    _engine(param, "safe_set_local_fp32_param").set_local_fp32_param(param, value)


def safe_get_local_optimizer_state(param: Tensor, optim_state_key: str) -> Tensor | None:
    """This rank's fragment of `param`'s optimizer state `optim_state_key` (flat), or None."""
    engine = owner(param)
    return None if engine is None else engine.local_fp32_param(param, optim_state_key)


def safe_set_local_optimizer_state(param: Tensor, value: Tensor, optim_state_key: str) -> None:
    """Write this rank's fragment of `param`'s optimizer state `optim_state_key`."""
    _engine(param, "safe_set_local_optimizer_state").set_local_fp32_param(param, value, optim_state_key)


def safe_get_local_grad(param: Tensor) -> Tensor | None:
    """This rank's fragment of `param`'s gradient between `backward` and `step` (flat), or None.

    Raises:
      ValueError: outside that window (DeepSpeed's message).
    """
    engine = owner(param)
    return None if engine is None else engine.local_grad(param)


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""`stored_in(optimizer, dtype)`: master weights (and optionally the optimizer state) kept in bfloat16 or float16,
every update computed in float32 (DeepSpeed's `bf16_master_weights_and_grads` and `bf16_optimizer_states`).

Each update upcasts the stored parameters, gradients and state to float32, runs the optimizer there, and rounds the
results once to their storage dtypes (round to nearest even, torch's `.to`), as DeepSpeed's fused and CPU Adam do
for bf16 parameters: its arithmetic in float32, one rounding on store. What that costs, per update and element:

    |w_stored - w_fp32| <= u |w_fp32|,   u = 2^-8 (bf16) or 2^-11 (fp16)

so an update smaller than half a unit in the last place of the weight (`|dw| < u |w|`) is lost, which float32
master weights keep (the reason mixed precision keeps them). Half the memory of the master weights (and of the
state with `state_dtype`); `docs/equivalence.md` states the measured effect on training.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from .base import Optimizer

__all__ = ["stored_in"]

_LOW = (torch.bfloat16, torch.float16)


def stored_in(optimizer: Optimizer, dtype: torch.dtype, state_dtype: torch.dtype | None = None) -> Optimizer:
    """`optimizer` with its master weights stored in `dtype` (and its state in `state_dtype`; None: float32).

    Args:
      optimizer: any fzero optimizer (its float32 arithmetic is what runs).
      dtype: `torch.bfloat16` or `torch.float16`: the master weights' storage (`shard_update(dtype=...)`).
      state_dtype: the state's floating tensors' storage, or None for float32.

    Returns:
      The optimizer; it passes parameter groups and per-tensor tables (`tensors`) through, and fuses nothing.

    Example:
      >>> import torch, fzero
      >>> opt = stored_in(fzero.sgd(0.5), torch.bfloat16)
      >>> p = torch.tensor([1.0, 256.0], dtype=torch.bfloat16)
      >>> opt.update(torch.ones(2, dtype=torch.bfloat16), opt.init(p), p)[0]   # 256 - 0.5 rounds back to 256
      tensor([  0.5000, 256.0000], dtype=torch.bfloat16)
    """
    if dtype not in _LOW:
        raise ValueError(f"stored_in: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if state_dtype is not None and state_dtype not in (*_LOW, torch.float32):
        raise ValueError(f"stored_in: state_dtype must be bfloat16, float16, float32 or None, got {state_dtype}")
    store = state_dtype or torch.float32

    def down(tree: Any, like: Tensor) -> Any:
        return optree.tree_map(lambda x: x.to(store) if _stateful(x, like) else x, tree)

    def up(tree: Any, like: Tensor) -> Any:
        return optree.tree_map(lambda x: x.float() if _stateful(x, like) else x, tree)

    def init(params: Tensor) -> Any:
        _check(params, dtype)
        return down(optimizer.init(params.float()), params)

    def update(grads: Tensor, state: Any, params: Tensor, *, donate: bool = False, **kw: Any) -> tuple[Tensor, Any]:
        _check(params, dtype)
        new_p, new_state = optimizer.update(grads.float(), up(state, params), params.float(), donate=True, **kw)
        out = params.copy_(new_p) if donate else new_p.to(dtype)  # (copy_ rounds to nearest even, as .to does)
        stored = down(new_state, params)
        if donate:  # the caller's state tensors receive the new values, as an in-place update would
            optree.tree_map(lambda old, new: old.copy_(new) if _stateful(old, params) else None, state, stored)
            stored = optree.tree_map(lambda old, new: old if _stateful(old, params) else new, state, stored)
        return out, stored

    features = optimizer.features & {"tensors"}
    return Optimizer(init, update, features, defaults=optimizer.defaults, groups=optimizer.groups,
                     check=optimizer.check, name=optimizer.name)  # fmt: skip


def _stateful(x: Any, like: Tensor) -> bool:
    """A floating state tensor shaped like the parameters (not the step count)."""
    return isinstance(x, Tensor) and x.is_floating_point() and x.shape == like.shape


def _check(params: Tensor, dtype: torch.dtype) -> None:
    if params.dtype != dtype:
        raise ValueError(f"stored_in({dtype}): the master parameters are {params.dtype}; give shard_update "
                         f"dtype={dtype} (the policy's param_dtype)")  # fmt: skip

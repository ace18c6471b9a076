"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`, which Accelerate and transformers call on a
consolidated state dict before saving it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of `item` with every tensor cloned onto `device` (DeepSpeed's: views of one flat buffer would save
    the whole buffer each), through lists, tuples and dicts; anything else is returned as is.

    Args:
      item: a tensor, or a list, tuple or dict of them (nested).
      device: where the clones go.

    Returns:
      The same structure with new tensors.

    >>> base = torch.arange(6.0)
    >>> out = clone_tensors_for_torch_save({"a": base[:2], "b": [base[2:]]})
    >>> out["a"].untyped_storage().size(), out["b"][0].tolist()
    (8, [2.0, 3.0, 4.0, 5.0])
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item

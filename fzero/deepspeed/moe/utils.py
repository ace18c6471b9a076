"""`deepspeed.moe.utils`: DeepSpeed's parameter-group helpers for mixture-of-experts models, as they behave on the
dense models fzero trains.

A parameter is an expert's when DeepSpeed's MoE layer marked it `allreduce=False` (DeepSpeed's test, kept); fzero has
no such layers, so the splits find none and return the groups as DeepSpeed does for a dense model (a list of the
same dicts, each `params` a new list of the same parameters). A parameter marked as an expert's is refused: fzero
would reduce it over every rank like any other, not over its expert-data-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..refusal import refuse

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

_EXPERTS = "fzero has no mixture-of-experts layers or expert parallelism; train a dense model"
_UNSUPPORTED = {"MoE": _EXPERTS}


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """`(False, 0)`: fzero builds no MoE layers (DeepSpeed's answer for a model without them)."""
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` is an expert's (DeepSpeed's MoE layers set `allreduce=False` on them)."""
    return hasattr(param, "allreduce") and not param.allreduce


def _dense(params: Any, where: str) -> list[Any]:
    params = list(params)
    experts = [p for p in params if is_moe_param(p)]
    if experts:
        raise NotImplementedError(f"deepspeed.moe.utils.{where}: {len(experts)} parameter(s) marked as an expert's "
                                  f"(allreduce=False): {_EXPERTS}")  # fmt: skip
    return params


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[Any]]:
    """`(params, [])`: every parameter is shared (dense)."""
    return _dense(params, "split_params_into_shared_and_expert_params"), []


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[Any]]:
    """The gradients of `group`'s parameters that have one, each in its parameter's dtype, and no expert's."""
    params = _dense(group, "split_params_grads_into_shared_and_expert_params")
    return [p.grad.to(p.dtype) for p in params if p.grad is not None], []


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Any, max_group_size: int | float = 178956971
) -> list[Any]:
    """DeepSpeed's split of param groups into dense and per-expert-group ones; with no expert parameters, the
    groups themselves as a list (a dict made a one-element list, a tuple a list), each `params` a new list.

    Raises:
      ValueError: `param_groups` is not a dict, a list or a tuple (DeepSpeed's error).
      NotImplementedError: a parameter is marked as an expert's.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = _dense(group["params"], "split_params_into_different_moe_groups_for_optimizer")
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """DeepSpeed's preparation of `initialize`'s `model_parameters` for MoE: parameters become one group named
    "dense-params"; groups are split (with no expert parameters, kept) unless one already says `moe`.

    Raises:
      TypeError: `model_parameters` holds something other than tensors and dicts.
    """
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")  # fmt: skip
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if isinstance(first, dict) and not any("moe" in group for group in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""Param groups as DeepSpeed scripts give them, checked against the model and named for `fzero.param_groups`.

`initialize(model_parameters=...)` takes what torch optimizers take: an iterable of parameters, or of group dicts
(`{"params": [...], "lr": ..., "weight_decay": ..., "name": ...}`); a client `torch.optim` optimizer brings its own
`param_groups`. fzero's optimizer runs on one flat buffer and takes groups by parameter *name*
(`fzero.param_groups(groups=[(names, overrides), ...])`), so each group's tensors are named here, from the model.

The rules, DeepSpeed 0.19's where it has one:

- groups without parameters are dropped (`DeepSpeedEngine._configure_optimizer` removes them from the optimizer;
  `engine.get_lr()` has no entry for them);
- frozen parameters (`requires_grad=False`) in a group are ignored (DeepSpeed's ZeRO optimizers leave them out of
  their flat groups: `is_optimized_parameter` in `stage_1_and_2.py` / `stage3.py`); a group with only frozen ones
  stays, training nothing;
- a parameter in two groups (or twice in one) is an error, as in torch and in DeepSpeed's `_check_for_duplicates`;
- a tensor that is not a parameter of the model is an error;
- a trainable parameter in no group is an error: DeepSpeed would leave it untrained without a word (its ZeRO
  optimizers flatten, reduce and update only the optimizer's groups, while autograd still computes its gradient),
  which is never what a script means.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

__all__ = ["ParamGroup", "parse_groups", "split_options"]

# hyper-parameter names of torch's and DeepSpeed's optimizers: a group key among these that the optimizer does not
# take is an error (it would silently do nothing); any other key (`name`, `layer_id`, ...) is the user's, and kept
_HYPER_NAMES = frozenset({
    "lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize", "foreach",
    "fused", "capturable", "differentiable", "decoupled_weight_decay", "bias_correction", "adam_w_mode", "alpha",
    "centered", "lr_decay", "initial_accumulator_value", "rho", "lambd", "t0", "etas", "step_sizes", "momentum_decay",
    "max_grad_norm", "eps_inside_sqrt", "max_coeff", "min_coeff", "torch_adam", "beta1", "beta2",
})  # fmt: skip


@dataclass
class ParamGroup:
    """One of the user's param groups.

    Attributes:
      index: its position in what the user gave (empty groups dropped later keep their numbers out of it).
      params: its tensors as given (frozen ones included).
      names: the names of its trainable parameters, as `model.named_parameters()` gives them (a tied parameter:
        its first name), which are the layout's names.
      options: the group's other keys (hyper-parameters and the user's own keys, such as `name`).
      source: the group's dict itself (a client optimizer's, read live), or None for a bare list of tensors.
    """

    index: int
    params: list[Tensor]
    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] | None = None


def _tensors(value: Any, where: str) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (set, frozenset)):
        raise TypeError(f"{where}: parameters must be an ordered collection (a list), not a set (torch.optim's rule)")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{where}: expected a tensor or an iterable of tensors, got {type(value).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}[{i}] is a {type(t).__name__}, not a parameter tensor")
    return items


def parse_groups(model: nn.Module, params: Iterable[Any], what: str) -> list[ParamGroup]:
    """The user's param groups, checked against `model` (see the module docstring for the rules).

    Args:
      model: the model being trained.
      params: an iterable of parameters (one group) or of group dicts, each with `"params"`.
      what: how to name `params` in errors (e.g. `"model_parameters"`).

    Returns:
      The groups that have parameters, in the user's order.

    Raises:
      TypeError: a malformed argument (a single tensor, a set, dicts mixed with tensors, a non-tensor).
      ValueError: no parameters, a tensor that is not the model's, a parameter in two groups, a trainable parameter
        in no group.
    """
    if isinstance(params, Tensor):
        raise TypeError(f"{what} must be an iterable of parameters or of param-group dicts, not a single tensor")
    if isinstance(params, Mapping):
        params = [params]
    items = list(params)
    if not items:
        raise ValueError(f"{what} is empty: no parameters to train")
    dicts = [isinstance(x, Mapping) for x in items]
    if any(dicts) and not all(dicts):
        raise TypeError(f"{what} mixes param-group dicts and tensors: give one or the other, as torch.optim requires")
    raw: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    if all(dicts):
        for i, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f'{what}[{i}] has no "params": each param-group dict lists its parameters there')
            options = {k: v for k, v in group.items() if k != "params"}
            raw.append(({"params": _tensors(group["params"], f"{what}[{i}]['params']"), **options}, group))
        where = lambda i: f"{what}[{i}]"  # noqa: E731
    else:
        raw.append(({"params": _tensors(items, what)}, None))
        where = lambda i: what  # noqa: E731

    name_of = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, int] = {}
    groups = []
    for i, (group, source) in enumerate(raw):
        names = []
        for t in group["params"]:
            name = name_of.get(id(t))
            if name is None:
                raise ValueError(
                    f"{where(i)} holds a tensor of shape {tuple(t.shape)} that is not a parameter of the model"
                )
            if id(t) in owner:
                j = owner[id(t)]
                place = f"twice in param group {i}" if j == i else f"in param groups {j} and {i}"
                raise ValueError(
                    f"parameter {name!r} is {place} of {what}: a parameter belongs to one group (torch.optim and "
                    "DeepSpeed refuse this too)"
                )
            owner[id(t)] = i
            if t.requires_grad:
                names.append(name)
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append(ParamGroup(i, group["params"], tuple(names), options, source))

    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"parameter {missing[0]!r}{more} requires grad but is in no param group of {what}. DeepSpeed 0.19 would "
            "silently leave it untrained (its ZeRO optimizers flatten, reduce and update only the optimizer's "
            "groups); fzero refuses: add it to a group, or freeze it with requires_grad_(False)"
        )
    kept = [g for g in groups if g.params]  # DeepSpeed drops groups without parameters
    if not kept:
        raise ValueError(f"{what} has no parameters in any group")
    return kept


def _value(value: Any, key: str, where: str) -> Any:
    """A group's hyper-parameter as fzero's optimizers take it: numbers (0-d tensors read once), betas a pair."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: {key} is a tensor of shape {tuple(value.shape)}, expected a number")
        return value.item()
    if key == "betas" and isinstance(value, (list, tuple)):
        return tuple(_value(v, key, where) for v in value)
    return value


def split_options(group: ParamGroup, allowed: Sequence[str], kind: str, what: str) -> tuple[dict[str, Any], dict]:
    """A group's keys split into the optimizer's hyper-parameters and the user's own keys (kept, unused).

    Raises:
      ValueError: a key names a hyper-parameter of another optimizer, or looks like a misspelt one of this
        optimizer's (`weight_deacy`): it would silently do nothing.
    """
    where = f"{what}[{group.index}]"
    overrides, kept, wrong = {}, {}, []
    for key, value in group.options.items():
        if key in allowed:
            overrides[key] = _value(value, key, where)
        elif key in _HYPER_NAMES or difflib.get_close_matches(key, allowed, n=1, cutoff=0.8):
            wrong.append(key)
        else:
            kept[key] = value
    if wrong:
        hints = []
        for key in wrong:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.8)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close and close[0] != key else ""))
        raise ValueError(
            f"{where} sets {', '.join(hints)}: not a hyper-parameter of {kind}, which takes "
            f"{', '.join(allowed)} per group (other keys, such as 'name', are kept as they are)"
        )
    return overrides, kept

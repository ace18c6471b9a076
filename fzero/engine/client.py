"""The optimizer object `initialize` returns, and client optimizers and schedulers translated to fzero's.

fzero's optimizers are functions on flat shards, but DeepSpeed scripts read `optimizer.param_groups[0]["lr"]`, and
hand the optimizer to LR schedulers (torch's or their own). `OptimizerView` is a real `torch.optim.Optimizer` over the
module's parameters that never steps: it shows the hyper-parameters of the next update, and, when a client scheduler
drives it, it is where fzero's optimizer reads the learning rate (and Adam's betas) from at each update.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config.build import OptimizerSpec
from ..config.schema import UnsupportedConfigError
from ..optim import Hyper

__all__ = ["OptimizerView", "client_spec", "live", "trainable_params"]


class OptimizerView(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that holds hyper-parameters but never updates anything.

    `engine.step()` does the updates; `step()` here raises. Attributes DeepSpeed's wrappers have: `loss_scale` /
    `cur_scale` (set by the engine after each step), `overflow` (whether the last boundary step was skipped).
    """

    def __init__(self, params: Iterable[nn.Parameter], defaults: dict[str, Any], kind: str) -> None:
        params = list(params) or [nn.Parameter(torch.zeros(0))]
        super().__init__(params, defaults)
        self.kind = kind
        self.cur_scale = 1.0
        self.overflow = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the engine updates the parameters: call engine.step(), not optimizer.step()")

    def __repr__(self) -> str:
        hypers = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"fzero.OptimizerView({self.kind}: {hypers})"


def live(group: dict[str, Any], key: str, index: int | None = None) -> Hyper:
    """A hyper-parameter read from a param group at each update (a client scheduler may change it in between)."""
    if index is None:
        return lambda n: float(group[key])
    return lambda n: float(group[key][index])


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters fzero trains: every `requires_grad` parameter, tied ones once."""
    return [p for p in model.parameters() if p.requires_grad]


_SAME = {
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}
_OFF = ("amsgrad", "maximize", "differentiable", "capturable")


def _groups_agree(opt: torch.optim.Optimizer, keys: tuple[str, ...]) -> dict[str, Any]:
    first = opt.param_groups[0]
    for i, group in enumerate(opt.param_groups[1:], 1):
        for key in keys:
            if group.get(key) != first.get(key):
                raise UnsupportedConfigError(
                    "optimizer",
                    f"param group {i} has {key}={group.get(key)!r} but group 0 has {first.get(key)!r}: per-group "
                    "hyper-parameters are not supported (fzero's optimizer runs on one flat buffer); freeze "
                    "parameters with requires_grad_(False) or use one group",
                )
    for key in _OFF:
        if any(g.get(key) for g in opt.param_groups):
            raise UnsupportedConfigError("optimizer", f"{type(opt).__name__}({key}=True) is not supported")
    return first


def check_params(model: nn.Module, params: Iterable[Any] | None, what: str) -> None:
    """`params` (parameters or param-group dicts) must be exactly the model's trainable parameters, with or without
    its frozen ones (which are ignored, as DeepSpeed ignores them)."""
    if params is None:
        return
    ids: set[int] = set()
    for item in params:
        if isinstance(item, dict):
            extra = sorted(set(item) - {"params", "name", "names"})
            if extra:
                raise UnsupportedConfigError(
                    what,
                    f"a param group sets {', '.join(extra)}: per-group hyper-parameters are not supported "
                    "(fzero's optimizer runs on one flat buffer)",
                )
            group = item["params"]
            ids.update(id(p) for p in ([group] if isinstance(group, torch.Tensor) else group))
        else:
            ids.add(id(item))
    want = {id(p) for p in trainable_params(model)}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    ids -= frozen  # DeepSpeed accepts model.parameters() with frozen ones among them, and trains the others
    if ids != want:
        raise ValueError(
            f"{what}: fzero trains exactly the model's parameters with requires_grad=True ({len(want)} tensors), "
            f"but {what} holds {len(ids & want)} of them and {len(ids - want)} tensors that are not the model's "
            "parameters; freeze what should not train with requires_grad_(False)"
        )


def client_spec(model: nn.Module, opt: torch.optim.Optimizer) -> OptimizerSpec:
    """The fzero optimizer equivalent to a client `torch.optim.Adam` / `AdamW` / `SGD`, reading its learning rate
    (and betas) live from the client's param group so a client scheduler, or the user, can change them."""
    kind = next((cls for cls in _SAME if type(opt) is cls), None)
    if kind is None:
        raise UnsupportedConfigError(
            "optimizer",
            f"client optimizer {type(opt).__module__}.{type(opt).__name__} is not supported: pass torch.optim.Adam, "
            "AdamW or SGD (translated to fzero's), or configure the optimizer in the config",
        )
    group = _groups_agree(opt, _SAME[kind])
    check_params(model, [p for g in opt.param_groups for p in g["params"]], "the client optimizer's parameters")
    if kind is torch.optim.SGD:
        hypers = {k: group[k] for k in ("momentum", "dampening", "weight_decay", "nesterov")}
        return OptimizerSpec("sgd", live(group, "lr"), hypers, float(group["lr"]))
    decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
    hypers = {"betas": (live(group, "betas", 0), live(group, "betas", 1)), "eps": group["eps"],
              "weight_decay": group["weight_decay"]}  # fmt: skip
    return OptimizerSpec("adamw" if decoupled else "adam", live(group, "lr"), hypers, float(group["lr"]))

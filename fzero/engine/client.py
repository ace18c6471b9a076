"""The optimizer and scheduler objects `initialize` returns, and client optimizers translated to fzero's.

fzero's optimizers are functions on flat shards, but DeepSpeed scripts read `optimizer.param_groups[0]["lr"]`, and
hand the optimizer to LR schedulers (torch's or their own). `OptimizerView` is a real `torch.optim.Optimizer` over the
module's parameters that never steps: it shows the hyper-parameters of the next update, group by group, and, when a
client scheduler drives it, it is where fzero's optimizer reads each group's learning rate (and Adam's betas) from at
each update. A client `torch.optim` optimizer is translated group by group the same way (`client_spec`), and so is
one of DeepSpeed's optimizer classes (`fzero.deepspeed.ops`: a `DeclaredClient`, into what its config block runs). A
config `scheduler` is stepped by the engine; `SchedulerView` reports it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..config.build import GroupSpec, OptimizerSpec
from ..config.optimizers import OPTIMIZERS, OptimizerType
from ..config.schema import UnsupportedConfigError
from ..optim import Hyper
from .groups import ParamGroup

__all__ = [
    "WHAT",
    "DeclaredClient",
    "OptimizerView",
    "SchedulerView",
    "client_spec",
    "client_type",
    "live",
    "trainable_params",
]


class OptimizerView(torch.optim.Optimizer):
    """A `torch.optim.Optimizer` that holds hyper-parameters but never updates anything.

    Its `param_groups` are the user's (one per group of `model_parameters` that has parameters, in order, with every
    key the user gave, such as `name`; one group of the trainable parameters otherwise), each showing the
    hyper-parameters of its next update.

    `engine.step()` does the updates; `step()` here raises. Attributes DeepSpeed's wrappers have: `loss_scale` /
    `cur_scale` (set by the engine after each step), `overflow` (whether the last boundary step was skipped).
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], kind: str) -> None:
        params = list(params) or [nn.Parameter(torch.zeros(0))]
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self.kind = kind
        self.cur_scale = 1.0
        self.overflow = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while the engine builds the view (from groups `fzero.engine.groups` has checked): the engine trains
        the parameters it was initialised with, so a group added later would silently not train; refused.

        (torch's own `add_param_group` is wrapped in `torch._disable_dynamo`, whose first call imports
        `torch._dynamo`: 72 MiB resident and about a second, for a view that never steps.)

        Raises:
          RuntimeError: called after `initialize`.
        """
        if not self._building:
            raise RuntimeError(
                "engine.optimizer.add_param_group: the engine trains the parameters given to fzero.initialize (their "
                "layout is fixed); pass every parameter group there (model_parameters=[...] or the client optimizer)"
            )
        params = param_group["params"]  # in place, as torch's: the dict given is the group
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self.param_groups.append(param_group)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # a stub that refuses: torch's returns the closure's loss
        raise RuntimeError("the engine updates the parameters: call engine.step(), not optimizer.step()")

    def __repr__(self) -> str:
        hypers = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"fzero.OptimizerView({self.kind}: {hypers})"


class Scheduled(Protocol):
    """What a `SchedulerView` reads of the engine."""

    def applied_updates(self) -> int: ...

    def get_lr(self) -> list[float]: ...


class SchedulerView:
    """The `lr_scheduler` `initialize` returns for a config `scheduler` block. The engine steps the schedule
    (after applied updates only); this object reports it."""

    def __init__(self, engine: Scheduled, kind: str) -> None:
        # a proxy, not a reference: the engine holds this view (`engine.lr_scheduler`), and a cycle would keep the
        # engine, and its state's files, alive until the garbage collector's next pass
        self.engine = weakref.proxy(engine)
        self.kind = kind

    @property
    def last_batch_iteration(self) -> int:
        return self.engine.applied_updates() - 1

    def get_lr(self) -> list[float]:
        """The learning rate of the next update."""
        return self.engine.get_lr()

    def get_last_lr(self) -> list[float]:
        """The learning rate the engine's optimizer holds now (DeepSpeed's: the last one the scheduler set)."""
        return self.engine.get_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"the engine steps the configured {self.kind} schedule after every applied update: do not call "
            "lr_scheduler.step() (in DeepSpeed that would advance it twice)"
        )

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def __repr__(self) -> str:
        return f"fzero.SchedulerView({self.kind}, last_batch_iteration={self.last_batch_iteration})"


def live(group: dict[str, Any], key: str, index: int | None = None) -> Hyper:
    """A hyper-parameter read from a param group at each update (a client scheduler may change it in between)."""
    if index is None:
        return lambda n: float(group[key])
    return lambda n: float(group[key][index])


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters fzero trains: every `requires_grad` parameter, tied ones once."""
    return [p for p in model.parameters() if p.requires_grad]


_OFF = ("maximize", "differentiable", "capturable")
WHAT = "the client optimizer's param_groups"


def _check_group(opt: torch.optim.Optimizer, group: ParamGroup, first: ParamGroup) -> None:
    assert group.source is not None and first.source is not None
    for key in _OFF:
        if group.source.get(key):
            raise UnsupportedConfigError(
                "optimizer", f"{type(opt).__name__}({key}=True) is not supported (param group {group.index})"
            )
    # torch.optim.Adam(decoupled_weight_decay=True) is AdamW; a group's initial accumulator fills the state once
    for key in ("decoupled_weight_decay", "amsgrad", "initial_accumulator_value"):
        if group.source.get(key, False) != first.source.get(key, False):
            raise UnsupportedConfigError(
                "optimizer",
                f"param groups {first.index} and {group.index} of {type(opt).__name__} differ in {key}: fzero runs "
                "one optimizer with one such setting for all groups",
            )


@runtime_checkable
class DeclaredClient(Protocol):
    """A client optimizer that says which config `optimizer` block it is (DeepSpeed's classes,
    `fzero.deepspeed.ops`): the engine runs what that block runs, with each param group's values."""

    optimizer_type: str  # the block's `type`, a key of `fzero.config.optimizers.OPTIMIZERS`

    def config_params(self, group: dict[str, Any]) -> dict[str, Any]:
        """The block's `params` that a param group's values are."""
        ...


def client_type(opt: torch.optim.Optimizer) -> OptimizerType:
    """The row of `fzero.config.optimizers.OPTIMIZERS` a client `torch.optim` optimizer is translated by (a
    `DeclaredClient`'s own).

    Raises:
      UnsupportedConfigError: a class no row translates.
    """
    if isinstance(opt, DeclaredClient):
        return OPTIMIZERS[opt.optimizer_type]
    row = next((row for row in OPTIMIZERS.values() if row.client is type(opt)), None)
    if row is None:
        raise UnsupportedConfigError(
            "optimizer",
            f"client optimizer {type(opt).__module__}.{type(opt).__name__} is not supported: pass torch.optim.Adam, "
            "AdamW, SGD or Adagrad (translated to fzero's), or configure the optimizer in the config",
        )
    return row


def _number(value: Any) -> Any:
    return value if isinstance(value, bool) else float(value)


def client_spec(opt: torch.optim.Optimizer, row: OptimizerType, groups: list[ParamGroup]) -> OptimizerSpec:
    """The fzero optimizer equivalent to a client `torch.optim.Adam` / `AdamW` / `SGD` / `Adagrad`, group by group
    (`amsgrad` too), reading each group's learning rate (and betas) live from the client's param group, so that a
    client scheduler, or the user, can change them.

    Args:
      opt: the client optimizer.
      row: its row of the optimizer table (`client_type`).
      groups: its param groups, as `fzero.engine.groups.parse_groups` checked them against the model.

    Raises:
      UnsupportedConfigError: an option fzero does not implement, or a `DeclaredClient`'s groups that differ in an
        option fzero's optimizer takes once for all groups (`bias_correction`).
      ConfigError: a `DeclaredClient`'s group value out of its range.
    """
    if isinstance(opt, DeclaredClient):
        return _declared_spec(opt, row, groups)
    for group in groups:
        _check_group(opt, group, groups[0])
    dicts: list[dict[str, Any]] = []
    for group in groups:
        assert group.source is not None  # (groups parsed from torch param groups keep theirs)
        dicts.append(group.source)
    per_group = []
    for g in dicts:
        h: dict[str, Any] = {"lr": live(g, "lr")}
        for key in row.group_keys[1:]:  # (after "lr")
            h[key] = (live(g, key, 0), live(g, key, 1)) if key == "betas" else _number(g[key])
        per_group.append(h)
    first = dicts[0]
    options = {"amsgrad": True} if first.get("amsgrad") else {}
    kind = row.kind_for(decoupled=bool(first.get("decoupled_weight_decay", False)))
    hypers = dict(per_group[0])
    # a client torch optimizer keeps torch's own arithmetic (torch_adam): bitwise what it would compute alone
    spec = OptimizerSpec(kind, hypers.pop("lr"), hypers, float(first["lr"]), torch_adam=True, options=options)
    if len(groups) > 1:
        spec = replace(spec, groups=tuple(GroupSpec(g.names, h) for g, h in zip(groups, per_group, strict=True)))
    return spec


def _declared_spec(opt: DeclaredClient, row: OptimizerType, groups: list[ParamGroup]) -> OptimizerSpec:
    """What the config block `opt` is runs (`OptimizerType.block_hypers`), each group with its own values, reading
    its `lr` (and `betas`) live from the group; its options (`bias_correction`, `eps_inside_sqrt`) are the
    optimizer's, one for all groups."""
    name = type(opt).__name__
    per_group: list[dict[str, Any]] = []
    kind = ""
    options: dict[str, Any] = {}
    for group in groups:
        g = group.source
        assert g is not None  # (groups parsed from torch param groups keep theirs)
        kind_g, _, hypers, options_g = row.block_hypers(opt.config_params(g), f"{name}.param_groups[{group.index}]")
        differ = sorted(k for k in {*options, *options_g} if options.get(k) != options_g.get(k))
        if per_group and differ:  # (the kind is the instance's, the same for every group)
            raise UnsupportedConfigError(
                "optimizer",
                f"param groups {groups[0].index} and {group.index} of {name} differ in {', '.join(differ)}: fzero "
                "runs one optimizer with one such setting for all groups",
            )
        kind, options = kind_g, options_g
        h = {"lr": live(g, "lr"), **hypers}
        if "betas" in h:
            h["betas"] = (live(g, "betas", 0), live(g, "betas", 1))
        per_group.append(h)
    hypers = dict(per_group[0])
    assert groups[0].source is not None
    spec = OptimizerSpec(kind, hypers.pop("lr"), hypers, float(groups[0].source["lr"]), options=options)
    if len(groups) > 1:
        spec = replace(spec, groups=tuple(GroupSpec(g.names, h) for g, h in zip(groups, per_group, strict=True)))
    return spec

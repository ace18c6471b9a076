"""The DeepSpeed `optimizer` block, and everything fzero does differently by optimizer, in one table.

`OPTIMIZERS` has a row for each `type` DeepSpeed 0.19.8 builds: its `params` with DeepSpeed's names and defaults, the
fzero optimizer it runs (`fzero.optim.<kind>`, with its native CPU and torch fused variants), the hyper-parameters a
param group may set, what `engine.get_mom()` reads, whether the `mup` package builds it, and the `torch.optim` class
a client passes for it. The `OPTIMIZER` schema (part of `fzero.config.deepspeed.SCHEMA`) is read from it, with the
types fzero refuses (and the reason); `fzero.config.build` and `fzero.engine` read the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .schema import (
    REQUIRED,
    Bool,
    ConfigError,
    Field,
    ListOf,
    Nullable,
    Num,
    Section,
    Str,
    Tagged,
    UnsupportedConfigError,
    off,
)

__all__ = ["BETA", "OPTIMIZER", "OPTIMIZERS", "OptimizerType", "optimizer_type"]

BETA = Num(0, 1, high_open=True)
_MAX_GRAD_NORM = Field(
    Num(),
    None,
    unsupported="DeepSpeed rejects optimizer.params.max_grad_norm; use the top-level 'gradient_clipping'",
    supported=lambda v: v is None,
)


def _adam_checks(values: dict[str, Any], path: str) -> None:
    if values["amsgrad"] and not values["torch_adam"]:
        raise UnsupportedConfigError(
            f"{path}.amsgrad",
            "true is not supported by fzero without torch_adam: DeepSpeed's FusedAdam raises for it and its CPU Adam "
            "ignores it; with torch_adam: true DeepSpeed (and fzero) run torch's AMSGrad",
        )
    if values["torch_adam"] and not values["bias_correction"]:
        # DeepSpeed hands the params to torch.optim.AdamW / Adam, which have no such argument (a TypeError there)
        raise ConfigError(f"{path}.bias_correction", "torch_adam builds torch.optim.AdamW / Adam, which always "
                          "correct the bias: drop torch_adam, or bias_correction")  # fmt: skip


def _adam_params(decoupled_default: bool) -> Section:
    return Section(
        {
            "lr": Field(Num(0), 1e-3),
            "betas": Field(ListOf(BETA, 2), [0.9, 0.999]),
            "eps": Field(Num(0), 1e-8),
            "weight_decay": Field(
                Nullable(Num(0)), None, effect="default 0, or 0.01 with torch_adam and AdamW (torch.optim.AdamW's)"
            ),
            "adam_w_mode": Field(Bool(), decoupled_default, effect="Adam: decoupled weight decay (AdamW) unless false"),
            "torch_adam": Field(
                Bool(), False, effect="torch.optim.AdamW / Adam as DeepSpeed builds them: their defaults, no C kernel"
            ),
            "fused": Field(Nullable(Bool()), None, effect="no effect"),
            "foreach": Field(Nullable(Bool()), None, effect="no effect"),
            "bias_correction": Field(Bool(), True, effect="false: step lr * m / (sqrt(v) + eps), no 1 - beta^t"),
            "amsgrad": Field(Bool(), False, effect="with torch_adam: torch's AMSGrad (see the check)"),
            "maximize": off("maximize"),
            "max_grad_norm": _MAX_GRAD_NORM,
        },
        checks=(_adam_checks,),
    )


def _lamb_checks(values: dict[str, Any], path: str) -> None:
    if values["min_coeff"] > values["max_coeff"]:
        raise ConfigError(f"{path}.min_coeff", f"{values['min_coeff']} exceeds max_coeff {values['max_coeff']}")


LAMB_PARAMS = Section(
    {
        "lr": Field(Num(0), 1e-3),
        "bias_correction": Field(Bool(), True),
        "betas": Field(ListOf(BETA, 2), [0.9, 0.999]),
        "eps": Field(Num(0), 1e-8),
        "eps_inside_sqrt": Field(Bool(), False, effect="sqrt(v + eps) instead of sqrt(v) + eps"),
        "weight_decay": Field(Num(0), 0.0),
        "max_coeff": Field(Num(0), 10.0, effect="the trust ratio's upper clamp"),
        "min_coeff": Field(Num(0), 0.01, effect="the trust ratio's lower clamp"),
        "amsgrad": off("AMSGrad (DeepSpeed's FusedLamb refuses it too)"),
        "max_grad_norm": _MAX_GRAD_NORM,
    },
    checks=(_lamb_checks,),
)

LION_PARAMS = Section(
    {
        "lr": Field(Num(0), 1e-3),
        "betas": Field(ListOf(Num(0, 1), 2), [0.9, 0.999]),
        "weight_decay": Field(Num(0), 0.0),
        "max_grad_norm": _MAX_GRAD_NORM,
    }
)

ADAGRAD_PARAMS = Section(
    {
        "lr": Field(Num(0), 1e-2),
        "lr_decay": Field(Num(0), 0.0),
        "weight_decay": Field(Num(0), 0.0),
        "initial_accumulator_value": Field(Num(0), 0.0),
        "eps": Field(Num(0, low_open=True), 1e-10),
        "foreach": Field(Nullable(Bool()), None, effect="no effect"),
        "fused": Field(Nullable(Bool()), None, effect="no effect"),
        "differentiable": off("differentiable optimizer steps"),
        "maximize": off("maximize"),
        "amsgrad": off("AMSGrad (DeepSpeed's CPU Adagrad refuses it too)"),
        "max_grad_norm": _MAX_GRAD_NORM,
    }
)


def _sgd_checks(values: dict[str, Any], path: str) -> None:
    if values["nesterov"] and (values["momentum"] <= 0 or values["dampening"] != 0):
        raise ConfigError(f"{path}.nesterov", "Nesterov momentum needs momentum > 0 and dampening 0")


SGD_PARAMS = Section(
    {
        "lr": Field(Num(0), 1e-3),
        "momentum": Field(Num(0), 0.0),
        "dampening": Field(Num(0), 0.0),
        "weight_decay": Field(Num(0), 0.0),
        "nesterov": Field(Bool(), False),
        "foreach": Field(Nullable(Bool()), None, effect="no effect"),
        "maximize": off("maximize"),
        "max_grad_norm": _MAX_GRAD_NORM,
    },
    checks=(_sgd_checks,),
)

MUON_PARAMS = Section(
    {
        "lr": Field(Nullable(Num(0)), None, effect="both halves' lr (default: Muon 0.02, Adam 3e-4)"),
        "muon_lr": Field(Nullable(Num(0)), None, effect="the Muon tensors' lr"),
        "adam_lr": Field(Nullable(Num(0)), None, effect="the auxiliary Adam's lr"),
        "momentum": Field(Num(0, 1, high_open=True), 0.95),
        "weight_decay": Field(Num(0), 0.0, effect="both halves' decoupled decay"),
        "ns_method": Field(Str(("gram", "standard")), "gram"),
        "betas": Field(ListOf(BETA, 2), [0.9, 0.95], effect="the auxiliary Adam's"),
        "eps": Field(Num(0), 1e-10, effect="the auxiliary Adam's"),
        "adam_w_mode": Field(Bool(), True, unsupported="an L2 (not decoupled) auxiliary Adam"),
        "per_head_muon": off("orthogonalising each attention head separately"),
        "max_grad_norm": _MAX_GRAD_NORM,
    }
)


def _mu_params(sgd: bool) -> Section:
    """The params DeepSpeed hands `mup.MuAdam` / `MuAdamW` / `MuSGD` (then torch's Adam / AdamW / SGD); `lr` is
    required (mup reads it for every group)."""
    fields: dict[str, Field] = {"lr": Field(Num(0), REQUIRED), "weight_decay": Field(Num(0), 0.0)}
    if sgd:
        fields.update({"momentum": Field(Num(0), 0.0), "dampening": Field(Num(0), 0.0),
                       "nesterov": Field(Bool(), False)})  # fmt: skip
    else:
        fields.update({"betas": Field(ListOf(BETA, 2), [0.9, 0.999]), "eps": Field(Num(0), 1e-8),
                       "amsgrad": Field(Bool(), False)})  # fmt: skip
    fields.update({"foreach": Field(Nullable(Bool()), None, effect="no effect"), "maximize": off("maximize"),
                   "max_grad_norm": _MAX_GRAD_NORM})  # fmt: skip
    return Section(fields)


# ---------------------------------------------------------------------------------------------------------- the table
Read = Callable[["OptimizerType", Mapping[str, Any], str], "tuple[Any, dict[str, Any], dict[str, Any]]"]


def _read(row: OptimizerType, p: Mapping[str, Any], kind: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The config's `params` as the optimizer's lr, its other per-group keywords and its options."""
    hypers = {k: tuple(p[k]) if k == "betas" else p[k] for k in row.group_keys if k != "lr"}
    return p["lr"], hypers, {k: p[k] for k in row.options}


def _read_adam(row: OptimizerType, p: Mapping[str, Any], kind: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    # DeepSpeed passes the config's params to FusedAdam / DeepSpeedCPUAdam (default weight decay 0) or, with
    # torch_adam, to torch.optim.AdamW (default 0.01) / Adam (default 0): the default follows the class
    weight_decay = p["weight_decay"]
    if weight_decay is None:
        weight_decay = 0.01 if p["torch_adam"] and kind == "adamw" else 0.0
    hypers = {"betas": (p["betas"][0], p["betas"][1]), "eps": p["eps"], "weight_decay": weight_decay}
    options = {} if p["bias_correction"] else {"bias_correction": False}  # (torch_adam: always true)
    if p["amsgrad"]:  # (only with torch_adam: the config's check)
        options["amsgrad"] = True
    return p["lr"], hypers, options


def _read_muon(row: OptimizerType, p: Mapping[str, Any], kind: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    # DeepSpeed's two halves: `lr` shared unless `muon_lr` / `adam_lr` (0.19.8's engine)
    muon_lr = p["muon_lr"] if p["muon_lr"] is not None else p["lr"] if p["lr"] is not None else 0.02
    adam_lr = p["adam_lr"] if p["adam_lr"] is not None else p["lr"] if p["lr"] is not None else 3e-4
    hypers = {"momentum": p["momentum"], "weight_decay": p["weight_decay"], "adam_lr": adam_lr,
              "adam_betas": tuple(p["betas"]), "adam_eps": p["eps"],
              "adam_weight_decay": p["weight_decay"]}  # fmt: skip
    return muon_lr, hypers, {k: p[k] for k in row.options}


@dataclass(frozen=True)
class OptimizerType:
    """One DeepSpeed `optimizer.type`, and everything fzero does differently for it.

    Attributes:
      params: its `params` block: DeepSpeed's names, defaults and checks.
      kind: the fzero optimizer it runs, `fzero.optim.<kind>`.
      group_keys: the hyper-parameters a param group may set, by DeepSpeed's names, `lr` first (but for Muon's,
        the keywords of `fzero.optim.<kind>`).
      l2_kind: the fzero optimizer where weight decay is not decoupled (Adam's `adam_w_mode: false`, a client
        `torch.optim.Adam`); None: always `kind`.
      momentum: the param-group key DeepSpeed's `engine.get_mom()` reads.
      options: the optimizer's keywords, read from `params`, that hold for every group.
      aliases: a param group's keys that set other keywords of the optimizer (Muon's `lr`: both halves').
      lrs: the optimizer's keywords that are learning rates, each given the config's schedule.
      native: a C kernel runs it where the master weights are on the CPU (`fzero.optim.cpu_<kind>`).
      fused: torch's fused kernel runs it (`fused=True`), unless `torch_adam` asks for torch's operations.
      mup: the `mup` package builds it on the model's parameters (a torch optimizer, then run as a client's).
      client: the `torch.optim` class of a client optimizer that is translated to it, group by group (DeepSpeed's
        own classes, `fzero.deepspeed.ops`, name their row themselves: their `optimizer_type`).
      read: the config's `params` as `(lr, the other per-group keywords, options)` of the fzero optimizer.
    """

    params: Section
    kind: str
    group_keys: tuple[str, ...] = ()
    l2_kind: str | None = None
    momentum: str = "betas"
    options: tuple[str, ...] = ()
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    lrs: tuple[str, ...] = ("lr",)
    native: bool = False
    fused: bool = False
    mup: bool = False
    client: type[torch.optim.Optimizer] | None = None
    read: Read = _read

    def config_hypers(self, params: Mapping[str, Any], kind: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """The config's `params` as `(lr, the other per-group keywords, options)` of fzero optimizer `kind`."""
        return self.read(self, params, kind)

    def block_hypers(self, params: Mapping[str, Any], path: str) -> tuple[str, Any, dict[str, Any], dict[str, Any]]:
        """A config block's `params` of this type (unvalidated; a param group's values, for a class of
        `fzero.deepspeed.ops`), validated and with DeepSpeed's defaults, as `(kind, lr, the other per-group keywords,
        options)` of the fzero optimizer it runs.

        Raises:
          ConfigError: a value out of its range, naming `path` and the key.
        """
        values = self.params.validate(params, path, [])
        kind = self.kind_for(values.get("adam_w_mode", True))
        return (kind, *self.config_hypers(values, kind))

    def kind_for(self, decoupled: bool) -> str:
        """The fzero optimizer, given whether the weight decay is decoupled (AdamW's)."""
        return self.l2_kind if self.l2_kind is not None and not decoupled else self.kind

    def group_hypers(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """A param group's values (DeepSpeed's names) as the optimizer's keywords: for Muon, `lr` and
        `weight_decay` go to both halves, `betas` and `eps` to the Adam half (0.19.8's `_muon_param_groups`)."""
        out: dict[str, Any] = {}
        for key, value in overrides.items():
            for name in self.aliases.get(key, (key,)):
                out[name] = tuple(value) if key == "betas" else value
        return out


_ADAM = ("lr", "betas", "eps", "weight_decay")
_SGD = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
OPTIMIZERS: dict[str, OptimizerType] = {
    "Adam": OptimizerType(_adam_params(True), "adamw", _ADAM, l2_kind="adam", native=True, fused=True,
                          client=torch.optim.Adam, read=_read_adam),
    "AdamW": OptimizerType(_adam_params(True), "adamw", _ADAM, native=True, fused=True, client=torch.optim.AdamW,
                           read=_read_adam),
    "SGD": OptimizerType(SGD_PARAMS, "sgd", _SGD, momentum="momentum", client=torch.optim.SGD),
    "Lamb": OptimizerType(LAMB_PARAMS, "lamb", ("lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff"),
                          options=("bias_correction", "eps_inside_sqrt")),
    "Lion": OptimizerType(LION_PARAMS, "lion", ("lr", "betas", "weight_decay"), native=True),
    "Adagrad": OptimizerType(ADAGRAD_PARAMS, "adagrad", ("lr", "lr_decay", "weight_decay",
                             "initial_accumulator_value", "eps"), native=True, client=torch.optim.Adagrad),
    "Muon": OptimizerType(MUON_PARAMS, "muon", ("lr", "weight_decay", "momentum", "betas", "eps"),
                          options=("ns_method",), lrs=("lr", "adam_lr"), read=_read_muon,
                          aliases={"lr": ("lr", "adam_lr"), "weight_decay": ("weight_decay", "adam_weight_decay"),
                                   "betas": ("adam_betas",), "eps": ("adam_eps",)}),
    "MuAdam": OptimizerType(_mu_params(False), "adam", mup=True),
    "MuAdamW": OptimizerType(_mu_params(False), "adamw", mup=True),
    "MuSGD": OptimizerType(_mu_params(True), "sgd", momentum="momentum", mup=True),
}  # fmt: skip


def optimizer_type(kind: str) -> OptimizerType:
    """The row of fzero optimizer `kind` ("adamw", "adam", "sgd", "lamb", "lion", "adagrad" or "muon")."""
    return next(row for row in OPTIMIZERS.values() if kind in (row.kind, row.l2_kind))


_NOT_OPTIMIZERS = "fzero implements Adam, AdamW, SGD, Lamb, Lion, Adagrad, Muon and MuAdam, MuAdamW, MuSGD"
OPTIMIZER = Tagged(
    {name: row.params for name, row in OPTIMIZERS.items()},
    unsupported={
        name: _NOT_OPTIMIZERS
        for name in (
            "OneBitAdam",
            "ZeroOneAdam",
            "OneBitLamb",
            "RMSprop",
            "Adamax",
            "NAdam",
            "RAdam",
            "Adadelta",
            "LBFGS",
            "SparseAdam",
            "ASGD",
            "Rprop",
            "CPUAdam",
            "FusedAdam",
        )
    },
    fold=True,
    extra={"legacy_fusion": Field(Bool(), False, effect="no effect")},
)

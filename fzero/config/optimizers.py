"""The DeepSpeed `optimizer` block: each `type` DeepSpeed 0.19.8 builds, its `params` with DeepSpeed's names and
defaults, and the types fzero refuses (with the reason). Part of `fzero.config.deepspeed.SCHEMA`; the mapping onto
fzero's optimizers is `fzero.config.build`.
"""

from __future__ import annotations

from typing import Any

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

__all__ = ["BETA", "OPTIMIZER"]

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


_NOT_OPTIMIZERS = "fzero implements Adam, AdamW, SGD, Lamb, Lion, Adagrad, Muon and MuAdam, MuAdamW, MuSGD"
OPTIMIZER = Tagged(
    {
        "Adam": _adam_params(True),
        "AdamW": _adam_params(True),
        "SGD": SGD_PARAMS,
        "Lamb": LAMB_PARAMS,
        "Lion": LION_PARAMS,
        "Adagrad": ADAGRAD_PARAMS,
        "Muon": MUON_PARAMS,
        "MuAdam": _mu_params(False),
        "MuAdamW": _mu_params(False),
        "MuSGD": _mu_params(True),
    },
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

"""Muon with an auxiliary Adam, as DeepSpeed's `MuonWithAuxAdam`, on sharded flat buffers.

Each parameter tensor is a Muon tensor (`use_muon(name, shape)`: DeepSpeed's rule, a matrix or more whose name has
neither "embed" nor "lm_head") or an Adam tensor. For step `t`, gradient `g`, the state's `exp_avg` `m`:

    Muon:  m <- lerp(m, g, 1 - mu);  x <- lerp(g, m, mu)                      (Nesterov)
           o <- NS(x as a matrix) * sqrt(max(1, g.size(-2) / g.size(-1)))     (orthogonalised, whole tensor)
           w <- w (1 - lr wd);  w <- w - lr o
    Adam:  m <- lerp(m, g, 1 - b1);  v <- lerp(v, g^2, 1 - b2)
           w <- w (1 - adam_lr adam_wd);  w <- w - adam_lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

`NS` is five Newton-Schulz steps (coefficients 3.4445, -4.7750, 2.0315) on `x / (||x||_F + 1e-7)`: DeepSpeed's
"standard" iteration on the matrix, or its "gram" iteration on `x x^T` (the same map, fewer flops for wide
matrices; the square and tall ones take the standard loop), in `ns_dtype`.

The orthogonalisation needs each whole matrix, which at stages 1-3 no rank holds: every matrix has an owner rank
(the matrices spread over the ranks by size, `fzero.optim.tensors.owners`); each rank sends the owners its pieces of
`x` (one all-to-all), each owner orthogonalises its matrices, and sends every rank its pieces of `o` (a second
all-to-all, counted in the ledger). The momentum stays sharded like the parameters, so checkpoints and resharding
treat the state as Adam's: `AdamState(count, exp_avg, exp_avg_sq)`, with `exp_avg_sq` zero on Muon tensors.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from . import adam_core
from .base import AdamState, Hyper, Optimizer, check_hyper, hyper_value
from .grouped import owned
from .groups import Segments
from .tensors import Tensors

__all__ = ["deepspeed_use_muon", "muon", "newton_schulz"]

_A, _B, _C = 3.4445, -4.7750, 2.0315


def deepspeed_use_muon(name: str, shape: tuple[int, ...]) -> bool:
    """DeepSpeed's tagging (`deepspeed.initialize` sets `p.use_muon` so, overriding the user's): a matrix or more
    whose name holds neither "embed" nor "lm_head" (in any case)."""
    return len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def newton_schulz(x: Tensor, steps: int = 5, method: str = "gram", dtype: torch.dtype = torch.float32) -> Tensor:
    """DeepSpeed's `zeropower_via_newtonschulz5` ("standard") or `zeropower_via_gram_newtonschulz` ("gram") of the
    matrix `x`, computed in `dtype`, returned in `dtype`.

    Example:
      >>> o = newton_schulz(torch.tensor([[3.0, 0.0], [0.0, 0.5]]))
      >>> bool(((o - torch.eye(2)).abs() < 0.35).all())   # near the orthogonal polar factor, I
      True
    """
    tall = x.size(-2) > x.size(-1)
    norm_dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
    y = x.to(norm_dtype)
    if tall:
        y = y.mT
    y = (y / (y.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    n, m = y.size(-2), y.size(-1)
    if method == "standard" or m <= n:
        for _ in range(steps):
            a = y @ y.mT
            b = _B * a + _C * a @ a
            y = _A * y + b @ y
        return y.mT if tall else y
    r = y @ y.mT
    q: Tensor | None = None
    restart = 2
    for i in range(steps):
        if i == restart:
            assert q is not None
            y = q @ y
            r = y @ y.mT
            q = None
        z = _B * r + _C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    assert q is not None
    return y.mT @ q.mT if tall else q @ y


def muon(
    lr: Hyper = 0.02,
    momentum: float = 0.95,
    weight_decay: float = 0.0,
    *,
    adam_lr: Hyper = 3e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    adam_eps: float = 1e-10,
    adam_weight_decay: float = 0.0,
    ns_method: str = "gram",
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.float32,
    use_muon: Callable[[str, tuple[int, ...]], bool] = deepspeed_use_muon,
    groups: Any = None,
) -> Optimizer:
    """Muon on the matrices, Adam on the rest (DeepSpeed's `"type": "Muon"`, its defaults).

    Args:
      lr, momentum, weight_decay: the Muon tensors' (a schedule may drive `lr`).
      adam_lr, adam_betas, adam_eps, adam_weight_decay: the other tensors' (DeepSpeed's auxiliary Adam).
      ns_method: "gram" (DeepSpeed's default) or "standard".
      ns_steps: Newton-Schulz steps.
      ns_dtype: the iteration's dtype. DeepSpeed picks bf16 ("standard") or fp16 ("gram") where its accelerator
        supports them; float32 here (exact to float32 rounding on the CPU), bf16/fp16 on request.
      use_muon: which tensors Muon updates, from the parameter's name and shape.
      groups: parameter groups (`fzero.param_groups`): other values of any of the above but the `ns_*` for the
        parameters they name (DeepSpeed 0.19.8 splits each group into its Muon and its Adam half).

    Returns:
      An `Optimizer` with the `"tensors"` feature (it needs each tensor's place and whole matrices).
    """
    if ns_method not in ("gram", "standard"):
        raise ValueError(f"muon: ns_method must be 'gram' or 'standard', got {ns_method!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be an integer in [1, 100), got {ns_steps!r}")
    defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "adam_lr": adam_lr,
                "adam_betas": tuple(adam_betas), "adam_eps": adam_eps,
                "adam_weight_decay": adam_weight_decay}  # fmt: skip
    _check(defaults)

    def update(
        grads: Tensor,
        state: AdamState,
        params: Tensor,
        *,
        donate: bool = False,
        segments: Segments | None = None,
        tensors: Tensors | None = None,
    ) -> tuple[Tensor, AdamState]:
        if tensors is None:
            raise ValueError("muon needs each tensor's place in the buffer: run it through shard_update")
        applied = int(state.count)
        t = applied + 1
        p, m, v = owned(donate, params, state.exp_avg, state.exp_avg_sq)
        flat_p, flat_g, flat_m, flat_v = (x.reshape(-1) for x in (p, grads, m, v))
        segs = segments or Segments((flat_p.numel(),), (0,), ({},))
        hypers = [{**defaults, **o} for o in segs.overrides]
        chosen = [k for k in range(tensors.count) if use_muon(tensors.names[k], tensors.shapes[k])]
        is_muon = set(chosen)
        # each run's group (a tensor is in one group: groups are by name), Muon's and Adam's runs per group
        mu: dict[int, list[tuple[int, int]]] = {}
        ad: dict[int, list[tuple[int, int]]] = {}
        for a, b, k in tensors.runs:
            group = segs.group[bisect.bisect_right(segs.ends, a)]
            (mu if k in is_muon else ad).setdefault(group, []).append((a, b))
        for group, runs in ad.items():
            _adam_half(hypers[group], applied, t, runs, flat_p, flat_g, flat_m, flat_v)
        if not mu:
            return p, adam_core.next_state(t, m, v)
        x = torch.zeros_like(flat_p)
        for group, runs in mu.items():
            gs, ms = ([y[a:b] for a, b in runs] for y in (flat_g, flat_m))
            mom = hypers[group]["momentum"]
            torch._foreach_lerp_(ms, gs, 1 - mom)
            for (a, b), g_i, m_i in zip(runs, gs, ms, strict=True):
                torch.lerp(g_i, m_i, mom, out=x[a:b])
        o = tensors.whole(x.view_as(p), chosen, _orthogonalise(ns_steps, ns_method, ns_dtype)).reshape(-1)
        for group, runs in mu.items():
            h = hypers[group]
            lr_t = hyper_value(h["lr"], applied)
            ps = [flat_p[a:b] for a, b in runs]
            if h["weight_decay"] != 0:
                torch._foreach_mul_(ps, 1 - lr_t * h["weight_decay"])
            torch._foreach_add_(ps, [o[a:b] for a, b in runs], alpha=-lr_t)
        return p, adam_core.next_state(t, m, v)

    return Optimizer(adam_core.init_state, update, frozenset({"tensors"}), defaults=defaults, groups=groups,
                     check=_check, name="muon")  # fmt: skip


def _adam_half(h: Mapping[str, Any], applied: int, t: int, runs: list[tuple[int, int]], *flat: Tensor) -> None:
    """DeepSpeed's inline `adam_update` on the runs of one group's Adam tensors, in place."""
    flat_p, flat_g, flat_m, flat_v = flat
    ps, gs, ms, vs = ([x[a:b] for a, b in runs] for x in (flat_p, flat_g, flat_m, flat_v))
    b1, b2 = h["adam_betas"]
    lr = hyper_value(h["adam_lr"], applied)
    torch._foreach_lerp_(ms, gs, 1 - b1)
    torch._foreach_lerp_(vs, torch._foreach_mul(gs, gs), 1 - b2)
    mc = torch._foreach_div(ms, 1 - b1**t)
    denom = torch._foreach_div(vs, 1 - b2**t)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, h["adam_eps"])
    torch._foreach_div_(mc, denom)
    if h["adam_weight_decay"] != 0:
        torch._foreach_mul_(ps, 1 - lr * h["adam_weight_decay"])
    torch._foreach_add_(ps, mc, alpha=-lr)


def _orthogonalise(steps: int, method: str, dtype: torch.dtype) -> Callable[[int, Tensor], Tensor]:
    def fn(k: int, x: Tensor) -> Tensor:
        scale = math.sqrt(x.size(-2) / x.size(-1)) if x.size(-2) > x.size(-1) else 1.0  # the tensor's last two dims
        mat = x.reshape(len(x), -1) if x.ndim > 2 else x  # a convolution's filters as a matrix, as DeepSpeed
        return (newton_schulz(mat, steps, method, dtype) * scale).to(x.dtype).view_as(x)

    return fn


def _check(h: Mapping[str, Any]) -> None:
    check_hyper("learning rate", h["lr"], 0.0)
    check_hyper("momentum", h["momentum"], 0.0, 1.0)
    check_hyper("weight_decay value", h["weight_decay"], 0.0)
    adam_core.check({"lr": h["adam_lr"], "betas": h["adam_betas"], "eps": h["adam_eps"],
                     "weight_decay": h["adam_weight_decay"]})  # fmt: skip

"""Lamb on flat buffers, in DeepSpeed's `FusedLamb` arithmetic, with the trust ratio of each whole parameter tensor.

For step `t` (1-based), gradient `g`, and each parameter tensor `w` (of the tensors in the buffer):

    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    d <- sqrt(v) + eps                        (eps_inside_sqrt: sqrt(v + eps))
    u <- m / d + wd w                         (the update; L2-style decay inside the ratio, as the paper)
    s <- lr sqrt(1 - b2^t) / (1 - b1^t)       (lr without bias correction)
    c <- clamp(||w|| / ||u||, min_coeff, max_coeff)   if ||w|| > 0 and ||u|| > 0, else 1
    w <- w - (s c) u

`||w||` and `||u||` are norms of the whole tensor, also at ZeRO stages 1-3 where a rank holds a piece of it: each
rank's partial sums of squares (float64) meet in one all-gather of a float64 per tensor, added in rank order
(`fzero.optim.tensors`), so every stage computes each tensor's ratio, and a `DistMesh` the `SimMesh`'s, bitwise.
(DeepSpeed's own ZeRO-1/2 hands FusedLamb each rank's flat partition as one tensor: its ratio there is per
partition, not per parameter, and so changes with the world size; fzero's does not.)

Elementwise operations are torch's, in the dtype of the buffer; the scalars `s` and `s c` are computed in double.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import adam_core
from .base import AdamState, Hyper, Optimizer, check_hyper
from .grouped import owned
from .groups import ParamGroups, Segments
from .tensors import Tensors

__all__ = ["lamb"]


def lamb(
    lr: Hyper = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    *,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Lamb (layer-wise adaptive moments), DeepSpeed's `FusedLamb` with its defaults.

    Args:
      lr: learning rate, a float or a function of the number of updates already applied.
      betas: coefficients of the running averages of the gradient and its square (each may be a schedule).
      eps: added to the square root of the second moment (inside it with `eps_inside_sqrt`).
      weight_decay: `wd w` added to the update before the trust ratio.
      max_coeff, min_coeff: the trust ratio's clamp.
      bias_correction: scale the step by `sqrt(1 - b2^t) / (1 - b1^t)`.
      eps_inside_sqrt: DeepSpeed's `eps_inside_sqrt` (its `eps_mode` 0).
      groups: parameter groups: other values of `lr`, `betas`, `eps`, `weight_decay`, `max_coeff`, `min_coeff`.

    Returns:
      An `Optimizer` with the `"tensors"` feature: `shard_update` passes it where each tensor lies (an update
      without it treats the whole buffer as one tensor).

    Example:
      >>> import torch
      >>> opt = lamb(lr=0.1)
      >>> p = torch.full((4,), 2.0)
      >>> p, s = opt.update(torch.ones(4), opt.init(p), p)
      >>> p   # u = 0.1 / sqrt(1e-3) = 3.162 each; s = 0.1 sqrt(1e-3) / 0.1; c = ||w|| / ||u|| = 4 / 6.325
      tensor([1.9368, 1.9368, 1.9368, 1.9368])
    """
    defaults = {**adam_core.make_defaults(lr, betas, eps, weight_decay), "max_coeff": max_coeff,
                "min_coeff": min_coeff}  # fmt: skip
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
        applied = int(state.count)
        p, m, v = owned(donate, params, state.exp_avg, state.exp_avg_sq)
        n = p.numel()
        flat_p, flat_g, flat_m, flat_v = (x.reshape(-1) for x in (p, grads, m, v))
        segments = segments or Segments((n,), (0,), ({},))
        tensors = tensors or Tensors(((0, n, 0),) if n else (), 1, 1, lambda partial: partial)
        hypers = [adam_core.step_values({**defaults, **o}, applied) for o in segments.overrides]
        u = torch.empty_like(flat_p)
        for group, ranges in segments.pieces().items():
            h = hypers[group]
            ps, gs, ms, vs, us = ([x[a:b] for a, b in ranges] for x in (flat_p, flat_g, flat_m, flat_v, u))
            torch._foreach_mul_(ms, h.beta1)
            torch._foreach_add_(ms, gs, alpha=1 - h.beta1)
            torch._foreach_mul_(vs, h.beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - h.beta2)
            if eps_inside_sqrt:
                denom = torch._foreach_add(vs, h.eps)
                torch._foreach_sqrt_(denom)
            else:
                denom = torch._foreach_sqrt(vs)
                torch._foreach_add_(denom, h.eps)
            for us_i, m_i, d_i in zip(us, ms, denom, strict=True):
                torch.div(m_i, d_i, out=us_i)
            if h.weight_decay != 0:
                torch._foreach_add_(us, ps, alpha=h.weight_decay)
        # each tensor's ratio (its norms over every rank's piece), then w <- w - (s c) u
        w2, u2 = tensors.sums(p, u.view_as(p))
        scale = _scales(w2, u2, tensors, segments, defaults, hypers, applied + 1, bias_correction)
        pieces_u = [u[a:b] for a, b, _ in tensors.runs]
        torch._foreach_mul_(pieces_u, scale)
        torch._foreach_sub_([flat_p[a:b] for a, b, _ in tensors.runs], pieces_u)
        return p, adam_core.next_state(applied + 1, m, v)

    return Optimizer(adam_core.init_state, update, frozenset({"tensors"}), defaults=defaults, groups=groups,
                     check=_check, name="lamb")  # fmt: skip


def _check(h: Mapping[str, Any]) -> None:
    adam_core.check(h)
    check_hyper("max_coeff", h["max_coeff"], 0.0)
    check_hyper("min_coeff", h["min_coeff"], 0.0)
    if h["min_coeff"] > h["max_coeff"]:
        raise ValueError(f"min_coeff {h['min_coeff']} exceeds max_coeff {h['max_coeff']}")


def _scales(
    w2: Tensor,
    u2: Tensor,
    tensors: Tensors,
    segments: Segments,
    defaults: Mapping[str, Any],
    hypers: list[adam_core.StepValues],
    t: int,
    bias_correction: bool,
) -> list[float]:
    """Each run's `s c` (double): its group's step size times its tensor's clamped trust ratio."""
    w, u = w2.sqrt().reshape(-1).tolist(), u2.sqrt().reshape(-1).tolist()
    n = segments.numel
    width = n // tensors.rows if tensors.rows else 0
    out = []
    for a, _, k in tensors.runs:
        group = segments.group[bisect.bisect_right(segments.ends, a)]
        h, over = hypers[group], {**defaults, **segments.overrides[group]}
        i = (a // width) * tensors.count + k
        coeff = 1.0
        if w[i] != 0 and u[i] != 0:
            coeff = min(max(w[i] / u[i], over["min_coeff"]), over["max_coeff"])
        step = h.lr * math.sqrt(1 - h.beta2**t) / (1 - h.beta1**t) if bias_correction else h.lr
        out.append(step * coeff)
    return out

"""`adam(fused=True)`, `adamw(fused=True)`: one pass over memory wherever the master weights are.

On the CPU that is the native kernel (`fzero.cpu_adam(w)`); on a GPU it is torch's own fused kernel
(`torch._fused_adam_` / `torch._fused_adamw_`, what `torch.optim.Adam(W)(fused=True)` runs: one pass over the
parameters, the gradients and both moments, where `adamw()`'s torch operations make about eight). The master
weights' device decides, update by update, so one optimizer serves a CPU run, a GPU run and ZeRO-Offload (master
weights in host memory, gradients from the GPU) alike, as DeepSpeed runs FusedAdam or DeepSpeedCPUAdam by where its
optimizer state lives.

torch's kernel takes neither a factor for the gradients nor low-precision gradients nor a compute copy to write, as
the native kernel does (`Optimizer.features`); around it they are one elementwise pass each, the ones
`shard_update` makes for an optimizer without those features: `grads.to(float32) * factor` before, `out.copy_(p)`
(round to nearest even) after. Without bias correction (DeepSpeed's option; torch's kernel always corrects) a GPU
update runs `adamw()`'s torch operations.

On the same tensors the GPU update is `torch.optim.AdamW(fused=True)`'s bitwise. On the CPU torch's kernel rounds a
tensor's tail (its last `numel % vector width` elements) on another path than the rest, so an update there depends
on where a tensor ends; the native kernel, which runs there instead, does not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import adam_core
from .base import AdamState, Hyper, Optimizer
from .grouped import owned
from .groups import ParamGroups, Segments
from .native_common import FEATURES

__all__ = ["on_device", "torch_fused_adam", "with_fused_keywords"]


def torch_fused_adam(
    lr: Hyper,
    betas: tuple[Hyper, Hyper],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    groups: ParamGroups | None = None,
) -> Optimizer:
    """Adam (`decoupled=False`, L2) or AdamW on torch's fused kernel, on whatever device torch has it for.

    `adam(w)(fused=True)` runs it for master weights off the CPU; the tests run it on the CPU against
    `torch.optim.AdamW(fused=True)` on tensors of the same lengths.

    Args:
      lr, betas, eps, weight_decay: as `fzero.adamw` (constants or schedules of the applied updates).
      decoupled: AdamW's decoupled weight decay, else Adam's L2 penalty.
      groups: parameter groups; each group's segments are one call of the kernel with its own hyper-parameters.
    """
    defaults = adam_core.make_defaults(lr, betas, eps, weight_decay)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def update(
        grads: Tensor, state: AdamState, params: Tensor, *, donate: bool = False, segments: Segments | None = None
    ) -> tuple[Tensor, AdamState]:
        applied = int(state.count)  # (the count lives on the CPU: reading it does not wait for the device)
        t = applied + 1
        p, m, v = owned(donate, params, state.exp_avg, state.exp_avg_sq)
        # torch keeps a float32 step on the parameters' device; `full` writes it there without a host copy
        step = torch.full((), float(t), dtype=torch.float32, device=p.device)
        whole = [(0, p.numel())]
        pieces = {0: whole} if segments is None else segments.pieces()
        flat = [x.reshape(-1) for x in (p, grads.contiguous(), m, v)]
        for group, ranges in pieces.items():
            h = adam_core.step_values(defaults if segments is None else {**defaults, **segments.overrides[group]},
                                      applied)  # fmt: skip
            ps, gs, ms, vs = ([x[a:b] for a, b in ranges] for x in flat)
            kernel(ps, gs, ms, vs, [], [step] * len(ps), amsgrad=False, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                   weight_decay=h.weight_decay, eps=h.eps, maximize=False, grad_scale=None, found_inf=None)  # fmt: skip
        return p, adam_core.next_state(t, m, v)

    return Optimizer(
        adam_core.init_state,
        update,
        defaults=defaults,
        groups=groups,
        check=adam_core.check,
        name="fused_adamw" if decoupled else "fused_adam",
    )


def with_fused_keywords(opt: Optimizer) -> Optimizer:
    """`opt` taking the native kernel's fused keywords (`FEATURES`), each done in an elementwise pass of its own:
    the gradients cast to the parameters' dtype and multiplied by `grad_scale` before the update, `out` written
    from the new parameters after it (what `shard_update` does for an optimizer without the features)."""

    def update(
        grads: Tensor, state: Any, params: Tensor, *, grad_scale: float = 1.0, out: Tensor | None = None, **kw: Any
    ) -> tuple[Tensor, Any]:
        g = grads if grads.dtype == params.dtype else grads.to(params.dtype)
        if grad_scale != 1.0:
            g = g * grad_scale
        p, new = opt.update(g, state, params, **kw)
        if out is not None:
            out.copy_(p)
        return p, new

    return opt._replace(update=update, features=FEATURES)


def on_device(host: Optimizer, device: Optimizer) -> Optimizer:
    """One optimizer of two with the same state and hyper-parameters: `host`'s update (the native kernel's) for
    master weights in CPU memory, `device`'s for master weights anywhere else, taking `host`'s fused keywords.
    `update.choose(params)` names the one that runs for `params`."""
    device = with_fused_keywords(device)

    def choose(params: Tensor) -> Optimizer:
        return host if params.device.type == "cpu" else device

    def init(params: Tensor) -> Any:
        return choose(params).init(params)

    def update(grads: Tensor, state: Any, params: Tensor, **kw: Any) -> tuple[Tensor, Any]:
        return choose(params).update(grads, state, params, **kw)

    update.choose = choose  # type: ignore[attr-defined]
    return host._replace(init=init, update=update, name=f"{host.name}|{device.name}")

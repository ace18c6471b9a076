"""The Lion and Adagrad kernels' Python entry points, built like `adam_step` (`kernels.py`): the tensors checked
(`checks.check_step`), the scalars computed once per call in double and rounded once to float32 (`hyper`), then
the compiled path chosen (`binding.isa()`) or the twin (`twin`, bitwise the same arithmetic). Hyper-parameters may
be given per segment of the flat buffer (`segments=(ends, group)`), each segment bitwise what an ungrouped call on
its slice gives. The kernels run on `torch.get_num_threads()` OpenMP threads above `parallel_threshold()`
elements and release the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .checks import check_step
from .hyper import adagrad_hyper, lion_hyper
from .kernels import resolve_groups, run_step
from .segments import PerGroup, Segments

__all__ = ["adagrad_step", "lion_step"]


def lion_step(
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    *,
    lr: PerGroup,
    betas: tuple[PerGroup, PerGroup] = (0.9, 0.99),
    weight_decay: PerGroup = 0.0,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
    params_out: Tensor | None = None,
    exp_avg_out: Tensor | None = None,
    segments: Segments | None = None,
) -> None:
    """One Lion step, in place unless `*_out` tensors are given (`native/lion.c` states the float32 operations).

    With `g = grads * grad_scale`:

        c <- beta1 m + (1 - beta1) g
        p <- p (1 - lr weight_decay) - lr sign(c)        sign(0) = 0 (and sign(NaN) = 0, as torch.sign)
        m <- beta2 m + (1 - beta2) g

    Args:
      params, exp_avg: float32 CPU tensors (master weights, momentum), contiguous, of the same number of elements.
      grads: float32, bfloat16 or float16 (upcast on load).
      lr, betas, weight_decay: the step's values; with `segments`, each (and each entry of `betas`) a float for
        every group or a sequence with one float per group.
      grad_scale: multiplies every gradient as it is loaded.
      out: optional bfloat16 / float16 tensor that receives the new parameters, bitwise `params.to(out.dtype)`.
      params_out, exp_avg_out: where to write the new values (default: in place).
      segments: `(ends, group)`, as for `adam_step`.

    Raises:
      TypeError, ValueError: naming the tensor, hyper-parameter or segment-table entry at fault.

    Example:
      >>> import torch
      >>> p, m = torch.zeros(3), torch.zeros(3)
      >>> lion_step(p, torch.tensor([2.0, -1.0, 0.0]), m, lr=0.1)
      >>> p
      tensor([-0.1000,  0.1000,  0.0000])
    """
    where = "lion_step"
    outputs = {"params_out": params_out, "exp_avg_out": exp_avg_out}
    checked = check_step(where, params, grads, {"exp_avg": exp_avg}, outputs, out)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    n = params.numel()
    values = {"lr": lr, "betas[0]": betas[0], "betas[1]": betas[1], "weight_decay": weight_decay}
    groups, table = resolve_groups(where, values, segments, n)
    hypers = [lion_hyper(lr_g, b1, b2, wd, grad_scale) for lr_g, b1, b2, wd in groups.rows]
    run_step(where, "lion", hypers, table, groups, (params, grads, exp_avg), checked)


def adagrad_step(
    params: Tensor,
    grads: Tensor,
    state_sum: Tensor,
    *,
    step: int,
    lr: PerGroup,
    lr_decay: PerGroup = 0.0,
    eps: PerGroup = 1e-10,
    weight_decay: PerGroup = 0.0,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
    params_out: Tensor | None = None,
    state_sum_out: Tensor | None = None,
    segments: Segments | None = None,
) -> None:
    """One Adagrad step, in place unless `*_out` tensors are given (`native/adagrad.c` states the float32
    operations).

    With `g = grads * grad_scale + weight_decay * params` (L2, as torch.optim.Adagrad), for step `t`:

        sum <- sum + g^2
        p   <- p - lr / (1 + (t - 1) lr_decay) * g / (sqrt(sum) + eps)

    Args:
      params, state_sum: float32 CPU tensors (master weights, running sum of squared gradients), contiguous, of the
        same number of elements.
      grads: float32, bfloat16 or float16 (upcast on load).
      step: the 1-based number of this update (for `lr_decay`); shared by all groups.
      lr, lr_decay, eps, weight_decay: as `torch.optim.Adagrad`; with `segments`, each a float for every group or a
        sequence with one float per group.
      grad_scale: multiplies every gradient as it is loaded (before the weight decay is added).
      out, params_out, state_sum_out, segments: as for `lion_step` (`state_sum_out` the running sum's).

    Raises:
      As `lion_step`.

    Example:
      >>> import torch
      >>> p, s = torch.zeros(2), torch.zeros(2)
      >>> adagrad_step(p, torch.tensor([2.0, 0.0]), s, step=1, lr=0.1)
      >>> p, s
      (tensor([-0.1000,  0.0000]), tensor([4., 0.]))
    """
    where = "adagrad_step"
    outputs = {"params_out": params_out, "state_sum_out": state_sum_out}
    checked = check_step(where, params, grads, {"state_sum": state_sum}, outputs, out)
    n = params.numel()
    values = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay}
    groups, table = resolve_groups(where, values, segments, n)
    hypers = [adagrad_hyper(step, lr_g, decay, eps_g, wd, grad_scale) for lr_g, decay, eps_g, wd in groups.rows]
    run_step(where, "adagrad", hypers, table, groups, (params, grads, state_sum), checked)

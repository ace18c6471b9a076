"""The Lion and Adagrad kernels' Python entry points, built like `adam_step` (`kernels.py`): the tensors checked
(`checks.check_step`), the scalars computed once per call in double and rounded once to float32 (`hyper`), then
the compiled path chosen (`binding.isa()`) or the twin (`twin`, bitwise the same arithmetic). Hyper-parameters may
be given per segment of the flat buffer (`segments=(ends, group)`), each segment bitwise what an ungrouped call on
its slice gives. The kernels run on `torch.get_num_threads()` OpenMP threads above `parallel_threshold()`
elements and release the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import binding, twin
from .checks import DTYPE, LOW, check_step
from .hyper import adagrad_hyper, lion_hyper
from .kernels import resolve_groups
from .segments import PerGroup, PerGroupValues, Segments, check_table

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
    p_out, m_out = checked.outputs.values()
    if binding.isa() == "torch":
        segs = None if table is None else (table[0].tolist(), table[1].tolist())
        twin.lion_step(hypers if segs is not None else hypers[0], params, grads, exp_avg, checked.out, p_out, m_out,
                       segments=segs)  # fmt: skip
        return
    _call(where, "lion", hypers, table, groups, n, (params, grads, exp_avg, p_out, m_out), checked.out)


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
      out: optional bfloat16 / float16 tensor that receives the new parameters, bitwise `params.to(out.dtype)`.
      params_out, state_sum_out: where to write the new values (default: in place).
      segments: `(ends, group)`, as for `adam_step`.

    Raises:
      TypeError, ValueError: naming the tensor, hyper-parameter or segment-table entry at fault.

    Example:
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
    p_out, s_out = checked.outputs.values()
    if binding.isa() == "torch":
        segs = None if table is None else (table[0].tolist(), table[1].tolist())
        twin.adagrad_step(hypers if segs is not None else hypers[0], params, grads, state_sum, checked.out, p_out,
                          s_out, segments=segs)  # fmt: skip
        return
    _call(where, "adagrad", hypers, table, groups, n, (params, grads, state_sum, p_out, s_out), checked.out)


def _call(
    where: str,
    kernel: str,
    hypers: Sequence[Any],
    table: tuple[Tensor, Tensor] | None,
    groups: PerGroupValues,
    n: int,
    tensors: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
    out: Tensor | None,
) -> None:
    """Call `fz_<kernel>_step` (one group) or `fz_<kernel>_step_segments` on `(params, grads, state, params_out,
    state_out)` and the copy-out; explain a refused segment table."""
    if n == 0:
        return
    ffi, lib = binding.ffi, binding.lib
    p, g, s, p_out, s_out = tensors
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    common = (
        n,
        fp(p),
        ffi.cast("void *", g.data_ptr()),
        DTYPE[g.dtype],
        fp(s),
        fp(p_out),
        fp(s_out),
        ffi.cast("void *", out.data_ptr()) if out is not None else ffi.NULL,
        LOW[out.dtype] if out is not None else -1,
        torch.get_num_threads(),
    )
    ctype = f"fz_{kernel}_hyper"
    if table is None:
        rc = getattr(lib, f"fz_{kernel}_step")(ffi.new(f"{ctype} *", hypers[0]), *common)
    else:
        ends, group = table
        rc = getattr(lib, f"fz_{kernel}_step_segments")(
            ffi.new(f"{ctype}[]", list(hypers)),  # a NamedTuple fills the struct in field order (= C's)
            len(hypers),
            ffi.cast("int64_t *", ends.data_ptr()),
            ffi.cast("int64_t *", group.data_ptr()),
            ends.numel(),
            *common,
        )
        if rc == -2:  # the kernel refused the segment table (and wrote nothing): say what is wrong with it
            check_table(where, ends, group, n, groups.ngroups, groups.first)
    if rc != 0:  # unreachable after the checks above; kept so a C-side refusal never passes silently
        raise RuntimeError(f"{where}: the kernel rejected its arguments (code {rc})")

"""The kernels' Python entry points: arguments checked, then the compiled path chosen (`binding.isa()`) or the twin.

Each call hands the C code raw pointers, so every tensor is checked first (`checks`); the scalars of an Adam step
are computed once per call in double and rounded once to float32 (`hyper`). The kernels run on
`torch.get_num_threads()` OpenMP threads above `parallel_threshold()` elements and release the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from . import binding, twin
from .checks import DTYPE, F32, LOW, check_aliasing, check_tensor
from .hyper import adam_hyper
from .segments import PerGroup, PerGroupValues, Segments, check_table, per_group, segment_arrays

__all__ = ["adam_step", "ceiling", "grad_stats", "sumsq"]


def resolve_groups(
    where: str, values: Mapping[str, object], segments: Segments | None, n: int
) -> tuple[PerGroupValues, tuple[Tensor, Tensor] | None]:
    """The per-group values and the segment table (None: one group), for every kernel.

    The table's contents (order, last end, group range) are checked by the kernel itself, in C, before it writes
    anything: a Python check costs ~10 torch calls per step (6% of a 2^20-element Adam step), so it runs here only
    where the kernel will not check it (the twin, a call with nothing to update, and a table whose groups all share
    one set of values: the ungrouped kernel then runs).

    Raises:
      ValueError: per-group values without a table, or (where checked here) a bad table.
    """
    groups = per_group(where, values)
    table = None
    if segments is not None:
        table = segment_arrays(where, segments)
        if groups.ngroups is None or n == 0 or binding.isa() == "torch":
            check_table(where, *table, n, groups.ngroups, groups.first)
        if groups.ngroups is None:
            table = None
    elif groups.ngroups is not None:
        raise ValueError(f"{where}: {groups.first} has one value per group ({groups.ngroups}), but no segments "
                         "were given: pass segments=(ends, group), or a float")  # fmt: skip
    return groups, table


def adam_step(
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: PerGroup,
    betas: tuple[PerGroup, PerGroup] = (0.9, 0.999),
    eps: PerGroup = 1e-8,
    weight_decay: PerGroup = 0.0,
    decoupled: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: Tensor | None = None,
    params_out: Tensor | None = None,
    exp_avg_out: Tensor | None = None,
    exp_avg_sq_out: Tensor | None = None,
    segments: Segments | None = None,
) -> None:
    """One Adam (`decoupled=False`) or AdamW step, in place unless `*_out` tensors are given.

    With `g = grads * grad_scale` (and `g += weight_decay * params` in Adam's L2 mode), for step `t`:

        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        p <- p (1 - lr wd)   [AdamW]   -   lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    Args:
      params, exp_avg, exp_avg_sq: float32 CPU tensors (master weights, first and second moments), contiguous,
        all with the same number of elements (any shape: the kernel is elementwise, on the flat buffer).
      grads: float32, bfloat16 or float16 (upcast on load).
      step: the 1-based number of this update (for the bias corrections); shared by all groups.
      lr, betas, eps, weight_decay: as `torch.optim.AdamW` / `Adam`. With `segments`, each (and each entry of the
        pair `betas`) may be a float, for every group, or a sequence with one float per group.
      decoupled: AdamW's decoupled weight decay (True) or Adam's L2 penalty (False).
      bias_correction: divide by `1 - beta^t` (DeepSpeed's `bias_correction=False` turns both off).
      grad_scale: multiplies every gradient as it is loaded (1 / loss scale times the clipping coefficient).
      out: optional bfloat16 or float16 tensor that receives the updated parameters, rounded to nearest even:
        bitwise `params.to(out.dtype)`, written in the same pass.
      params_out, exp_avg_out, exp_avg_sq_out: where to write the new values (default: in place).
      segments: `(ends, group)`, hyper-parameters per segment of the flat buffer: segment `s` is the elements
        `[ends[s-1], ends[s])` (`ends[-1]` read as 0; an empty segment is allowed and skipped), and it uses
        group `group[s]`'s values. `ends` must be non-decreasing and end at `params.numel()`. Each segment's
        result is bitwise what an ungrouped call on its slice with its group's values gives (the scalars of each
        group are computed as the ungrouped call computes its one set, `fzero/native/hyper.py`). None: one group.

    Raises:
      TypeError, ValueError: naming the tensor, hyper-parameter or segment-table entry at fault.
    """
    where = "adam_step"
    n = params.numel() if isinstance(params, Tensor) else 0
    check_tensor(where, "params", params, n, F32)
    check_tensor(where, "grads", grads, n, DTYPE)
    check_tensor(where, "exp_avg", exp_avg, n, F32)
    check_tensor(where, "exp_avg_sq", exp_avg_sq, n, F32)
    p_out = params if params_out is None else check_tensor(where, "params_out", params_out, n, F32)
    m_out = exp_avg if exp_avg_out is None else check_tensor(where, "exp_avg_out", exp_avg_out, n, F32)
    v_out = exp_avg_sq if exp_avg_sq_out is None else check_tensor(where, "exp_avg_sq_out", exp_avg_sq_out, n, F32)
    outputs = {"params_out": p_out, "exp_avg_out": m_out, "exp_avg_sq_out": v_out}
    if out is not None:
        outputs["out"] = check_tensor(where, "out", out, n, LOW)
    inputs = {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    check_aliasing(where, inputs, outputs)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    values = {"lr": lr, "betas[0]": betas[0], "betas[1]": betas[1], "eps": eps, "weight_decay": weight_decay}
    groups, table = resolve_groups(where, values, segments, n)
    hypers = [
        adam_hyper(step, lr_g, b1, b2, eps_g, wd, decoupled, bias_correction, grad_scale)
        for lr_g, b1, b2, eps_g, wd in groups.rows
    ]
    if binding.isa() == "torch":
        segs = None if table is None else (table[0].tolist(), table[1].tolist())
        twin.adam_step(hypers if table is not None else hypers[0], params, grads, exp_avg, exp_avg_sq, out, p_out,
                       m_out, v_out, segments=segs)  # fmt: skip
        return
    if n == 0:
        return
    ffi, lib = binding.ffi, binding.lib
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    common = (
        n,
        fp(params),
        ffi.cast("void *", grads.data_ptr()),
        DTYPE[grads.dtype],
        fp(exp_avg),
        fp(exp_avg_sq),
        fp(p_out),
        fp(m_out),
        fp(v_out),
        ffi.cast("void *", out.data_ptr()) if out is not None else ffi.NULL,
        LOW[out.dtype] if out is not None else -1,
        torch.get_num_threads(),
    )
    if table is None:
        rc = lib.fz_adam_step(ffi.new("fz_adam_hyper *", hypers[0]._asdict()), *common)
    else:
        ends, group = table
        rc = lib.fz_adam_step_segments(ffi.new("fz_adam_hyper[]", hypers), len(hypers),  # field order = C's
                                       ffi.cast("int64_t *", ends.data_ptr()), ffi.cast("int64_t *", group.data_ptr()),
                                       ends.numel(), *common)  # fmt: skip
        if rc == -2:  # the kernel refused the segment table (and wrote nothing): say what is wrong with it
            check_table(where, ends, group, n, groups.ngroups, groups.first)
    if rc != 0:  # unreachable after the checks above; kept so a C-side refusal never passes silently
        raise RuntimeError(f"{where}: the kernel rejected its arguments (code {rc})")


def grad_stats(grads: Tensor) -> tuple[float, bool]:
    """One pass over `grads` (float32, bfloat16 or float16; CPU, contiguous): `(sum of squares, nonfinite)`.

    The sum is accumulated in float64 by chunks whose size depends on the length only, added in chunk order: the
    same for any thread count (it depends on the path: vector widths group the additions differently).
    `nonfinite` is True when any element is inf or nan.
    """
    where = "grad_stats"
    check_tensor(where, "grads", grads, grads.numel() if isinstance(grads, Tensor) else 0, DTYPE)
    if binding.isa() == "torch":
        return twin.grad_stats(grads)
    ffi, lib = binding.ffi, binding.lib
    total, flag = ffi.new("double *"), ffi.new("int *")
    g = ffi.cast("void *", grads.data_ptr())
    lib.fz_grad_stats(g, DTYPE[grads.dtype], grads.numel(), total, flag, torch.get_num_threads())
    return float(total[0]), bool(flag[0])


def sumsq(grads: Tensor) -> Tensor:
    """Sums of squares over the last axis in float64, one per leading index (shape `grads.shape[:-1]`): the
    local half of the global gradient norm and of the non-finite check.

    The native kernel runs where it can (a contiguous float32, bfloat16 or float16 CPU tensor, and a compiled
    path chosen): one pass, no float64 copy of the gradients (about 20x faster than torch's float64 vector norm
    on 2^24 elements, `benchmarks/adam.py`). Elsewhere (an accelerator's tensors, the twin) it is torch's
    `vector_norm(..., dtype=float64) ** 2`.
    """
    native = (
        grads.device.type == "cpu" and grads.dtype in DTYPE and grads.is_contiguous() and grads.ndim >= 1
        and binding.isa() != "torch"
    )  # fmt: skip
    if not native:
        return torch.linalg.vector_norm(grads, dim=-1, dtype=torch.float64) ** 2
    lead = grads.shape[:-1]
    rows = grads.reshape(math.prod(lead), grads.shape[-1])
    return torch.tensor([grad_stats(r)[0] for r in rows], dtype=torch.float64).reshape(lead)


def ceiling(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, a: float = 0.0) -> None:
    """The bandwidth ceiling for Adam (benchmarks only): `x <- x + a g` for x in (params, exp_avg, exp_avg_sq),
    float32, in place: Adam's exact memory traffic with fused multiply-adds only (`a = 0` changes no value, so
    the ceiling can share its buffers with the kernels it bounds)."""
    n = params.numel()
    for name, t in (("params", params), ("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor("ceiling", name, t, n, F32)
    if binding.isa() == "torch":
        twin.ceiling(params, grads, exp_avg, exp_avg_sq, a)
        return
    ffi = binding.ffi
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    binding.lib.fz_ceiling(n, fp(params), fp(grads), fp(exp_avg), fp(exp_avg_sq), a, torch.get_num_threads())

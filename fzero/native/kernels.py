"""The kernels' Python entry points: arguments checked, then the compiled path chosen (`binding.isa()`) or the twin.

Each call hands the C code raw pointers, so every tensor is checked first (`checks`); the scalars of an Adam step
are computed once per call in double and rounded once to float32 (`hyper`). The kernels run on
`torch.get_num_threads()` OpenMP threads above `parallel_threshold()` elements and release the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import binding, twin
from .checks import DTYPE, F32, LOW, StepTensors, check_step, check_tensor
from .hyper import adam_hyper
from .segments import PerGroup, PerGroupValues, Segments, check_table, per_group, segment_arrays

__all__ = ["adam_step", "ceiling", "grad_stats", "run_step", "sumsq"]


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
    outputs = {"params_out": params_out, "exp_avg_out": exp_avg_out, "exp_avg_sq_out": exp_avg_sq_out}
    checked = check_step(where, params, grads, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, outputs, out)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    n = params.numel()
    values = {"lr": lr, "betas[0]": betas[0], "betas[1]": betas[1], "eps": eps, "weight_decay": weight_decay}
    groups, table = resolve_groups(where, values, segments, n)
    hypers = [
        adam_hyper(step, lr_g, b1, b2, eps_g, wd, decoupled, bias_correction, grad_scale)
        for lr_g, b1, b2, eps_g, wd in groups.rows
    ]
    run_step(where, "adam", hypers, table, groups, (params, grads, exp_avg, exp_avg_sq), checked)


def run_step(
    where: str,
    kernel: str,
    hypers: Sequence[Any],
    table: tuple[Tensor, Tensor] | None,
    groups: PerGroupValues,
    inputs: tuple[Tensor, ...],
    checked: StepTensors,
) -> None:
    """Run a checked step of `fz_<kernel>_step` (one group) or `fz_<kernel>_step_segments`, or of the twin's
    `<kernel>_step` where the path is "torch"; explain a segment table the kernel refuses.

    Args:
      where: the calling function's name, for the messages.
      kernel: "adam", "lion" or "adagrad".
      hypers: each group's scalars (an `AdamHyper`, ...: a NamedTuple fills the C struct in field order).
      table: the segment table, or None (one group: `hypers[0]`).
      groups: the per-group values the table was checked against.
      inputs: `(params, grads, *states)`, as the kernel takes them.
      checked: the step's outputs (`params_out`, then each state's) and copy-out, from `check_step`.
    """
    outputs, out = tuple(checked.outputs.values()), checked.out
    if binding.isa() == "torch":
        segs = None if table is None else (table[0].tolist(), table[1].tolist())
        step = getattr(twin, f"{kernel}_step")
        step(hypers if table is not None else hypers[0], *inputs, out, *outputs, segments=segs)
        return
    n = inputs[0].numel()
    if n == 0:
        return
    ffi, lib = binding.ffi, binding.lib
    params, grads, *states = inputs
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    common = (
        n,
        fp(params),
        ffi.cast("void *", grads.data_ptr()),
        DTYPE[grads.dtype],
        *(fp(t) for t in (*states, *outputs)),
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
            ffi.new(f"{ctype}[]", list(hypers)),
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

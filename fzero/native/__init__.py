"""fzero's native CPU kernels: Adam/AdamW on float32 master weights and state, and the gradient statistics.

The C sources are in `native/` at the repository root; `pip install` compiles them with cffi (API mode) into
`fzero.native._kernel`. Three instruction-set paths are built into that one binary and chosen at run time from
the CPU's features: `"avx512"` (AVX-512F), `"avx2"` (AVX2 + FMA + F16C) and `"scalar"` (portable C). All three
give bitwise identical Adam results (the same IEEE operations per element in the same order). Where the extension
is missing (no C compiler at install time), a pure-torch twin with the same signatures runs instead (`"torch"`),
with one warning.

    >>> import torch, fzero
    >>> p, g = torch.ones(5), torch.full((5,), 0.5)
    >>> m, v = torch.zeros(5), torch.zeros(5)
    >>> fzero.native.adam_step(p, g, m, v, step=1, lr=0.1, weight_decay=0.0)   # in place
    >>> p
    tensor([0.9000, 0.9000, 0.9000, 0.9000, 0.9000])

Hyper-parameters per segment (parameter groups): `adam_step(..., segments=(ends, group))` gives each segment of
the flat buffer (elements `[ends[s-1], ends[s])`) the hyper-parameters of its group; `lr`, `betas[0]`, `betas[1]`,
`eps` and `weight_decay` may then be sequences with one value per group. One pass over the buffer, each segment
bitwise what an ungrouped call on its slice with its group's values gives.

    >>> p, g, m, v = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4), torch.zeros(4)
    >>> fzero.native.adam_step(p, g, m, v, step=1, lr=[0.1, 0.2], segments=((1, 4), (0, 1)))
    >>> p
    tensor([0.9000, 0.8000, 0.8000, 0.8000])

Choosing the path: `FZERO_ISA=scalar|avx2|avx512|torch|auto` in the environment (read at first use), or
`set_isa(...)` (tests use it to run every path on one machine). The kernels run on `torch.get_num_threads()`
OpenMP threads above `parallel_threshold()` elements and release the GIL.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from . import twin
from .hyper import AdamHyper, adam_hyper

try:
    from ._kernel import ffi as _ffi
    from ._kernel import lib as _lib

    _IMPORT_ERROR: ImportError | None = None
except ImportError as e:  # built without a compiler, or the build failed: the twin runs
    _ffi = _lib = None
    _IMPORT_ERROR = e

__all__ = [
    "ISAS",
    "AdamHyper",
    "adam_hyper",
    "adam_step",
    "available",
    "ceiling",
    "grad_stats",
    "isa",
    "openmp",
    "parallel_threshold",
    "set_isa",
    "slice_segments",
    "sumsq",
    "supported_isas",
]

ISAS = ("scalar", "avx2", "avx512")
"""The compiled paths, slowest first."""
_CODE = {"scalar": 0, "avx2": 1, "avx512": 2}
_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LOW = {torch.bfloat16: 1, torch.float16: 2}

_choice: str | None = None  # None until first use: then "torch" or one of ISAS
_warned = False


def available() -> bool:
    """Whether the compiled extension is installed (whatever path is chosen)."""
    return _lib is not None


def supported_isas() -> tuple[str, ...]:
    """The paths that can run on this machine: the compiled ISAs its CPU supports, then `"torch"` (always)."""
    if _lib is None:
        return ("torch",)
    best = int(_lib.fz_isa_detected())
    return (*ISAS[: best + 1], "torch")


def set_isa(name: str | None) -> str | None:
    """Force a path: `"scalar"`, `"avx2"`, `"avx512"`, `"torch"` (the twin), or `None` / `"auto"` (the best this
    CPU supports). Overrides `FZERO_ISA`.

    Returns:
      The path chosen before (None if none was chosen yet), so a caller can restore it.

    Raises:
      ValueError: for an unknown name, or a path this CPU (or this install) cannot run.
    """
    global _choice
    before = _choice
    _choice = _resolve(name, "set_isa")
    return before


def _resolve(name: str | None, where: str) -> str:
    name = str(name or "auto").strip().lower()
    if name == "torch":
        return "torch"
    if name not in (*ISAS, "auto"):
        raise ValueError(f"{where}: unknown instruction-set path {name!r}; expected one of scalar, avx2, avx512, "
                         "torch, auto")  # fmt: skip
    if _lib is None:
        if name != "auto":
            raise ValueError(f"{where}: path {name!r} needs the compiled extension, which is not installed "
                             f"({_IMPORT_ERROR}); only 'torch' can run")  # fmt: skip
        _warn_missing()
        return "torch"
    code = -1 if name == "auto" else _CODE[name]
    if _lib.fz_set_isa(code) != 0:
        raise ValueError(f"{where}: this CPU cannot run the {name!r} path; it supports "
                         f"{', '.join(supported_isas())}")  # fmt: skip
    return ISAS[int(_lib.fz_isa())]


def _warn_missing() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"fzero.native: the compiled CPU Adam kernel is not installed ({_IMPORT_ERROR}); using its pure-torch "
            "twin, which is correct but slower. Install a C compiler and reinstall fzero (pip install "
            "--force-reinstall --no-deps .) to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


def isa() -> str:
    """The path the kernels run: `"avx512"`, `"avx2"`, `"scalar"` or `"torch"` (the twin)."""
    global _choice
    if _choice is None:
        _choice = _resolve(os.environ.get("FZERO_ISA"), "FZERO_ISA")
    return _choice


def openmp() -> bool:
    """Whether the compiled kernels were built with OpenMP (False for the twin: torch threads it)."""
    return _lib is not None and bool(_lib.fz_openmp())


def parallel_threshold() -> int:
    """Calls on fewer elements than this run on one thread."""
    return int(_lib.fz_parallel_threshold()) if _lib is not None else 0


# --- argument checks ---------------------------------------------------------------------------------------------


def _check(where: str, name: str, t: object, numel: int, dtypes: dict) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{where}: {name} has dtype {t.dtype}, expected {allowed}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: {name} is on {t.device}; the CPU kernel needs CPU tensors (offload the "
                         "optimizer with shard_update(..., offload='cpu'))")  # fmt: skip
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} (shape {tuple(t.shape)}) is not contiguous")
    if t.numel() != numel:
        raise ValueError(f"{where}: {name} has {t.numel()} elements, but params has {numel}")
    return t


def _span(t: Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_aliasing(where: str, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
    """Outputs must not overlap each other, and an output may overlap an input only by being that very tensor's
    memory (in place): anything else would read values the same call already overwrote."""
    outs = [(k, _span(t)) for k, t in outputs.items() if t.numel()]
    for i, (a, (a0, a1)) in enumerate(outs):
        for b, (b0, b1) in outs[i + 1 :]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{where}: outputs {a} and {b} overlap in memory")
    for k, (o0, o1) in outs:
        for name, t in inputs.items():
            if not t.numel():
                continue
            i0, i1 = _span(t)
            if o0 < i1 and i0 < o1 and not (o0 == i0 and name == k.removesuffix("_out")):
                raise ValueError(f"{where}: output {k} overlaps input {name} (only in-place updates of the same "
                                 "buffer are allowed)")  # fmt: skip


# --- kernels -----------------------------------------------------------------------------------------------------


PerGroup = float | Sequence[float]
"""A hyper-parameter for `adam_step(..., segments=...)`: one float for every group, or one per group."""
Segments = tuple[Tensor | Sequence[int], Tensor | Sequence[int]]
"""`(ends, group)`: the exclusive end offset of each segment (non-decreasing, the last one the buffer's length) and
the group index of each segment (1-D integer CPU tensors, or sequences of ints)."""


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
    _check(where, "params", params, n, {torch.float32: 0})
    _check(where, "grads", grads, n, _DTYPE)
    _check(where, "exp_avg", exp_avg, n, {torch.float32: 0})
    _check(where, "exp_avg_sq", exp_avg_sq, n, {torch.float32: 0})
    p_out = params if params_out is None else _check(where, "params_out", params_out, n, {torch.float32: 0})
    m_out = exp_avg if exp_avg_out is None else _check(where, "exp_avg_out", exp_avg_out, n, {torch.float32: 0})
    v_out = exp_avg_sq if exp_avg_sq_out is None else _check(where, "exp_avg_sq_out", exp_avg_sq_out, n,
                                                             {torch.float32: 0})  # fmt: skip
    outputs = {"params_out": p_out, "exp_avg_out": m_out, "exp_avg_sq_out": v_out}
    if out is not None:
        outputs["out"] = _check(where, "out", out, n, _LOW)
    inputs = {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    _check_aliasing(where, inputs, outputs)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    values = {"lr": lr, "betas[0]": betas[0], "betas[1]": betas[1], "eps": eps, "weight_decay": weight_decay}
    ngroups, rows = _per_group(where, values)
    table = None
    if segments is not None:
        table = _segment_arrays(where, segments)
        # The table's contents (order, last end, group range) are checked by the kernel itself, in C, before it
        # writes anything: a Python check costs ~10 torch calls per step (6% of a 2^20-element step); it runs
        # only to explain a refusal. The twin, a call with nothing to update, and a table whose groups all share
        # one set of values (the ungrouped kernel then runs) are checked here.
        if ngroups is None or n == 0 or isa() == "torch":
            _check_table(where, *table, n, ngroups, values)
        if ngroups is None:
            table = None
    elif ngroups is not None:
        name = next(k for k, x in values.items() if _is_sequence(x))
        raise ValueError(f"{where}: {name} has one value per group ({len(values[name])}), but no segments were "
                         "given: pass segments=(ends, group), or a float")  # fmt: skip
    hypers = [adam_hyper(step, *row, decoupled, bias_correction, grad_scale) for row in rows]
    if isa() == "torch":
        segs = None if table is None else (table[0].tolist(), table[1].tolist())
        twin.adam_step(hypers if table is not None else hypers[0], params, grads, exp_avg, exp_avg_sq, out, p_out,
                       m_out, v_out, segments=segs)  # fmt: skip
        return
    if n == 0:
        return
    ffi, lib = _ffi, _lib
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    common = (
        n,
        fp(params),
        ffi.cast("void *", grads.data_ptr()),
        _DTYPE[grads.dtype],
        fp(exp_avg),
        fp(exp_avg_sq),
        fp(p_out),
        fp(m_out),
        fp(v_out),
        ffi.cast("void *", out.data_ptr()) if out is not None else ffi.NULL,
        _LOW[out.dtype] if out is not None else -1,
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
        _check_table(where, *table, n, ngroups, values)
    if rc != 0:  # unreachable after the checks above; kept so a C-side refusal never passes silently
        raise RuntimeError(f"{where}: the kernel rejected its arguments (code {rc})")


# --- per-group hyper-parameters and segment tables ----------------------------------------------------------------


def _is_sequence(x: object) -> bool:
    if type(x) in (float, int, list, tuple):  # the common cases, without the ABC checks below
        return type(x) in (list, tuple)
    return (isinstance(x, Sequence) and not isinstance(x, str)) or (isinstance(x, Tensor) and x.ndim == 1)


def _per_group(where: str, values: dict[str, object]) -> tuple[int | None, list[list]]:
    """The number of groups the per-group sequences among `values` give (they must agree; None if every value is
    one number for all groups), and each group's values in `values`' order: a per-group entry as a Python float
    (so `adam_hyper` computes in double, as for a float given to an ungrouped call), a shared value as given
    (exactly what an ungrouped call receives)."""
    ngroups, first = None, None
    for name, x in values.items():
        if not _is_sequence(x):
            continue
        if len(x) == 0:
            raise ValueError(f"{where}: {name} is an empty sequence; expected a float or one float per group")
        for i, item in enumerate(x):
            if type(item) is float:  # the common case, without the ABC check below
                continue
            if isinstance(item, bool) or not isinstance(item, numbers.Real | Tensor):
                raise TypeError(f"{where}: {name}[{i}] is {item!r}; expected a float (one per group)")
        if ngroups is None:
            ngroups, first = len(x), name
        elif len(x) != ngroups:
            raise ValueError(f"{where}: {name} has {len(x)} values but {first} has {ngroups}: per-group "
                             "hyper-parameters need one value per group each")  # fmt: skip
    columns = [[float(i) for i in x] if _is_sequence(x) else [x] * (ngroups or 1) for x in values.values()]
    return ngroups, [list(row) for row in zip(*columns, strict=True)]


def _index_tensor(where: str, name: str, x: object) -> Tensor:
    """`x` (a 1-D integer tensor or a sequence of ints) as a contiguous int64 CPU tensor (no copy if it is one)."""
    if isinstance(x, Tensor) and x.dtype == torch.int64 and x.ndim == 1 and x.device.type == "cpu":
        return x.contiguous()  # the common case (a table built once), with the fewest tensor attribute reads
    if isinstance(x, Tensor):
        t = x
    elif _is_sequence(x):
        t = torch.tensor(list(x)) if len(x) else torch.zeros(0, dtype=torch.int64)
    else:
        raise TypeError(f"{where}: segments {name} must be a 1-D integer tensor or a sequence of ints, got "
                        f"{type(x).__name__}")  # fmt: skip
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{where}: segments {name} has dtype {t.dtype}; expected integers")
    if t.ndim != 1:
        raise ValueError(f"{where}: segments {name} has shape {tuple(t.shape)}; expected one dimension")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: segments {name} is on {t.device}; expected a CPU tensor")
    return t.to(torch.int64).contiguous()


def _segment_arrays(where: str, segments: object) -> tuple[Tensor, Tensor]:
    """`segments` as `(ends, group)`, contiguous int64 CPU tensors of equal length (contents not checked)."""
    if not isinstance(segments, Sequence) or len(segments) != 2:
        raise TypeError(f"{where}: segments must be a pair (ends, group), got {type(segments).__name__}")
    ends, group = _index_tensor(where, "ends", segments[0]), _index_tensor(where, "group", segments[1])
    if group.numel() != ends.numel():
        raise ValueError(f"{where}: segments group has {group.numel()} entries but ends has {ends.numel()}: one "
                         "group index per segment")  # fmt: skip
    return ends, group


def _check_table(where: str, ends: Tensor, group: Tensor, n: int, ngroups: int | None, values: dict) -> None:
    """Raise ValueError naming the first fault of the segment table `(ends, group)` for a buffer of `n` elements
    and `ngroups` groups (None: any non-negative group index); the same rules as the kernel's own check."""
    if ends.numel() == 0:
        if n:
            raise ValueError(f"{where}: segments has no segments, but params has {n} elements (the last end must "
                             f"be {n})")  # fmt: skip
        return
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    bad = torch.nonzero(ends < starts)
    if bad.numel():
        i = int(bad[0])
        if i == 0:
            raise ValueError(f"{where}: segments ends[0] = {int(ends[0])} is negative")
        raise ValueError(f"{where}: segments ends must be non-decreasing, but ends[{i}] = {int(ends[i])} follows "
                         f"ends[{i - 1}] = {int(ends[i - 1])}")  # fmt: skip
    if int(ends[-1]) != n:
        raise ValueError(f"{where}: segments end at {int(ends[-1])}, but params has {n} elements (the last end "
                         "must be the buffer's length)")  # fmt: skip
    low = int(group.min())
    high = int(group.max())
    if low < 0:
        i = int(torch.nonzero(group < 0)[0])
        raise ValueError(f"{where}: segments group[{i}] = {int(group[i])} is negative")
    if ngroups is not None and high >= ngroups:
        i = int(torch.nonzero(group >= ngroups)[0])
        name = next(k for k, x in values.items() if _is_sequence(x))
        raise ValueError(f"{where}: segments group[{i}] = {int(group[i])} is out of range: the hyper-parameters "
                         f"give {ngroups} groups ({name} has {ngroups} values)")  # fmt: skip


def slice_segments(segments: Segments, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """The segment table of the elements `[start, stop)` of the buffer `segments` describes, with offsets relative
    to `start`: what `adam_step(..., segments=...)` needs for a piece of a flat buffer (e.g. one pipelined piece
    of an offloaded shard).

    Args:
      segments: `(ends, group)` as for `adam_step` (the table is not validated here).
      start, stop: `0 <= start <= stop <= ends[-1]`.

    Returns:
      `(ends, group)`, int64 tensors: the segments that intersect `[start, stop)` (a single empty one when
      `start == stop`), their ends clipped to `stop` and shifted by `-start`.
    """
    ends, group = (_index_tensor("slice_segments", k, x) for k, x in zip(("ends", "group"), segments, strict=True))
    total = int(ends[-1]) if ends.numel() else 0
    if not 0 <= start <= stop <= total:
        raise ValueError(f"slice_segments: need 0 <= start <= stop <= {total} (the table's length), got start "
                         f"{start}, stop {stop}")  # fmt: skip
    first = int(torch.searchsorted(ends, start, right=True)) if start < total else max(ends.numel() - 1, 0)
    last = int(torch.searchsorted(ends, stop, right=False)) if stop > start else first
    sub_ends = ends[first : last + 1].clamp(max=stop) - start
    return sub_ends, group[first : last + 1].clone()


def grad_stats(grads: Tensor) -> tuple[float, bool]:
    """One pass over `grads` (float32, bfloat16 or float16; CPU, contiguous): `(sum of squares, nonfinite)`.

    The sum is accumulated in float64 by chunks whose size depends on the length only, added in chunk order: the
    same for any thread count (it depends on the path: vector widths group the additions differently).
    `nonfinite` is True when any element is inf or nan.
    """
    where = "grad_stats"
    _check(where, "grads", grads, grads.numel() if isinstance(grads, Tensor) else 0, _DTYPE)
    if isa() == "torch":
        return twin.grad_stats(grads)
    sumsq, flag = _ffi.new("double *"), _ffi.new("int *")
    g = _ffi.cast("void *", grads.data_ptr())
    _lib.fz_grad_stats(g, _DTYPE[grads.dtype], grads.numel(), sumsq, flag, torch.get_num_threads())
    return float(sumsq[0]), bool(flag[0])


def sumsq(grads: Tensor) -> Tensor:
    """Sums of squares over the last axis in float64, one per leading index (shape `grads.shape[:-1]`): the
    local half of the global gradient norm and of the non-finite check.

    The native kernel runs where it can (a contiguous float32, bfloat16 or float16 CPU tensor, and a compiled
    path chosen): one pass, no float64 copy of the gradients (about 20x faster than torch's float64 vector norm
    on 2^24 elements, `benchmarks/adam.py`). Elsewhere (an accelerator's tensors, the twin) it is torch's
    `vector_norm(..., dtype=float64) ** 2`.
    """
    native = (
        grads.device.type == "cpu" and grads.dtype in _DTYPE and grads.is_contiguous() and grads.ndim >= 1
        and isa() != "torch"
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
        _check("ceiling", name, t, n, {torch.float32: 0})
    if isa() == "torch":
        twin.ceiling(params, grads, exp_avg, exp_avg_sq, a)
        return
    fp = lambda t: _ffi.cast("float *", t.data_ptr())  # noqa: E731
    _lib.fz_ceiling(n, fp(params), fp(grads), fp(exp_avg), fp(exp_avg_sq), a, torch.get_num_threads())


from . import ops  # noqa: E402, F401  (registers the torch.library custom op, which calls adam_step above)

"""The native CPU Adam (every instruction-set path, and the pure-torch twin) against torch.optim in float64.

The error bound. Each step is compared with `torch.optim.AdamW` / `Adam` run in float64 from the same float32
state, so errors cannot accumulate across steps and every step is checked on its own. A float32 operation rounds
its exact result `x` to within `u |x|`, `u = 2^-24` (half an ulp); the kernel's step is a fixed sequence of such
operations (`native/adam.c`), and `error_bound` propagates one `u` per rounding through it to first order, term by
term, from the magnitudes of the float64 reference (a sum is charged the sum of its terms' magnitudes, so
cancellation is accounted for, not hidden in a relative error). The test asserts `|kernel - reference| <=
error_bound`, that is, at most one unit roundoff per rounding. For a quantity computed without cancellation
(`v`, and `m` and `p` when their terms share a sign) this is a few ulp of the value. Measured worst case over 400
random cases: 0.74 of the bound (compiled paths), 0.77 (the twin).

The three compiled paths perform the same IEEE operations per element in the same order, so they must agree
bitwise (with each other, and across thread counts); the twin (torch's op order) only within the bound.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero import native

U = 2.0**-24
COMPILED = [isa for isa in native.ISAS if isa in native.supported_isas()]
MISSING = [isa for isa in native.ISAS if isa not in native.supported_isas()]
LOW = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def restore_isa():
    before = native.isa()
    yield
    native.set_isa(before)


def reference_step(p, g, m, v, t, h):
    """One float64 torch.optim step from the float32 state `(p, m, v)` at 1-based step `t`."""
    p64 = p.double().clone().requires_grad_()
    p64.grad = g.float().double() * h["grad_scale"]
    cls = torch.optim.AdamW if h["decoupled"] else torch.optim.Adam
    opt = cls([p64], lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"], foreach=False)
    # torch has no switch for the bias correction: a step count so large that 1 - beta^t is exactly 1 in float64
    # (beta <= 0.999 here, and 0.999^1e6 underflows to 0) reproduces bias_correction=False with torch's own code
    prev = float(t - 1) if h["bias_correction"] else 1e6
    opt.state[p64] = {"step": torch.tensor(prev), "exp_avg": m.double().clone(), "exp_avg_sq": v.double().clone()}
    opt.step()
    state = opt.state[p64]
    return p64.detach(), state["exp_avg"], state["exp_avg_sq"]


def error_bound(p, g, m, v, t, h, ref):
    """First-order bound of the float32 step's error: `u` per rounding, times the magnitude rounded (see the
    module docstring). Returns the bounds for `(p, m, v)`, elementwise, in float64."""
    p_ref, m_ref, v_ref = ref
    b1, b2 = h["betas"]
    lr, wd = h["lr"], h["weight_decay"]
    p, m, v = p.double(), m.double(), v.double()
    g = g.float().double() * h["grad_scale"]
    size_g = g.abs()
    if not h["decoupled"] and wd:
        size_g, g = size_g + wd * p.abs(), g + wd * p
    err_g = 2 * U * size_g  # the scale's product; the L2 fma
    # beta's and (1 - beta)'s float32 values, the product, the fma
    err_m = 3 * U * (b1 * m.abs() + (1 - b1) * size_g) + (1 - b1) * err_g
    err_v = 4 * U * (b2 * v + (1 - b2) * size_g**2) + (1 - b2) * (2 * g.abs() * err_g + err_g**2)
    bc1 = 1 - b1**t if h["bias_correction"] else 1.0
    bc2 = 1 - b2**t if h["bias_correction"] else 1.0
    inv = 1 / math.sqrt(bc2)
    root = v_ref.sqrt()
    # |sqrt(a) - sqrt(b)| <= min(|a - b| / (2 sqrt(b)), sqrt(|a - b|)); plus sqrt's own rounding
    err_root = torch.minimum(err_v / (2 * root), err_v.sqrt()).nan_to_num(0.0) + U * root
    denom = root * inv + h["eps"]
    err_denom = err_root * inv + 3 * U * denom  # 1/sqrt(bc2)'s and eps's float32 values, the fma
    step_size = lr / bc1
    update = step_size * m_ref.abs() / denom
    err_update = step_size * err_m / denom + update * err_denom / denom + 3 * U * update  # step_size, div, product
    decay = 1 - lr * wd if h["decoupled"] else 1.0
    err_p = 2 * U * (p * decay).abs() + err_update + U * p_ref.abs()  # decay's value and product; the final fma
    return err_p, err_m, err_v


def run(isa, p, g, m, v, t, h, out_dtype=None):
    native.set_isa(isa)
    p, m, v = p.clone(), m.clone(), v.clone()
    out = torch.empty(p.shape, dtype=out_dtype) if out_dtype is not None else None
    native.adam_step(p, g, m, v, step=t, out=out, **h)
    return p, m, v, out


def assert_within(got, ref, bounds, where):
    for name, x, r, b in zip("pmv", got, ref, bounds, strict=False):
        excess = (x.double() - r).abs() - b
        assert not (excess > 0).any(), (where, name, float(excess.max()))


hypers = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([0.0, 1e-3, 1e-2, 0.3]),
        "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.0, 0.9, 0.999])),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "decoupled": st.booleans(),
        "bias_correction": st.booleans(),
        "grad_scale": st.sampled_from([1.0, 0.5, 2.0**-10, 0.37]),
    }
)


@given(h=hypers, n=st.one_of(st.integers(0, 100), st.sampled_from([70_001])), steps=st.integers(1, 6),
       seed=st.integers(0, 2**16), exponent=st.integers(-3, 2), gdt=st.sampled_from([torch.float32, *LOW]),
       out_dtype=st.sampled_from([None, *LOW]))  # fmt: skip
def test_every_path_matches_the_float64_reference(h, n, steps, seed, exponent, gdt, out_dtype):
    gen = torch.Generator().manual_seed(seed)
    size = 10.0**exponent
    p, m, v = torch.randn(n, generator=gen) * size, torch.zeros(n), torch.zeros(n)
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * size).to(gdt)
        ref = reference_step(p, g, m, v, t, h)
        bounds = error_bound(p, g, m, v, t, h, ref)
        results = {isa: run(isa, p, g, m, v, t, h, out_dtype) for isa in [*COMPILED, "torch"]}
        for isa, (pk, mk, vk, out) in results.items():
            assert_within((pk, mk, vk), ref, bounds, (isa, t))
            if out is not None:  # the copy-out is the updated parameters' round to nearest even, bitwise
                assert torch.equal(out.view(torch.int16), pk.to(out_dtype).view(torch.int16)), (isa, t)
        first = results[COMPILED[0]]
        for isa in COMPILED[1:]:
            for a, b in zip(first, results[isa], strict=False):
                assert a is None or torch.equal(a, b), (isa, "differs from", COMPILED[0], t)
        p, m, v = first[:3]


@pytest.mark.parametrize("isa", native.ISAS)
def test_every_tail_length_and_offset_equals_scalar(isa):
    """Lengths 0-70 cover every tail below the vector widths (8, 16) after zero to four full vectors; views at
    element offsets 1-3 make every load and store unaligned."""
    if isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path (it supports {', '.join(native.supported_isas())})")
    h = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled": False,
         "bias_correction": True, "grad_scale": 0.5}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for n in range(71):
        for offset in range(4):
            base = [torch.randn(n + offset, generator=gen)[offset:] for _ in range(3)]
            p, g, m = base
            v = m.square()
            for gdt in (torch.float32, *LOW):
                got = run(isa, p, g.to(gdt), m, v, 3, h, torch.bfloat16)
                want = run("scalar", p, g.to(gdt), m, v, 3, h, torch.bfloat16)
                for a, b in zip(got, want, strict=False):
                    assert torch.equal(a, b), (isa, n, offset, gdt)


def test_threads_and_streaming_do_not_change_the_result():
    """Above `parallel_threshold()` the kernel splits work across OpenMP threads, and from 2^20 elements on it
    writes the low-precision copy with non-temporal stores (when aligned): neither may change a bit. The scalar
    path, on one thread with ordinary stores, is the reference; an unaligned copy takes the fallback. The
    statistics add their chunks in order, so they do not depend on the thread count either."""
    n = (1 << 20) + 37
    gen = torch.Generator().manual_seed(1)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = m.square()
    h = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01, "decoupled": True,
         "bias_correction": True, "grad_scale": 1.0}  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run("scalar", p, g, m, v, 2, h, torch.float16)
        stats = {}
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            for isa in COMPILED:
                native.set_isa(isa)
                stats.setdefault(isa, set()).add(native.grad_stats(g))  # summed by chunks: any thread count
                got = run(isa, p, g, m, v, 2, h, torch.float16)
                assert all(torch.equal(a, b) for a, b in zip(want, got, strict=False)), (isa, k)
                native.set_isa(isa)
                unaligned = torch.empty(n + 1, dtype=torch.bfloat16)[1:]
                native.adam_step(p.clone(), g, m.clone(), v.clone(), step=2, out=unaligned, **h)
                assert torch.equal(unaligned, want[0].to(torch.bfloat16)), (isa, k)
    finally:
        torch.set_num_threads(threads)
    assert all(len(results) == 1 for results in stats.values()), stats


def special_floats(n: int, seed: int) -> torch.Tensor:
    """Float32 values from every corner of the rounding: random bit patterns over all exponents, and the ties,
    neighbours of ties, overflow thresholds and subnormal boundaries of bfloat16 and float16."""
    gen = torch.Generator().manual_seed(seed)
    bits = [torch.randint(0, 2**32, (n,), generator=gen, dtype=torch.int64)]
    high = torch.randint(0, 2**16, (n,), generator=gen, dtype=torch.int64) << 16
    for low in (0x8000, 0x7FFF, 0x8001, 0):  # bfloat16: exact ties, just below, just above, exact
        bits.append(high | low)
    top = torch.randint(0, 2**19, (n,), generator=gen, dtype=torch.int64) << 13
    for low in (0x1000, 0x0FFF, 0x1001):  # float16: ties of the 13 dropped bits, and their neighbours
        bits.append(top | low)
    edges = [0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F7FFFFF, 0x7F800000, 0x38800000, 0x387FFFFF,
             0x33000000, 0x33000001, 0x32FFFFFF, 0x337FFFFF, 0x00000001, 0x00800000, 0x7F7F8000, 0]  # fmt: skip
    bits.append(torch.tensor(edges + [e | 0x80000000 for e in edges]))
    unsigned = torch.cat(bits) & 0xFFFFFFFF
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("isa", [*native.ISAS, "torch"])
def test_copy_out_is_torch_cast_bitwise(isa):
    """With `lr = 0` and zero gradients the step leaves every parameter as it is (`p - 0 * 0 / eps`), so the
    copy-out must equal torch's `.to(dtype)` of arbitrary float32 values, bitwise (NaNs: any NaN)."""
    if isa != "torch" and isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path")
    p = special_floats(4096, 0)
    zero = torch.zeros_like(p)
    h = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "decoupled": True,
         "bias_correction": True, "grad_scale": 1.0}  # fmt: skip
    for dtype in LOW:
        pk, _, _, out = run(isa, p, zero, zero, zero, 1, h, dtype)
        nan = p.isnan()  # arithmetic may quiet a signalling NaN: NaNs only stay NaN
        assert torch.equal(pk.isnan(), nan)
        assert torch.equal(pk[~nan].view(torch.int32), p[~nan].view(torch.int32))
        want = p.to(dtype)
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16)), dtype


@pytest.mark.parametrize("isa", [*native.ISAS, "torch"])
def test_low_precision_gradients_load_exactly(isa):
    """With `beta1 = 0` the new first moment is the loaded gradient itself (`fma(0, m, 1 * g)`; `0 + -0` is
    `+0`, so zeros compare by value), so every one of the 65536 bfloat16 and float16 bit patterns must arrive as
    its exact float32 value."""
    if isa != "torch" and isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path")
    h = {"lr": 0.0, "betas": (0.0, 0.999), "eps": 1e-8, "weight_decay": 0.0, "decoupled": True,
         "bias_correction": True, "grad_scale": 1.0}  # fmt: skip
    for dtype in LOW:
        g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        zero = torch.zeros(g.shape)
        _, m, _, _ = run(isa, zero, g, zero, zero, 1, h)
        want = g.float()
        nan = want.isnan()
        assert torch.equal(m.isnan(), nan)
        assert torch.equal(m[~nan], want[~nan]), dtype


@given(n=st.integers(0, 5000), seed=st.integers(0, 2**16), exponent=st.integers(-20, 20),
       dtype=st.sampled_from([torch.float32, *LOW]), bad=st.lists(st.integers(0, 4999), max_size=3),
       value=st.sampled_from([math.inf, -math.inf, math.nan]))  # fmt: skip
def test_grad_stats(n, seed, exponent, dtype, bad, value):
    """Sum of squares against torch's float64 sum: both add n non-negative float64 terms, each sum within
    `(n - 1) 2^-53` relative of the exact one, hence the tolerance `2 n 2^-53`. Every inf or nan, wherever it
    sits, raises the flag."""
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen) * 2.0**exponent).to(dtype)
    bad = [i for i in bad if i < n]
    for i in bad:
        g[i] = value
    flagged = not bool(g.isfinite().all())  # the injected values, and float16's own overflow of large ones
    want = float(g.double().square().sum())
    for isa in [*COMPILED, "torch"]:
        native.set_isa(isa)
        sumsq, nonfinite = native.grad_stats(g)
        assert nonfinite == flagged, (isa, bad)
        if not flagged:
            assert abs(sumsq - want) <= 2 * n * 2.0**-53 * want, isa
        rows = native.sumsq(g.reshape(1, -1))
        assert rows.shape == (1,) and (rows[0].item() == sumsq or (flagged and not math.isfinite(rows[0].item())))


def test_grad_stats_never_overflows_on_finite_values():
    """Squares of finite float32 values cannot overflow float64: the largest finite gradients give a finite sum
    and no false overflow."""
    g = torch.full((100_000,), torch.finfo(torch.float32).max)
    for isa in [*COMPILED, "torch"]:
        native.set_isa(isa)
        sumsq, nonfinite = native.grad_stats(g)
        assert not nonfinite and math.isfinite(sumsq), isa


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_grad_stats_adds_its_chunks_sums_in_order(dtype):
    """The sum of squares is each chunk's sum (2^15 elements a chunk below 2^25 elements), added in chunk order;
    a core sums eight whole chunks at once (eight streams read faster than one), each bitwise as if alone: the
    total is exactly the chunks' own totals added one by one, however many groups of eight and chunks after them
    there are."""
    chunk = 1 << 15
    gen = torch.Generator().manual_seed(5)
    for whole, rest in ((8, 0), (9, 100), (16, 0), (23, 31)):
        g = (torch.randn(whole * chunk + rest, generator=gen) * 3.0).to(dtype)
        pieces = [g[k * chunk : (k + 1) * chunk] for k in range(whole)] + ([g[whole * chunk :]] if rest else [])
        for isa in COMPILED:
            native.set_isa(isa)
            want = 0.0
            for piece in pieces:  # (one chunk each: the path's single-chunk sum)
                want += native.grad_stats(piece)[0]
            assert native.grad_stats(g)[0] == want, (isa, whole, rest)


def test_isa_reporting_and_errors():
    assert native.isa() in (*native.ISAS, "torch")
    # the suite runs on an install that built the extension: a silently failed build must not pass as the twin
    assert native.available(), "fzero.native._kernel did not build: see pip's output for 'building extension'"
    assert native.supported_isas()[-1] == "torch"
    with pytest.raises(ValueError, match="unknown instruction-set path 'avx513'"):
        native.set_isa("avx513")
    for isa in MISSING:
        with pytest.raises(ValueError, match=f"cannot run the '{isa}' path"):
            native.set_isa(isa)
    assert native.set_isa("scalar") in (*native.ISAS, "torch")
    assert native.isa() == "scalar"
    native.set_isa(None)
    assert native.isa() == native.supported_isas()[-2]


def test_argument_errors_name_the_tensor():
    p, g, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)
    kw = {"step": 1, "lr": 0.1}
    with pytest.raises(TypeError, match="params has dtype torch.float64, expected float32"):
        native.adam_step(p.double(), g, m, v, **kw)
    with pytest.raises(TypeError, match="grads has dtype torch.int32"):
        native.adam_step(p, g.int(), m, v, **kw)
    with pytest.raises(ValueError, match="exp_avg_sq has 3 elements, but params has 4"):
        native.adam_step(p, g, m, v[:3], **kw)
    with pytest.raises(ValueError, match="exp_avg .* is not contiguous"):
        native.adam_step(p, g, torch.zeros(8)[::2], v, **kw)
    with pytest.raises(TypeError, match="out has dtype torch.float32, expected bfloat16, float16"):
        native.adam_step(p, g, m, v, out=torch.zeros(4), **kw)
    with pytest.raises(ValueError, match="outputs params_out and exp_avg_out overlap"):
        native.adam_step(p, g, m, v, params_out=m, **kw)
    with pytest.raises(ValueError, match="output exp_avg_out overlaps input grads"):
        native.adam_step(p, g, m, v, exp_avg_out=g, **kw)
    with pytest.raises(ValueError, match="step must be a positive integer"):
        native.adam_step(p, g, m, v, step=0, lr=0.1)
    with pytest.raises(TypeError, match="grads must be a torch.Tensor, got list"):
        native.grad_stats([1.0])


def test_out_of_place_leaves_the_inputs():
    gen = torch.Generator().manual_seed(2)
    p, g, m = (torch.randn(33, generator=gen) for _ in range(3))
    v = m.square()
    inputs = [x.clone() for x in (p, g, m, v)]
    outs = {"params_out": torch.empty(33), "exp_avg_out": torch.empty(33), "exp_avg_sq_out": torch.empty(33)}
    native.adam_step(p, g, m, v, step=4, lr=0.1, **outs)
    assert all(torch.equal(a, b) for a, b in zip((p, g, m, v), inputs, strict=False))
    native.adam_step(p, g, m, v, step=4, lr=0.1)
    assert torch.equal(p, outs["params_out"]) and torch.equal(m, outs["exp_avg_out"])
    assert torch.equal(v, outs["exp_avg_sq_out"])


def test_custom_op_compiles_into_one_graph():
    """`torch.ops.fzero.adam_step_` passes torch.library's own checks, and a compiled step with it inside is one
    graph (no break), equal bitwise to eager."""
    from torch._dynamo.testing import CompileCounter

    gen = torch.Generator().manual_seed(3)
    p, g, m = (torch.randn(40, generator=gen) for _ in range(3))
    v, out = m.square(), torch.empty(40, dtype=torch.bfloat16)
    args = (p, g, m, v, out, 2, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, True, 0.5)
    torch.library.opcheck(torch.ops.fzero.adam_step_.default, tuple(a.clone() if isinstance(a, torch.Tensor)
                                                                      else a for a in args))  # fmt: skip

    def step(p, g, m, v, out):
        g = g * 2  # work around the op, so the graph has more than the op in it
        torch.ops.fzero.adam_step_(p, g, m, v, out, 2, 1e-2, 0.9, 0.999, 1e-8, 0.01, True, True, 0.5)
        return out.float().sum()

    eager = [x.clone() for x in (p, g, m, v, out)]
    compiled = [x.clone() for x in (p, g, m, v, out)]
    counter = CompileCounter()
    want = step(*eager)
    got = torch.compile(step, backend=counter, fullgraph=True)(*compiled)
    assert counter.frame_count == 1
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=False))


# --- hyper-parameters per segment (parameter groups) --------------------------------------------------------------

HYPER_CHOICES = {
    "lr": [0.0, 1e-3, 1e-2, 0.3],
    "beta1": [0.0, 0.5, 0.9],
    "beta2": [0.0, 0.9, 0.999],
    "eps": [1e-8, 1e-6, 1e-3],
    "weight_decay": [0.0, 0.01, 0.1],
}


@st.composite
def groupings(draw, max_n: int = 3000):
    """A buffer length, a segment table over it and per-group hyper-parameters. Boundaries are multiples of 16
    (fzero's parameter alignment) or anywhere; 1 to a few hundred segments (duplicate cut points make empty
    segments); 1-4 groups; each hyper-parameter one float for all groups or one per group."""
    # 70001: three chunks of work, so segments cross the threads' chunks (one case in four: it is the slow one)
    n = draw(st.sampled_from([None, None, None, 70_001])) or draw(st.integers(0, max_n))
    grid = draw(st.sampled_from([1, 16]))
    count = draw(st.integers(0, 300))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randint(0, n // grid + 1, (count,), generator=gen) * grid).sort().values.tolist()
    ends = [*cuts, n]
    ngroups = draw(st.integers(1, 4))
    group = torch.randint(0, ngroups, (len(ends),), generator=gen).tolist()
    values = {}
    for name, choices in HYPER_CHOICES.items():
        per_group = draw(st.lists(st.sampled_from(choices), min_size=ngroups, max_size=ngroups))
        shared = draw(st.booleans())
        values[name] = per_group[0] if shared else per_group
    return n, (ends, group), values  # all values shared: the table is checked, then one ungrouped pass


def group_kwargs(values: dict, g: int | None) -> dict:
    """`adam_step`'s hyper-parameter arguments: per group (`g` None) or group `g`'s floats."""
    pick = (lambda v: v) if g is None else (lambda v: v[g] if isinstance(v, list) else v)
    return {"lr": pick(values["lr"]), "betas": (pick(values["beta1"]), pick(values["beta2"])),
            "eps": pick(values["eps"]), "weight_decay": pick(values["weight_decay"])}  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so NaNs and signed zeros compare exactly)."""
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def assert_bitwise(got, want, where) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b)), where


def state(n: int, seed: int, gdt: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    return p, g.to(gdt), m, m.square() * 0.5


def grouped(isa, p, g, m, v, t, segments, values, common, out_dtype=None, in_place=True):
    """One grouped call; returns the new `(p, m, v, out)`."""
    native.set_isa(isa)
    n = p.numel()
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    if in_place:
        p, m, v = p.clone(), m.clone(), v.clone()
        native.adam_step(p, g, m, v, step=t, out=out, segments=segments, **group_kwargs(values, None), **common)
        return p, m, v, out
    outs = {"params_out": torch.empty(n), "exp_avg_out": torch.empty(n), "exp_avg_sq_out": torch.empty(n)}
    native.adam_step(p, g, m, v, step=t, out=out, segments=segments, **group_kwargs(values, None), **common, **outs)
    return outs["params_out"], outs["exp_avg_out"], outs["exp_avg_sq_out"], out


def per_slice(isa, p, g, m, v, t, segments, values, common, out_dtype=None):
    """The reference: one ungrouped call per segment, on its slice, with its group's floats."""
    native.set_isa(isa)
    p, m, v = p.clone(), m.clone(), v.clone()
    out = torch.empty(p.numel(), dtype=out_dtype) if out_dtype is not None else None
    begin = 0
    for end, k in zip(*segments, strict=True):
        part = out[begin:end] if out is not None else None
        native.adam_step(p[begin:end], g[begin:end], m[begin:end], v[begin:end], step=t, out=part,
                         **group_kwargs(values, k), **common)  # fmt: skip
        begin = end
    return p, m, v, out


@given(case=groupings(), seed=st.integers(0, 2**16), t=st.integers(1, 5), decoupled=st.booleans(),
       bias_correction=st.booleans(), grad_scale=st.sampled_from([1.0, 0.37]),
       gdt=st.sampled_from([torch.float32, *LOW]), out_dtype=st.sampled_from([None, *LOW]),
       in_place=st.booleans(), as_tensors=st.booleans())  # fmt: skip
def test_segments_equal_per_slice_calls_bitwise(case, seed, t, decoupled, bias_correction, grad_scale, gdt,
                                                out_dtype, in_place, as_tensors):  # fmt: skip
    """A grouped call gives every segment bitwise what an ungrouped call on its slice with its group's
    hyper-parameters gives, on every path (the twin against the twin); the compiled paths agree with each other
    bitwise."""
    n, (ends, group), values = case
    segments = (torch.tensor(ends), torch.tensor(group)) if as_tensors else (tuple(ends), tuple(group))
    p, g, m, v = state(n, seed, gdt)
    common = {"decoupled": decoupled, "bias_correction": bias_correction, "grad_scale": grad_scale}
    results = {}
    for isa in [*COMPILED, "torch"]:
        got = grouped(isa, p, g, m, v, t, segments, values, common, out_dtype, in_place)
        want = per_slice(isa, p, g, m, v, t, (ends, group), values, common, out_dtype)
        assert_bitwise(got, want, (isa, "grouped != per-slice"))
        results[isa] = got
    for isa in COMPILED[1:]:
        assert_bitwise(results[isa], results[COMPILED[0]], (isa, "differs from", COMPILED[0]))


@pytest.mark.parametrize("isa", native.ISAS)
def test_segments_of_every_length_and_phase(isa):
    """Segments of every length 0-40 in a shuffled order, so pieces start at every phase of the vector widths and
    end in every tail, at element offsets 0-3 (unaligned loads and stores), three groups: equal to the scalar
    path's per-slice calls bitwise."""
    if isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path (it supports {', '.join(native.supported_isas())})")
    lengths = list(range(41)) * 2
    torch.manual_seed(0)
    lengths = [lengths[i] for i in torch.randperm(len(lengths)).tolist()]
    ends = torch.tensor(lengths).cumsum(0).tolist()
    group = [i % 3 for i in range(len(ends))]
    values = {"lr": [1e-2, 3e-3, 0.1], "beta1": [0.9, 0.5, 0.0], "beta2": 0.999, "eps": [1e-8, 1e-6, 1e-3],
              "weight_decay": [0.1, 0.0, 0.01]}  # fmt: skip
    n = ends[-1]
    for offset in range(4):
        p, g, m, v = (x.new_empty(n + offset)[offset:].copy_(x) for x in state(n, offset))
        for decoupled in (True, False):
            common = {"decoupled": decoupled, "bias_correction": True, "grad_scale": 0.5}
            for gdt in (torch.float32, *LOW):
                got = grouped(isa, p, g.to(gdt), m, v, 3, (ends, group), values, common, torch.bfloat16)
                want = per_slice("scalar", p, g.to(gdt), m, v, 3, (ends, group), values, common, torch.bfloat16)
                assert_bitwise(got, want, (isa, offset, decoupled, gdt))


def test_segments_across_threads_and_streaming():
    """Segments crossing the chunks the threads share, above the streaming threshold (2^20), aligned and not:
    the same bits on 1-3 threads, on every path, as the scalar path's per-slice calls on one thread. An
    unaligned copy-out takes the ordinary stores."""
    n = (1 << 20) + 37
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 5000, (400,), generator=gen) * 16
    lengths[::7] = torch.randint(1, 64, lengths[::7].shape, generator=gen)  # some unaligned boundaries
    ends = [e for e in lengths.cumsum(0).tolist() if e < n] + [n]
    group = [i % 2 for i in range(len(ends))]
    values = {"lr": [1e-3, 1e-2], "beta1": 0.9, "beta2": [0.999, 0.99], "eps": 1e-8, "weight_decay": [0.01, 0.0]}
    common = {"decoupled": True, "bias_correction": True, "grad_scale": 0.37}
    p, g, m, v = state(n, 6, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = per_slice("scalar", p, g, m, v, 2, (ends, group), values, common, torch.float16)
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            for isa in COMPILED:
                got = grouped(isa, p, g, m, v, 2, (ends, group), values, common, torch.float16)
                assert_bitwise(got, want, (isa, k))
                unaligned = torch.empty(n + 1, dtype=torch.float16)[1:]
                q = p.clone()
                native.adam_step(q, g, m.clone(), v.clone(), step=2, out=unaligned, segments=(ends, group),
                                 **group_kwargs(values, None), **common)  # fmt: skip
                assert torch.equal(bits(unaligned), bits(want[3])) and torch.equal(bits(q), bits(want[0])), (isa, k)
    finally:
        torch.set_num_threads(threads)


@given(case=groupings(max_n=5000), cuts=st.lists(st.floats(0, 1), max_size=3), seed=st.integers(0, 2**16))
def test_slice_segments_runs_pieces_like_the_whole(case, cuts, seed):
    """Pieces of a buffer (as offload pipelines them), each with `slice_segments` of the table, give bitwise the
    grouped call on the whole buffer."""
    n, segments, values = case
    p, g, m, v = state(n, seed)
    common = {"decoupled": True, "bias_correction": True, "grad_scale": 1.0}
    want = grouped(COMPILED[-1], p, g, m, v, 2, segments, values, common)
    bounds = [0, *sorted(round(c * n) for c in cuts), n]
    p, m, v = p.clone(), m.clone(), v.clone()
    for start, stop in itertools.pairwise(bounds):
        ends, group = native.slice_segments(segments, start, stop)
        assert ends.numel() >= 1 and int(ends[-1]) == stop - start and bool((ends.diff() >= 0).all())
        native.adam_step(p[start:stop], g[start:stop], m[start:stop], v[start:stop], step=2, segments=(ends, group),
                         **group_kwargs(values, None), **common)  # fmt: skip
    assert_bitwise((p, m, v), want[:3], bounds)
    with pytest.raises(ValueError, match=rf"need 0 <= start <= stop <= {n} \(the table's length\), got start 0, "
                                         rf"stop {n + 1}"):  # fmt: skip
        native.slice_segments(segments, 0, n + 1)


def test_segment_table_errors_say_what_is_wrong():
    """Every fault of a table or of the per-group values is named; a refused call has written nothing (the compiled
    paths leave the table's check to the kernel, which refuses before it writes, and explain the refusal)."""
    p, g, m, v = state(100, 8)
    before = [x.clone() for x in (p, m, v)]

    def call(segments, lr=(0.1, 0.2), **kw):
        try:
            native.adam_step(p, g, m, v, step=1, lr=list(lr), segments=segments, **kw)
        finally:
            assert_bitwise((p, m, v), before, "a refused call wrote")

    for isa in [*COMPILED, "torch"]:
        native.set_isa(isa)
        with pytest.raises(ValueError, match=r"ends must be non-decreasing, but ends\[2\] = 40 follows ends\[1\] = 60"):
            call(([20, 60, 40, 100], [0, 1, 0, 1]))
        with pytest.raises(ValueError, match=r"ends\[0\] = -4 is negative"):
            call(([-4, 100], [0, 1]))
        with pytest.raises(ValueError, match="segments end at 90, but params has 100 elements"):
            call(([50, 90], [0, 1]))
        with pytest.raises(ValueError, match="segments end at 120, but params has 100 elements"):
            call(([50, 120], [0, 1]))
        with pytest.raises(ValueError, match="no segments, but params has 100 elements"):
            call(([], []))
        with pytest.raises(ValueError, match=r"group\[1\] = 2 is out of range: the hyper-parameters give 2 groups "
                                             r"\(lr has 2 values\)"):  # fmt: skip
            call(([50, 100], [0, 2]))
        with pytest.raises(ValueError, match=r"group\[0\] = -1 is negative"):
            call(([50, 100], [-1, 0]), lr=[0.1])
        with pytest.raises(ValueError, match="group has 3 entries but ends has 2: one group index per segment"):
            call(([50, 100], [0, 1, 0]))
        with pytest.raises(ValueError, match="weight_decay has 3 values but lr has 2: per-group hyper-parameters "
                                             "need one value per group each"):  # fmt: skip
            call(([50, 100], [0, 1]), weight_decay=[0.0, 0.1, 0.2])
        with pytest.raises(ValueError, match=r"betas\[1\] has 1 values but lr has 2"):
            call(([50, 100], [0, 1]), betas=(0.9, [0.999]))
        with pytest.raises(ValueError, match="eps is an empty sequence"):
            call(([50, 100], [0, 1]), eps=[])
        with pytest.raises(TypeError, match=r"lr\[1\] is 'fast'; expected a float"):
            call(([50, 100], [0, 1]), lr=[0.1, "fast"])
        with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\)"):
            call(([50, 100], [0, 1]), betas=(0.9, 0.99, 0.999))
        with pytest.raises(TypeError, match="segments ends has dtype torch.float32; expected integers"):
            call((torch.tensor([50.0, 100.0]), [0, 1]))
        with pytest.raises(TypeError, match="segments group has dtype torch.bool"):
            call(([50, 100], torch.tensor([False, True])))
        with pytest.raises(ValueError, match=r"segments ends has shape \(1, 2\); expected one dimension"):
            call((torch.tensor([[50, 100]]), [0, 1]))
        with pytest.raises(TypeError, match=r"segments must be a pair \(ends, group\), got int"):
            call(100)
        with pytest.raises(TypeError, match="segments ends must be a 1-D integer tensor or a sequence of ints"):
            call((100, 0))
        with pytest.raises(ValueError, match=r"lr has one value per group \(2\), but no segments were given"):
            call(None)
    # a float for every group needs no group count: any non-negative group index is fine, the table still checked
    with pytest.raises(ValueError, match="segments end at 30"):
        native.adam_step(p, g, m, v, step=1, lr=0.1, segments=([30], [0]))
    with pytest.raises(ValueError, match=r"group\[1\] = -3 is negative"):
        native.adam_step(p, g, m, v, step=1, lr=0.1, segments=([30, 100], [0, -3]))
    with pytest.raises(ValueError, match="segments end at 1, but params has 0 elements"):  # nothing to update
        native.adam_step(*(torch.zeros(0) for _ in range(4)), step=1, lr=[0.1], segments=([1], [0]))
    native.adam_step(p, g, m, v, step=1, lr=0.1, segments=([30, 100], [7, 3]))


def test_the_kernel_checks_the_table_itself():
    """The C entry point refuses an invalid table (-2) on its own, so no caller that skips the Python checks can
    make it read outside the hyper structs or the buffers."""
    ffi, lib = native._ffi, native._lib
    n = 64
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    hypers = ffi.new("fz_adam_hyper[]", [native.adam_hyper(1, 0.1, 0.9, 0.999, 1e-8, 0.0, True, True)._asdict()] * 2)
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731

    def rc(ends, group, count=None, ngroups=2):
        e, k = torch.tensor(ends, dtype=torch.int64), torch.tensor(group, dtype=torch.int64)
        table = (ffi.cast("int64_t *", e.data_ptr()), ffi.cast("int64_t *", k.data_ptr()))
        tensors = (fp(p), fp(g), 0, fp(m), fp(v), fp(p), fp(m), fp(v), ffi.NULL, -1, 2)
        return lib.fz_adam_step_segments(hypers, ngroups, *table, len(ends) if count is None else count, n, *tensors)

    assert rc([32, 64], [0, 1]) == 0
    assert rc([32, 32, 64], [0, 1, 1]) == 0  # an empty segment
    assert rc([40, 32, 64], [0, 1, 1]) == -2  # decreasing
    assert rc([-1, 64], [0, 1]) == -2
    assert rc([32, 63], [0, 1]) == -2 and rc([32, 65], [0, 1]) == -2  # not ending at n
    assert rc([32, 64], [0, 2]) == -2 and rc([32, 64], [-1, 0]) == -2  # group out of range
    assert rc([32, 64], [0, 1], ngroups=0) == -2
    assert rc([], [], count=0) == -2  # no segments for 64 elements


def test_grouped_custom_op_compiles_into_one_graph():
    """`torch.ops.fzero.adam_step_segments_` passes torch.library's checks, equals `adam_step(..., segments=...)`
    bitwise, and compiles with the rest of a step into one graph."""
    from torch._dynamo.testing import CompileCounter

    n = 200
    p, g, m, v = state(n, 7)
    out = torch.empty(n, dtype=torch.bfloat16)
    ends, group = torch.tensor([16, 64, 64, 130, 200]), torch.tensor([1, 0, 1, 1, 0])
    hyper = ([1e-2, 3e-3], [0.9, 0.8], [0.999, 0.99], [1e-8, 1e-6], [0.01, 0.0])
    args = (p, g, m, v, out, ends, group, 2, *hyper, True, True, 0.5)
    torch.library.opcheck(torch.ops.fzero.adam_step_segments_.default,
                          tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))  # fmt: skip

    def step(p, g, m, v, out):
        g = g * 2
        torch.ops.fzero.adam_step_segments_(p, g, m, v, out, ends, group, 2, *hyper, True, True, 0.5)
        return out.float().sum()

    direct = [x.clone() for x in (p, g, m, v, out)]
    native.adam_step(direct[0], direct[1] * 2, direct[2], direct[3], step=2, lr=hyper[0], betas=hyper[1:3],
                     eps=hyper[3], weight_decay=hyper[4], grad_scale=0.5, out=direct[4],
                     segments=(ends, group))  # fmt: skip
    eager = [x.clone() for x in (p, g, m, v, out)]
    compiled = [x.clone() for x in (p, g, m, v, out)]
    counter = CompileCounter()
    want = step(*eager)
    got = torch.compile(step, backend=counter, fullgraph=True)(*compiled)
    assert counter.frame_count == 1 and torch.equal(got, want)
    for a, b, c in zip(eager, compiled, direct, strict=True):
        if a is not eager[1]:
            assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))


# --- the avx512bf16 path: the bfloat16 copy-out by VCVTNEPS2BF16 ---------------------------------------------------

BF16_HW = "avx512bf16"
needs_bf16_hw = pytest.mark.skipif(
    BF16_HW not in COMPILED,
    reason=f"this CPU cannot run the {BF16_HW} path (no AVX512_BF16; it supports {', '.join(native.supported_isas())})",
)


def from_bits(values: list[int] | torch.Tensor) -> torch.Tensor:
    """Float32 values from their bit patterns (unsigned 32-bit integers)."""
    unsigned = torch.as_tensor(values, dtype=torch.int64) & 0xFFFFFFFF
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32).view(torch.float32)


def bf16_edges() -> torch.Tensor:
    """The float32 values where VCVTNEPS2BF16 and torch's rounding could part, each with both signs: subnormals
    (the instruction flushes them to zero; torch rounds them), the largest subnormal (rounds up to the smallest
    normal bfloat16), the smallest normals, ties to even and their neighbours, the values that round up to inf,
    inf, NaNs with payloads (signalling and quiet), and zero."""
    edges = [0x00000000, 0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x00400000, 0x00412345,
             0x007F7FFF, 0x007F8000, 0x007FFFFF,  # zero, subnormals
             0x00800000, 0x00800001, 0x00808000, 0x00818000,  # the smallest normal, ties above it
             0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3F80FFFF,  # ties to even, their neighbours
             0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,  # the largest that stays finite; round to inf; inf
             0x7F800001, 0x7F810000, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FC12345, 0x7FFFFFFF]  # NaNs  # fmt: skip
    return from_bits(edges + [e | 0x80000000 for e in edges])


def bf16_values(n: int, seed: int) -> torch.Tensor:
    """`bf16_edges`, then random bit patterns of every exponent, random subnormals, and vectors of normal values
    with one subnormal at each of the 16 lanes (a lone lane that needs the fix-up among lanes that do not), then
    random normal values: `n` values at least."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (256,), generator=gen, dtype=torch.int64) << 31
    subnormal = sign | torch.randint(1, 2**23, (256,), generator=gen, dtype=torch.int64)
    lone = torch.randn(16, 16, generator=gen)
    lone[torch.arange(16), torch.arange(16)] = from_bits(subnormal[:16])
    parts = [bf16_edges(), from_bits(torch.randint(0, 2**32, (1024,), generator=gen, dtype=torch.int64)),
             from_bits(subnormal), lone.flatten()]  # fmt: skip
    rest = max(0, n - sum(x.numel() for x in parts))
    return torch.cat([*parts, torch.randn(rest, generator=gen) * 100])


def bf16_rule(x: torch.Tensor) -> torch.Tensor:
    """fzero's bfloat16 of `x`, as int16 bits: torch's `x.to(torch.bfloat16)` (round to nearest even, subnormals
    rounded too), and a NaN quieted with its sign and top payload bits kept (`x >> 16 | 0x40`). torch's own NaN
    bits depend on its vector ISA (0x7FC0 on ATEN_CPU_CAPABILITY=default, 0xFFFF on avx2 / avx512), so NaNs are
    held to fzero's rule, which every compiled path follows."""
    want = x.to(torch.bfloat16).view(torch.int16)
    quiet = ((x.view(torch.int32) >> 16) | 0x40).to(torch.int16)  # (arithmetic shift: the sign stays in bit 15)
    return torch.where(x.isnan(), quiet, want)


def bf16_copy(kernel: str, isa: str, p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A step of `kernel` on path `isa` that leaves the parameters' values as they are (lr 0, zero gradients and
    state) and writes the bfloat16 copy into `out`; returns the new float32 parameters, whose rounding `out` is."""
    native.set_isa(isa)
    p = p.clone()
    zero = torch.zeros_like(p)
    if kernel == "adam":
        native.adam_step(p, zero, zero.clone(), zero.clone(), step=1, lr=0.0, out=out)
    elif kernel == "lion":
        native.lion_step(p, zero, zero.clone(), lr=0.0, out=out)
    else:
        native.adagrad_step(p, zero, zero.clone(), step=1, lr=0.0, out=out)
    return p


@needs_bf16_hw
@pytest.mark.parametrize("kernel", ["adam", "lion", "adagrad"])
def test_bf16_hw_copy_out_is_torch_cast_bitwise(kernel):
    """The avx512bf16 path's copy-out is bitwise `params.to(torch.bfloat16)` (NaNs: fzero's rule, `bf16_rule`)
    and bitwise the scalar and avx512 paths' copy, for every edge of the rounding, subnormals of both signs alone in
    a vector or among others, and random values."""
    p = bf16_values(8192, 0)
    outs = {}
    for isa in ("scalar", "avx512", BF16_HW):
        out = torch.empty(p.shape, dtype=torch.bfloat16)
        pk = bf16_copy(kernel, isa, p, out)
        nan = p.isnan()
        # the values stay (by value: Lion's p * 1 + 0 turns -0 into +0); the copy is held to the new bits
        assert torch.equal(pk.isnan(), nan) and torch.equal(pk[~nan], p[~nan]), (kernel, isa)
        got = out.view(torch.int16)
        wrong = (got != bf16_rule(pk)).nonzero().flatten()[:5].tolist()
        assert not wrong, (
            kernel,
            isa,
            [(hex(int(bits(pk)[i]) & 0xFFFFFFFF), hex(int(got[i]) & 0xFFFF)) for i in wrong],
        )
        outs[isa] = got
    assert torch.equal(outs[BF16_HW], outs["scalar"]) and torch.equal(outs[BF16_HW], outs["avx512"]), kernel


@needs_bf16_hw
@pytest.mark.parametrize("kernel", ["adam", "lion", "adagrad"])
def test_bf16_hw_every_tail_and_offset(kernel):
    """Lengths 0-79 (every tail below 32 after up to two vectors of 16) at element offsets 0-3 of the parameters
    and of the copy, in both combinations (unaligned loads, unaligned stores): the avx512bf16 path's copy and
    parameters bitwise the scalar path's, the copy bitwise `bf16_rule` of the parameters."""
    pool = bf16_values(4096, 1)
    start = 0
    for n in range(80):
        for offset, out_offset in itertools.product(range(4), repeat=2):
            values = pool[start % 4000 : start % 4000 + n]
            start += 37
            p = torch.empty(n + offset)[offset:].copy_(values)
            got = {}
            for isa in ("scalar", BF16_HW):
                out = torch.full((n + out_offset,), -1.0, dtype=torch.bfloat16)[out_offset:]
                got[isa] = bits(bf16_copy(kernel, isa, p, out)), out.view(torch.int16)
            (p_s, out_s), (p_h, out_h) = got["scalar"], got[BF16_HW]
            where = (kernel, n, offset, out_offset)
            assert torch.equal(p_h, p_s) and torch.equal(out_h, out_s), where
            assert torch.equal(out_h, bf16_rule(p_h.view(torch.float32))), where


@needs_bf16_hw
def test_bf16_hw_adam_step_streaming_and_threads():
    """A full Adam step (gradient factor, AdamW, bfloat16 gradients) over 2^20 + 37 elements with subnormals and
    NaNs among the parameters: from 2^20 elements on the aligned copy is streamed (non-temporal stores), and the
    work is split among threads. The avx512bf16 path's parameters, moments and copy, aligned and not, on 1-3
    threads, are bitwise the scalar path's on one thread, and the copy is `bf16_rule` of the parameters."""
    n = (1 << 20) + 37
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(n, generator=gen)
    g, m = torch.randn(n, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
    where = torch.randint(0, n, (4096,), generator=gen)
    p[where] = bf16_values(4096, 2)[:4096]
    g[where], m[where] = 0, 0  # no update there (0 / eps), so the subnormals stay subnormal (decayed)
    v = m.square()
    h = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "decoupled": True,
         "bias_correction": True, "grad_scale": 0.37}  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run("scalar", p, g, m, v, 3, h, torch.bfloat16)
        assert torch.equal(want[3].view(torch.int16), bf16_rule(want[0]))
        assert int((want[0] != 0).logical_and(want[0].abs() < torch.finfo(torch.float32).tiny).sum()) > 200
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            assert_bitwise(run(BF16_HW, p, g, m, v, 3, h, torch.bfloat16), want, (BF16_HW, k))
            unaligned = torch.empty(n + 1, dtype=torch.bfloat16)[1:]
            q = p.clone()
            native.adam_step(q, g, m.clone(), v.clone(), step=3, out=unaligned, **h)
            assert torch.equal(bits(q), bits(want[0])) and torch.equal(bits(unaligned), bits(want[3])), k
    finally:
        torch.set_num_threads(threads)


def test_bf16_hw_path_follows_the_cpu_flags():
    """`avx512bf16` is offered exactly where the CPU (as the OS reports it) has AVX-512F and AVX512_BF16, is the
    path chosen there by default, and is refused elsewhere with an error that names it."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is None:
        pytest.skip("/proc/cpuinfo has no flags here")
    has = "avx512f" in flags and "avx512_bf16" in flags and "avx2" in flags
    assert (BF16_HW in native.supported_isas()) == has, flags
    if has:
        native.set_isa(BF16_HW)
        assert native.isa() == BF16_HW
        native.set_isa("auto")
        assert native.isa() == BF16_HW
    else:
        with pytest.raises(ValueError, match=f"set_isa: this CPU cannot run the '{BF16_HW}' path"):
            native.set_isa(BF16_HW)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter at the repository root (so `tests.support` imports), with `env` and
    without the caller's `FZERO_ISA` (scripts/isa-matrix sets it; these tests choose the path themselves)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if k != "FZERO_ISA"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**base, **env}, cwd=root, timeout=300)  # fmt: skip


def test_environment_variable_forces_the_path(monkeypatch):
    """`FZERO_ISA` is read at first use: in a fresh interpreter for real, then (cheaper) by resetting the choice."""
    r = _python("import fzero; print(fzero.native.isa())", FZERO_ISA="scalar")
    assert r.stdout.split() == ["scalar"], r.stderr
    for value in [*COMPILED, "torch", f" {COMPILED[-1].upper()}", "auto"]:
        monkeypatch.setenv("FZERO_ISA", value)
        monkeypatch.setattr(native.binding, "_choice", None)
        assert native.isa() == (native.supported_isas()[-2] if value == "auto" else value.strip().lower())
    monkeypatch.setenv("FZERO_ISA", "fast")
    monkeypatch.setattr(native.binding, "_choice", None)
    with pytest.raises(ValueError, match="FZERO_ISA: unknown instruction-set path 'fast'"):
        native.isa()
    for isa in MISSING:
        monkeypatch.setenv("FZERO_ISA", isa)
        monkeypatch.setattr(native.binding, "_choice", None)
        with pytest.raises(ValueError, match=f"FZERO_ISA: this CPU cannot run the '{isa}' path"):
            native.isa()
    monkeypatch.delenv("FZERO_ISA")
    monkeypatch.setattr(native.binding, "_choice", None)
    native.isa()


def test_trains_without_the_extension():
    """With the compiled module unimportable (as after an install without a compiler), fzero imports, warns once,
    runs the twin, and trains."""
    code = """
        import sys, warnings
        sys.modules["fzero.native._kernel"] = None  # what a failed build leaves: the import raises ImportError
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import torch, fzero
            from tests.support import mlp, regression_batches, regression_loss
            assert not fzero.native.available() and fzero.native.isa() == "torch"
            model = mlp([4, 8, 2], 0)
            mesh = fzero.SimMesh(world=2)
            tx = fzero.zero2(fzero.cpu_adamw(3e-2), clip=1.0)
            fzero.cpu_adam(1e-3)  # a second optimizer: still one warning
            state = fzero.init(model, tx, mesh)
            step = fzero.train_step(model, regression_loss(model), tx, mesh)
            batches = regression_batches(model, 2, 1, 8, 1, 0) * 30
            losses = []
            for b in batches:
                state, metrics = step(state, b)
                losses.append(float(metrics["loss"]))
        mine = [w for w in caught if "fzero.native" in str(w.message)]
        print(len(mine), losses[0], losses[-1])
        print(mine[0].message)
    """
    r = _python(code)
    assert r.returncode == 0, r.stderr
    count, first, last = r.stdout.split("\n")[0].split()
    assert count == "1" and float(last) < 0.8 * float(first)
    assert "using their pure-torch twins" in r.stdout

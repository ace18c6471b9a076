"""The native CPU Lion and Adagrad (every instruction-set path, and the pure-torch twin) against float64 references.

What must be bitwise. The three compiled paths perform the same IEEE operations per element in the same order
(`native/lion.c`, `native/adagrad.c`), so they agree bitwise, with each other, across thread counts, and grouped or
not. The twin (`fzero/native/twin.py`) performs those very operations in torch, each fused multiply-add emulated
exactly (round to odd in float64) and the square root correctly rounded, so it agrees bitwise too (these tests
never make NaNs, whose payloads could differ).

The error bounds. Each step is compared with a float64 step from the same float32 state (Lion: a transcription
of the update; Adagrad: `torch.optim.Adagrad` itself in float64), so every step is checked on its own. A float32
operation rounds its exact result `x` to within `u |x|`, `u = 2^-24`, and each scalar (`beta`, `1 - beta`, `lr`,
`decay`, `clr`, `eps`, `weight_decay`, `grad_scale`) is one such rounding of its double value; the bounds below
charge one `u` per rounding, times the magnitude rounded (a sum is charged the sum of its terms' magnitudes, so
cancellation is accounted for), to first order, as tests/test_native.py does for Adam.

Lion, with `g' = g * grad_scale` (`scale`'s value and the product: `err_g = 2 u |g'|`):

    c = fma(g', 1 - b1, m * b1)     err_c = 2u b1 |m| + (1 - b1)(u |g'| + err_g) + u |c|     (b1's value, product;
                                                                                     1 - b1's value, g'; the fma)
    m = fma(g', 1 - b2, m * b2)     err_m = 2u b2 |m| + (1 - b2)(u |g'| + err_g) + u |m_new|
    p = fma(p, decay, -lr sign(c))  err_p = u |p| decay + u lr + u |p_new|          (decay's value, lr's, the fma)

where `|c| > err_c`, the kernel's sign is the reference's; elsewhere (c within its rounding of 0) any sign is
allowed, and `p` must be within `err_p` of `p decay - lr s` for some `s` in {-1, 0, 1}.

Adagrad, with `g2 = g' + wd p` (scale's value and product, wd's value, the fma: `err_g <= 3u (|g'| + wd |p|)`):

    s = fma(g2, g2, s)         err_s = 2 |g2| err_g + err_g^2 + u s_new                (no cancellation: s >= 0)
    r = sqrt(s)                err_r = min(err_s / (2 r), sqrt(err_s)) + u r
    d = r + eps                err_d = err_r + 2u d                                    (eps's value, the add)
    q = g2 / d                 err_q = err_g / d + |q| err_d / d + u |q|
    p = fma(q, -clr, p)        err_p = clr err_q + u clr |q| + u |p_new|              (clr's value, the fma)

Measured worst case over 400 random cases of 4 steps (sizes 1e-3 to 1e2, every dtype and hyper-parameter choice
below): Lion 0.89 of the bound for `p` and 0.75 for `m` (115 of 3.3 million elements had their sign in doubt);
Adagrad 0.997 for `p` and 0.998 for the sum, where a value just above a power of two makes one rounding's error
nearly `u |x|`. The bounds are first order: the check allows `SLACK` for the rest.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero import native
from fzero.optim.base import AdagradState, LionState
from fzero.optim.cpu_adagrad import cpu_adagrad
from fzero.optim.cpu_lion import cpu_lion
from fzero.optim.groups import Segments
from tests.test_native import bits, special_floats

U = 2.0**-24
# The bounds are first order; a second-order term is a product of two relative errors of a few u each (below
# 16 u^2 of the magnitude, where the bound is at least u of it), so this factor covers them.
SLACK = 1 + 2.0**-16
COMPILED = [isa for isa in native.ISAS if isa in native.supported_isas()]
PATHS = [*COMPILED, "torch"]
LOW = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *LOW]


@pytest.fixture(autouse=True)
def restore_isa():
    before = native.isa()
    yield
    native.set_isa(before)


def assert_bitwise(got, want, where) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(bits(a), bits(b)), where


def lion(isa, p, g, m, h, out_dtype=None, in_place=True, **extra):
    """One `lion_step` on copies of `(p, m)`; returns the new `(p, m, out)`."""
    native.set_isa(isa)
    out = torch.empty(p.shape, dtype=out_dtype) if out_dtype is not None else None
    if in_place:
        p, m = p.clone(), m.clone()
        native.lion_step(p, g, m, out=out, **h, **extra)
        return p, m, out
    outs = {"params_out": torch.empty_like(p), "exp_avg_out": torch.empty_like(m)}
    native.lion_step(p, g, m, out=out, **h, **extra, **outs)
    return outs["params_out"], outs["exp_avg_out"], out


def adagrad(isa, p, g, s, t, h, out_dtype=None, in_place=True, **extra):
    """One `adagrad_step` (step `t`) on copies of `(p, s)`; returns the new `(p, s, out)`."""
    native.set_isa(isa)
    out = torch.empty(p.shape, dtype=out_dtype) if out_dtype is not None else None
    if in_place:
        p, s = p.clone(), s.clone()
        native.adagrad_step(p, g, s, step=t, out=out, **h, **extra)
        return p, s, out
    outs = {"params_out": torch.empty_like(p), "state_sum_out": torch.empty_like(s)}
    native.adagrad_step(p, g, s, step=t, out=out, **h, **extra, **outs)
    return outs["params_out"], outs["state_sum_out"], out


# --- Lion against its float64 transcription -----------------------------------------------------------------------


def lion_reference(p, g, m, h):
    """The float64 step from the float32 state: `(p, m, c)`."""
    b1, b2 = h["betas"]
    lr, wd = h["lr"], h["weight_decay"]
    p, m = p.double(), m.double()
    g = g.float().double() * h["grad_scale"]
    c = b1 * m + (1 - b1) * g
    return p * (1 - lr * wd) - lr * torch.sign(c), b2 * m + (1 - b2) * g, c


def assert_lion_within(got, p, g, m, h, where):
    """`got = (p, m)` within the module docstring's bounds of the float64 step."""
    b1, b2 = h["betas"]
    lr, wd = h["lr"], h["weight_decay"]
    p_ref, m_ref, c_ref = lion_reference(p, g, m, h)
    p64, m64 = p.double(), m.double()
    size_g = (g.float().double() * h["grad_scale"]).abs()
    err_g = 2 * U * size_g
    err_c = 2 * U * b1 * m64.abs() + (1 - b1) * (U * size_g + err_g) + U * c_ref.abs()
    err_m = 2 * U * b2 * m64.abs() + (1 - b2) * (U * size_g + err_g) + U * m_ref.abs()
    decay = 1 - lr * wd
    err_p = U * p64.abs() * decay + U * lr + U * p_ref.abs()
    pk, mk = (x.double() for x in got[:2])
    excess = (mk - m_ref).abs() - err_m * SLACK
    assert not (excess > 0).any(), (where, "m", float(excess.max()))
    sure = (c_ref.abs() > err_c) | (err_c == 0)  # err_c == 0: every term exact, c too
    near = torch.stack([(pk - (p64 * decay - lr * s)).abs() for s in (-1, 0, 1)]).min(0).values
    excess = torch.where(sure, (pk - p_ref).abs(), near) - err_p * SLACK
    assert not (excess > 0).any(), (where, "p", float(excess.max()))


lion_hypers = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([0.0, 1e-4, 1e-3, 0.3]),
        "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.sampled_from([0.0, 0.9, 0.99, 1.0])),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "grad_scale": st.sampled_from([1.0, 0.5, 2.0**-10, 0.37]),
    }
)


@given(h=lion_hypers, n=st.one_of(st.integers(0, 100), st.sampled_from([70_001])), steps=st.integers(1, 5),
       seed=st.integers(0, 2**16), exponent=st.integers(-3, 2), gdt=st.sampled_from(DTYPES),
       out_dtype=st.sampled_from([None, *LOW]), in_place=st.booleans())  # fmt: skip
def test_lion_every_path_matches_the_float64_reference(h, n, steps, seed, exponent, gdt, out_dtype, in_place):
    gen = torch.Generator().manual_seed(seed)
    size = 10.0**exponent
    p, m = torch.randn(n, generator=gen) * size, torch.zeros(n)
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * size).to(gdt)
        results = {isa: lion(isa, p, g, m, h, out_dtype, in_place) for isa in PATHS}
        first = results[PATHS[0]]
        for isa, got in results.items():
            assert_bitwise(got, first, (isa, "differs from", PATHS[0], t))
        assert_lion_within(first, p, g, m, h, t)
        if out_dtype is not None:  # the copy-out is the new parameters' round to nearest even, bitwise
            assert torch.equal(bits(first[2]), bits(first[0].to(out_dtype)))
        p, m = first[:2]


# --- Adagrad against torch.optim.Adagrad in float64 -----------------------------------------------------------------


def adagrad_reference(p, g, s, t, h):
    """One float64 `torch.optim.Adagrad` step (step `t`, 1-based) from the float32 state `(p, s)`."""
    p64 = p.double().clone().requires_grad_()
    p64.grad = g.float().double() * h["grad_scale"]
    opt = torch.optim.Adagrad([p64], lr=h["lr"], lr_decay=h["lr_decay"], weight_decay=h["weight_decay"],
                              eps=h["eps"], foreach=False)  # fmt: skip
    opt.state[p64] = {"step": torch.tensor(float(t - 1)), "sum": s.double().clone()}
    opt.step()
    return p64.detach(), opt.state[p64]["sum"]


def assert_adagrad_within(got, p, g, s, t, h, where):
    """`got = (p, s)` within the module docstring's bounds of torch's float64 step."""
    p_ref, s_ref = adagrad_reference(p, g, s, t, h)
    wd = h["weight_decay"]
    p64 = p.double()
    g1 = g.float().double() * h["grad_scale"]
    g2 = g1 + wd * p64
    err_g = 3 * U * (g1.abs() + wd * p64.abs())
    err_s = 2 * g2.abs() * err_g + err_g**2 + U * s_ref
    root = s_ref.sqrt()
    err_r = torch.minimum(err_s / (2 * root), err_s.sqrt()).nan_to_num(0.0) + U * root
    d = root + h["eps"]
    err_d = err_r + 2 * U * d
    q = g2 / d
    err_q = err_g / d + q.abs() * err_d / d + U * q.abs()
    clr = h["lr"] / (1 + (t - 1) * h["lr_decay"])
    err_p = clr * err_q + U * clr * q.abs() + U * p_ref.abs()
    for name, x, ref, err in (("p", got[0], p_ref, err_p), ("sum", got[1], s_ref, err_s)):
        excess = (x.double() - ref).abs() - err * SLACK
        assert not (excess > 0).any(), (where, name, float(excess.max()))


adagrad_hypers = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([0.0, 1e-3, 1e-2, 0.3]),
        "lr_decay": st.sampled_from([0.0, 0.1, 1.0]),
        "eps": st.sampled_from([1e-10, 1e-8, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "grad_scale": st.sampled_from([1.0, 0.5, 2.0**-10, 0.37]),
    }
)


@given(h=adagrad_hypers, n=st.one_of(st.integers(0, 100), st.sampled_from([70_001])), steps=st.integers(1, 5),
       seed=st.integers(0, 2**16), exponent=st.integers(-3, 2), initial=st.sampled_from([0.0, 0.1]),
       gdt=st.sampled_from(DTYPES), out_dtype=st.sampled_from([None, *LOW]), in_place=st.booleans())  # fmt: skip
def test_adagrad_every_path_matches_the_float64_reference(h, n, steps, seed, exponent, initial, gdt, out_dtype,
                                                          in_place):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    size = 10.0**exponent
    p, s = torch.randn(n, generator=gen) * size, torch.full((n,), initial)
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * size).to(gdt)
        results = {isa: adagrad(isa, p, g, s, t, h, out_dtype, in_place) for isa in PATHS}
        first = results[PATHS[0]]
        for isa, got in results.items():
            assert_bitwise(got, first, (isa, "differs from", PATHS[0], t))
        assert_adagrad_within(first, p, g, s, t, h, t)
        if out_dtype is not None:
            assert torch.equal(bits(first[2]), bits(first[0].to(out_dtype)))
        p, s = first[:2]


# --- the paths' mechanics: tails, alignment, threads, streaming, conversions ----------------------------------------

LION_H = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, "grad_scale": 0.5}
ADAGRAD_H = {"lr": 1e-2, "lr_decay": 0.1, "eps": 1e-10, "weight_decay": 0.1, "grad_scale": 0.5}


@pytest.mark.parametrize("isa", native.ISAS)
def test_every_tail_length_and_offset_equals_scalar(isa):
    """Lengths 0-70 cover every tail below the vector widths (8, 16) after zero to four full vectors; views at
    element offsets 1-3 make every load and store unaligned; every gradient dtype, both copy-out dtypes."""
    if isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path (it supports {', '.join(native.supported_isas())})")
    gen = torch.Generator().manual_seed(0)
    for n in range(71):
        for offset in range(4):
            p, g, m = (torch.randn(n + offset, generator=gen)[offset:] for _ in range(3))
            s = m.square()
            for gdt, odt in zip(DTYPES, [*LOW, LOW[0]], strict=True):
                got = lion(isa, p, g.to(gdt), m, LION_H, odt)
                assert_bitwise(got, lion("scalar", p, g.to(gdt), m, LION_H, odt), ("lion", isa, n, offset, gdt))
                got = adagrad(isa, p, g.to(gdt), s, 3, ADAGRAD_H, odt)
                want = adagrad("scalar", p, g.to(gdt), s, 3, ADAGRAD_H, odt)
                assert_bitwise(got, want, ("adagrad", isa, n, offset, gdt))


def test_threads_and_streaming_do_not_change_the_result():
    """Above `parallel_threshold()` the kernels split work across OpenMP threads, and from 2^20 elements on they
    write the low-precision copy with non-temporal stores (when aligned): neither may change a bit. The scalar
    path on one thread is the reference; an unaligned copy takes the ordinary stores."""
    n = (1 << 20) + 37
    gen = torch.Generator().manual_seed(1)
    p, m = (torch.randn(n, generator=gen) for _ in range(2))
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    s = m.square()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want_l = lion("scalar", p, g, m, LION_H, torch.float16)
        want_a = adagrad("scalar", p, g, s, 2, ADAGRAD_H, torch.float16)
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            for isa in COMPILED:
                assert_bitwise(lion(isa, p, g, m, LION_H, torch.float16), want_l, ("lion", isa, k))
                assert_bitwise(adagrad(isa, p, g, s, 2, ADAGRAD_H, torch.float16), want_a, ("adagrad", isa, k))
                unaligned = torch.empty(n + 1, dtype=torch.float16)[1:]
                native.lion_step(p.clone(), g, m.clone(), out=unaligned, **LION_H)
                assert torch.equal(bits(unaligned), bits(want_l[2])), (isa, k)
                native.adagrad_step(p.clone(), g, s.clone(), step=2, out=unaligned, **ADAGRAD_H)
                assert torch.equal(bits(unaligned), bits(want_a[2])), (isa, k)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", PATHS)
def test_copy_out_is_torch_cast_bitwise(isa):
    """Adagrad with `lr = 0` and zero gradients leaves every parameter as it is (`fma(0 / eps, -0, p) = p`, signed
    zeros included), so its copy-out must equal torch's `.to(dtype)` of arbitrary float32 values, bitwise (NaNs:
    any NaN). Lion's copy-out is its new parameters' cast too (there `-0` may become `+0`: `fma(-0, 1, +0)`)."""
    p = special_floats(4096, 0)
    zero = torch.zeros_like(p)
    nan = p.isnan()
    for dtype in LOW:
        pk, _, out = adagrad(isa, p, zero, zero, 1, {"lr": 0.0, "eps": 1e-10}, dtype)
        assert torch.equal(pk.isnan(), nan) and torch.equal(bits(pk[~nan]), bits(p[~nan]))
        want = p.to(dtype)
        assert torch.equal(out.isnan(), nan) and torch.equal(bits(out[~nan]), bits(want[~nan])), dtype
        pk, _, out = lion(isa, p, zero, zero, {"lr": 0.0}, dtype)
        assert torch.equal(pk.isnan(), nan) and torch.equal(pk[~nan], p[~nan])  # by value: -0 == +0
        assert torch.equal(out.isnan(), nan) and torch.equal(bits(out[~nan]), bits(pk[~nan].to(dtype))), dtype


@pytest.mark.parametrize("isa", PATHS)
def test_low_precision_gradients_load_exactly(isa):
    """With `beta2 = 0` Lion's new momentum is the loaded gradient itself (`fma(g, 1, m * 0)`; zeros compare by
    value), so every one of the 65536 bfloat16 and float16 bit patterns must arrive as its exact float32 value."""
    for dtype in LOW:
        g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        zero = torch.zeros(g.shape)
        _, m, _ = lion(isa, zero, g, zero, {"lr": 0.0, "betas": (0.9, 0.0)})
        want = g.float()
        nan = want.isnan()
        assert torch.equal(m.isnan(), nan)
        assert torch.equal(m[~nan], want[~nan]), dtype


@pytest.mark.parametrize("isa", PATHS)
def test_sign_of_zero_and_grad_scale(isa):
    """`sign(0) = 0`: an element whose interpolation is exactly 0 (zero momentum and gradient: the padding) only
    decays. `grad_scale` is a multiplication on load: a power of two gives bitwise the pre-scaled gradients."""
    p = torch.tensor([1.0, -2.0, 0.0, 3.0])
    g = torch.tensor([0.0, 0.0, 0.0, 1.0])
    pk, m, _ = lion(isa, p, g, torch.zeros(4), {"lr": 0.1, "weight_decay": 0.5})
    h = native.lion_hyper(0.1, 0.9, 0.99, 0.5)
    assert torch.equal(pk, native.twin.fma(p, h.decay, torch.tensor([0.0, 0.0, 0.0, -h.lr])))
    assert torch.equal(pk[:3], p[:3] * h.decay) and m.tolist()[:3] == [0.0, 0.0, 0.0]
    gen = torch.Generator().manual_seed(4)
    p, g, m = (torch.randn(100, generator=gen) for _ in range(3))
    s = m.square()
    assert_bitwise(lion(isa, p, g, m, {**LION_H, "grad_scale": 0.25}),
                   lion(isa, p, g * 0.25, m, {**LION_H, "grad_scale": 1.0}), "lion grad_scale")  # fmt: skip
    assert_bitwise(adagrad(isa, p, g, s, 2, {**ADAGRAD_H, "grad_scale": 0.25}),
                   adagrad(isa, p, g * 0.25, s, 2, {**ADAGRAD_H, "grad_scale": 1.0}), "adagrad grad_scale")  # fmt: skip


# --- hyper-parameters per segment (parameter groups) --------------------------------------------------------------

LION_CHOICES = {"lr": [0.0, 1e-4, 1e-3], "beta1": [0.0, 0.9, 1.0], "beta2": [0.9, 0.99], "weight_decay": [0.0, 0.1]}
ADAGRAD_CHOICES = {"lr": [0.0, 1e-3, 1e-2], "lr_decay": [0.0, 0.5], "eps": [1e-10, 1e-3], "weight_decay": [0.0, 0.1]}


@st.composite
def groupings(draw, choices, max_n: int = 3000):
    """A buffer length, a segment table over it (boundaries anywhere or at multiples of 16; duplicate cuts make
    empty segments) and 1-4 groups' hyper-parameters, each one float for all groups or one per group."""
    n = draw(st.sampled_from([None, None, None, 70_001])) or draw(st.integers(0, max_n))
    grid = draw(st.sampled_from([1, 16]))
    count = draw(st.integers(0, 300))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    cuts = (torch.randint(0, n // grid + 1, (count,), generator=gen) * grid).sort().values.tolist()
    ends = [*cuts, n]
    ngroups = draw(st.integers(1, 4))
    group = torch.randint(0, ngroups, (len(ends),), generator=gen).tolist()
    values = {}
    for name, options in choices.items():
        per_group = draw(st.lists(st.sampled_from(options), min_size=ngroups, max_size=ngroups))
        values[name] = per_group[0] if draw(st.booleans()) else per_group
    return n, (ends, group), values


def lion_kwargs(values: dict, k: int | None) -> dict:
    """`lion_step`'s hyper-parameter arguments: per group (`k` None) or group `k`'s floats."""
    pick = (lambda v: v) if k is None else (lambda v: v[k] if isinstance(v, list) else v)
    return {"lr": pick(values["lr"]), "betas": (pick(values["beta1"]), pick(values["beta2"])),
            "weight_decay": pick(values["weight_decay"])}  # fmt: skip


def adagrad_kwargs(values: dict, k: int | None) -> dict:
    pick = (lambda v: v) if k is None else (lambda v: v[k] if isinstance(v, list) else v)
    return {name: pick(v) for name, v in values.items()}


def per_slice(kernel, isa, p, g, state, segments, values, out_dtype, **common):
    """The reference: one ungrouped call per segment, on its slice, with its group's floats."""
    native.set_isa(isa)
    p, state = p.clone(), state.clone()
    out = torch.empty(p.numel(), dtype=out_dtype) if out_dtype is not None else None
    begin = 0
    for end, k in zip(*segments, strict=True):
        part = out[begin:end] if out is not None else None
        if kernel == "lion":
            native.lion_step(p[begin:end], g[begin:end], state[begin:end], out=part, **lion_kwargs(values, k), **common)
        else:
            native.adagrad_step(p[begin:end], g[begin:end], state[begin:end], out=part, **adagrad_kwargs(values, k),
                                **common)  # fmt: skip
        begin = end
    return p, state, out


@given(kernel=st.sampled_from(["lion", "adagrad"]), data=st.data(), seed=st.integers(0, 2**16),
       grad_scale=st.sampled_from([1.0, 0.37]), gdt=st.sampled_from(DTYPES), out_dtype=st.sampled_from([None, *LOW]),
       in_place=st.booleans(), as_tensors=st.booleans())  # fmt: skip
def test_segments_equal_per_slice_calls_bitwise(kernel, data, seed, grad_scale, gdt, out_dtype, in_place, as_tensors):
    """A grouped call gives every segment bitwise what an ungrouped call on its slice with its group's values
    gives, on every path; all paths (the twin included) agree bitwise."""
    n, (ends, group), values = data.draw(groupings(LION_CHOICES if kernel == "lion" else ADAGRAD_CHOICES))
    segments = (torch.tensor(ends), torch.tensor(group)) if as_tensors else (tuple(ends), tuple(group))
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    g, s = g.to(gdt), m.square()
    results = {}
    for isa in PATHS:
        if kernel == "lion":
            got = lion(isa, p, g, m, lion_kwargs(values, None), out_dtype, in_place, grad_scale=grad_scale,
                       segments=segments)  # fmt: skip
            want = per_slice("lion", isa, p, g, m, (ends, group), values, out_dtype, grad_scale=grad_scale)
        else:
            got = adagrad(isa, p, g, s, 3, adagrad_kwargs(values, None), out_dtype, in_place, grad_scale=grad_scale,
                          segments=segments)  # fmt: skip
            want = per_slice("adagrad", isa, p, g, s, (ends, group), values, out_dtype, step=3, grad_scale=grad_scale)
        assert_bitwise(got, want, (kernel, isa, "grouped != per-slice"))
        results[isa] = got
    for isa in PATHS[1:]:
        assert_bitwise(results[isa], results[PATHS[0]], (kernel, isa, "differs from", PATHS[0]))


@pytest.mark.parametrize("isa", native.ISAS)
def test_segments_of_every_length_and_phase_across_threads(isa):
    """Segments of every length 0-40 in a shuffled order (pieces start at every phase of the vector widths and end
    in every tail), at element offsets 0-3, three groups; then segments crossing the threads' chunks above the
    streaming threshold, on 1-3 threads: equal to the scalar path's per-slice calls on one thread, bitwise."""
    if isa not in COMPILED:
        pytest.skip(f"this CPU cannot run the {isa} path (it supports {', '.join(native.supported_isas())})")
    lengths = list(range(41)) * 2
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    ends = torch.tensor([lengths[i] for i in order]).cumsum(0).tolist()
    group = [i % 3 for i in range(len(ends))]
    lv = {"lr": [1e-3, 3e-4, 0.1], "beta1": [0.9, 0.5, 1.0], "beta2": 0.99, "weight_decay": [0.1, 0.0, 0.01]}
    av = {"lr": [1e-2, 3e-3, 0.1], "lr_decay": [0.0, 0.5, 0.1], "eps": [1e-10, 1e-6, 1e-3],
          "weight_decay": [0.1, 0.0, 0.0]}  # fmt: skip
    n = ends[-1]
    gen = torch.Generator().manual_seed(2)
    for offset in range(4):
        p, g, m = (torch.randn(n + offset, generator=gen)[offset:] for _ in range(3))
        s = m.square()
        for gdt in DTYPES:
            got = lion(isa, p, g.to(gdt), m, lion_kwargs(lv, None), LOW[0], segments=(ends, group), grad_scale=0.5)
            want = per_slice("lion", "scalar", p, g.to(gdt), m, (ends, group), lv, LOW[0], grad_scale=0.5)
            assert_bitwise(got, want, ("lion", isa, offset, gdt))
            got = adagrad(isa, p, g.to(gdt), s, 2, adagrad_kwargs(av, None), LOW[1], segments=(ends, group))
            want = per_slice("adagrad", "scalar", p, g.to(gdt), s, (ends, group), av, LOW[1], step=2)
            assert_bitwise(got, want, ("adagrad", isa, offset, gdt))
    n = (1 << 20) + 37
    lengths = torch.randint(1, 5000, (400,), generator=gen) * 16
    lengths[::7] = torch.randint(1, 64, lengths[::7].shape, generator=gen)  # some unaligned boundaries
    ends = [e for e in lengths.cumsum(0).tolist() if e < n] + [n]
    group = [i % 3 for i in range(len(ends))]
    p, m = (torch.randn(n, generator=gen) for _ in range(2))
    g, s = torch.randn(n, generator=gen).to(torch.bfloat16), m.square()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want_l = per_slice("lion", "scalar", p, g, m, (ends, group), lv, torch.float16)
        want_a = per_slice("adagrad", "scalar", p, g, s, (ends, group), av, torch.float16, step=2)
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            got = lion(isa, p, g, m, lion_kwargs(lv, None), torch.float16, segments=(ends, group))
            assert_bitwise(got, want_l, ("lion", isa, k))
            got = adagrad(isa, p, g, s, 2, adagrad_kwargs(av, None), torch.float16, segments=(ends, group))
            assert_bitwise(got, want_a, ("adagrad", isa, k))
    finally:
        torch.set_num_threads(threads)


# --- argument checks ----------------------------------------------------------------------------------------------


def test_argument_errors_name_the_tensor():
    p, g, m = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    for isa in PATHS:
        native.set_isa(isa)
        for call, state in ((lambda *a, **k: native.lion_step(*a, **{"lr": 0.1, **k}), "exp_avg"),
                            (lambda *a, **k: native.adagrad_step(*a, **{"step": 1, "lr": 0.1, **k}),
                             "state_sum")):  # fmt: skip
            with pytest.raises(TypeError, match="params has dtype torch.float64, expected float32"):
                call(p.double(), g, m)
            with pytest.raises(TypeError, match="grads has dtype torch.int32"):
                call(p, g.int(), m)
            with pytest.raises(TypeError, match="params must be a torch.Tensor, got list"):
                call([0.0] * 4, g, m)
            with pytest.raises(ValueError, match=f"{state} has 3 elements, but params has 4"):
                call(p, g, m[:3])
            with pytest.raises(ValueError, match=f"{state} .* is not contiguous"):
                call(p, g, torch.zeros(8)[::2])
            with pytest.raises(TypeError, match="out has dtype torch.float32, expected bfloat16, float16"):
                call(p, g, m, out=torch.zeros(4))
            with pytest.raises(ValueError, match=f"outputs params_out and {state}_out overlap"):
                call(p, g, m, params_out=m)
            with pytest.raises(ValueError, match=f"output {state}_out overlaps input grads"):
                call(p, g, m, **{f"{state}_out": g})
            with pytest.raises(ValueError, match="segments end at 3, but params has 4 elements"):
                call(p, g, m, segments=([3], [0]))
            with pytest.raises(ValueError, match=r"lr has one value per group \(2\), but no segments were given"):
                call(p, g, m, lr=[0.1, 0.2])
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\)"):
        native.lion_step(p, g, m, lr=0.1, betas=(0.9, 0.99, 0.999))
    with pytest.raises(ValueError, match="adagrad step must be a positive integer"):
        native.adagrad_step(p, g, m, step=0, lr=0.1)
    with pytest.raises(ValueError, match=r"group\[1\] = 2 is out of range: the hyper-parameters give 2 groups"):
        native.adagrad_step(p, g, m, step=1, lr=[0.1, 0.2], segments=([2, 4], [0, 2]))


def test_the_kernels_check_the_table_itself():
    """The C entry points refuse an invalid table (-2) and a bad dtype code (-1) on their own, before writing."""
    ffi, lib = native._ffi, native._lib
    n = 64
    p, g, m = (torch.zeros(n) for _ in range(3))
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    lh = ffi.new("fz_lion_hyper[]", [native.lion_hyper(0.1, 0.9, 0.99, 0.0)] * 2)
    ah = ffi.new("fz_adagrad_hyper[]", [native.adagrad_hyper(1, 0.1, 0.0, 1e-10, 0.0)] * 2)

    def rc(ends, group, count=None, ngroups=2, g_dtype=0):
        e, k = torch.tensor(ends, dtype=torch.int64), torch.tensor(group, dtype=torch.int64)
        table = (ffi.cast("int64_t *", e.data_ptr()), ffi.cast("int64_t *", k.data_ptr()), len(ends) if count is None
                 else count, n)  # fmt: skip
        tensors = (fp(p), fp(g), g_dtype, fp(m), fp(p), fp(m), ffi.NULL, -1, 2)
        a = lib.fz_lion_step_segments(lh, ngroups, *table, *tensors)
        b = lib.fz_adagrad_step_segments(ah, ngroups, *table, *tensors)
        assert a == b
        return a

    assert rc([32, 64], [0, 1]) == 0
    assert rc([32, 32, 64], [0, 1, 1]) == 0  # an empty segment
    assert rc([40, 32, 64], [0, 1, 1]) == -2  # decreasing
    assert rc([-1, 64], [0, 1]) == -2
    assert rc([32, 63], [0, 1]) == -2 and rc([32, 65], [0, 1]) == -2  # not ending at n
    assert rc([32, 64], [0, 2]) == -2 and rc([32, 64], [-1, 0]) == -2  # group out of range
    assert rc([], [], count=0) == -2
    assert rc([32, 64], [0, 1], g_dtype=3) == -1


# --- the optimizers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", PATHS)
def test_cpu_lion_is_the_kernel(isa):
    """`cpu_lion`'s update is `lion_step` with the step's values (a schedule evaluated at the applied count), pure
    or donated alike; `grad_scale`, bfloat16 gradients and `out=` pass through; the state is `LionState`."""
    native.set_isa(isa)
    opt = cpu_lion(lr=lambda k: 1e-3 / (k + 1), betas=(0.9, 0.99), weight_decay=0.1)
    assert opt.features >= {"grad_scale", "grad_dtype", "out"}
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(300, generator=gen)
    state = opt.init(p)
    assert isinstance(state, LionState) and int(state.count) == 0 and not state.exp_avg.any()
    want_p, want_m = p.clone(), torch.zeros(300)
    for k in range(3):
        g = torch.randn(300, generator=gen).to(torch.bfloat16)
        out = torch.empty(300, dtype=torch.bfloat16)
        before = (p.clone(), state.exp_avg.clone())
        new_p, new_state = opt.update(g, state, p, grad_scale=0.5, out=out)
        assert_bitwise((p, state.exp_avg), before, "a pure update wrote its inputs")
        native.lion_step(want_p, g, want_m, lr=1e-3 / (k + 1), betas=(0.9, 0.99), weight_decay=0.1, grad_scale=0.5)
        assert_bitwise((new_p, new_state.exp_avg, out), (want_p, want_m, want_p.to(torch.bfloat16)), k)
        donated = opt.update(g, LionState(state.count, state.exp_avg.clone()), p.clone(), donate=True, grad_scale=0.5)
        assert_bitwise((donated[0], donated[1].exp_avg), (new_p, new_state.exp_avg), k)
        assert int(new_state.count) == k + 1
        p, state = new_p, new_state


@pytest.mark.parametrize("isa", PATHS)
def test_cpu_adagrad_is_the_kernel(isa):
    """`cpu_adagrad`'s update is `adagrad_step` at step `count + 1` (so `lr_decay` counts updates), pure or
    donated alike; the sum starts at `initial_accumulator_value`; the state is `AdagradState`."""
    native.set_isa(isa)
    opt = cpu_adagrad(lr=0.05, lr_decay=0.2, weight_decay=0.01, initial_accumulator_value=0.3, eps=1e-8)
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(300, generator=gen)
    state = opt.init(p)
    assert isinstance(state, AdagradState) and torch.equal(state.sum, torch.full((300,), 0.3))
    want_p, want_s = p.clone(), torch.full((300,), 0.3)
    for k in range(3):
        g = torch.randn(300, generator=gen)
        out = torch.empty(300, dtype=torch.float16)
        new_p, new_state = opt.update(g, state, p, grad_scale=0.37, out=out)
        native.adagrad_step(want_p, g, want_s, step=k + 1, lr=0.05, lr_decay=0.2, weight_decay=0.01, eps=1e-8,
                            grad_scale=0.37)  # fmt: skip
        assert_bitwise((new_p, new_state.sum, out), (want_p, want_s, want_p.to(torch.float16)), k)
        donated = opt.update(g, AdagradState(state.count, state.sum.clone()), p.clone(), donate=True, grad_scale=0.37)
        assert_bitwise((donated[0], donated[1].sum), (new_p, new_state.sum), k)
        p, state = new_p, new_state


def test_optimizers_with_groups_are_per_group_optimizers():
    """With a segment table, each segment of the update is bitwise what the ungrouped optimizer with its group's
    overrides gives on its slice."""
    ends, group = (40, 40, 100, 133), (0, 1, 1, 0)
    cases = [
        (cpu_lion(1e-3, (0.9, 0.99), 0.1), ({}, {"lr": 3e-4, "betas": (0.5, 0.9)}),
         lambda o: cpu_lion(**{"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, **o})),
        (cpu_adagrad(1e-2, 0.1, 0.01), ({"eps": 1e-3}, {"lr": 0.1, "lr_decay": 0.0, "weight_decay": 0.0}),
         lambda o: cpu_adagrad(**{"lr": 1e-2, "lr_decay": 0.1, "weight_decay": 0.01, **o})),
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for opt, overrides, single in cases:
        segments = Segments(ends, group, overrides)
        p = torch.randn(133, generator=gen)
        state = opt.init(p)
        for _ in range(2):
            g = torch.randn(133, generator=gen)
            new_p, new_state = opt.update(g, state, p, segments=segments)
            begin = 0
            for end, k in zip(ends, group, strict=True):
                one = single(overrides[k])
                part = type(state)(state.count, *(x[begin:end] for x in state[1:]))
                want_p, want_state = one.update(g[begin:end], part, p[begin:end])
                assert torch.equal(bits(new_p[begin:end]), bits(want_p)), (type(state).__name__, k, begin)
                assert torch.equal(bits(new_state[1][begin:end]), bits(want_state[1])), (type(state).__name__, k)
                begin = end
            p, state = new_p, new_state


def test_optimizer_checks():
    with pytest.raises(ValueError, match="invalid learning rate: -0.1"):
        cpu_lion(lr=-0.1)
    with pytest.raises(ValueError, match="invalid beta parameter at index 1: 1.5"):
        cpu_lion(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match=r"invalid epsilon value: 0.0 \(expected > 0"):
        cpu_adagrad(eps=0.0)  # fzero.adagrad's rule: a resharded state's padding restarts at 0
    with pytest.raises(TypeError, match="lr_decay must be a float, got a callable"):
        cpu_adagrad(lr_decay=lambda k: 0.1)
    opt = cpu_adagrad()
    assert opt.check is not None
    with pytest.raises(ValueError, match="initial_accumulator_value 0.5 differs from the optimizer's 0.0"):
        opt.check(opt.group_hypers({"initial_accumulator_value": 0.5}))
    for make in (cpu_lion, cpu_adagrad):
        with pytest.raises(ValueError, match="keeps float32 master weights in CPU memory"):
            make().init(torch.zeros(3, dtype=torch.float64))


def test_cpu_lion_agrees_with_the_torch_op_lion():
    """One step from the same state: `cpu_lion` (fused) and `fzero.lion` (each operation rounded on its own) are
    each within their own first-order rounding bound of the float64 step, so within the sum of the two of each
    other, wherever the interpolation's sign is not in doubt. `fzero.lion` rounds `c`, `m` (two products and a sum)
    and `p` (a product, then a sum):

        err_c' = 2u b1 |m| + 2u (1 - b1) |g| + u |c|   err_m' likewise   err_p' = 2u |p| decay + u lr + u |p_new|
    """
    lion_module = pytest.importorskip("fzero.optim.lion")
    h = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    gen = torch.Generator().manual_seed(8)
    p, m, g = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen) * 0.1, torch.randn(5000, generator=gen)
    mine = cpu_lion(**h).update(g, LionState(torch.tensor(3), m), p)
    theirs = lion_module.lion(**h).update(g, LionState(torch.tensor(3), m), p)
    b1, b2 = h["betas"]
    decay = 1 - h["lr"] * h["weight_decay"]
    p_ref, m_ref, c_ref = lion_reference(p, g, m, {**h, "grad_scale": 1.0})
    p64, m64, g64 = p.double(), m.double(), g.double()
    err_c = 2 * U * b1 * m64.abs() + 3 * U * (1 - b1) * g64.abs() + U * c_ref.abs()  # the larger of the two
    err_m = (2 * U * b2 * m64.abs() + 3 * U * (1 - b2) * g64.abs() + U * m_ref.abs()) * 2
    err_p = (2 * U * p64.abs() * decay + U * h["lr"] + U * p_ref.abs()) * 2
    sure = c_ref.abs() > err_c
    assert sure.float().mean() > 0.99
    assert not ((mine[1].exp_avg.double() - theirs[1].exp_avg.double()).abs() > err_m).any()
    assert not (((mine[0].double() - theirs[0].double()).abs() > err_p) & sure).any()


def test_hyper_scalars_are_rounded_once():
    """The scalars are computed in double and rounded once to float32 (as `adam_hyper`): `1 - beta`, `decay` and
    Adagrad's `clr = lr / (1 + (t - 1) lr_decay)`."""
    h = native.lion_hyper(1e-3, 0.9, 0.99, 0.1, 0.5)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    assert h == (f32(0.9), f32(1 - 0.9), f32(0.99), f32(1 - 0.99), f32(1e-3), f32(1 - 1e-3 * 0.1), 0.5)
    a = native.adagrad_hyper(4, 0.1, 0.3, 1e-10, 0.01, 2.0)
    assert a == (f32(1e-10), f32(0.1 / (1 + 3 * 0.3)), f32(0.01), 2.0)
    assert math.isclose(a.step_size, 0.1 / 1.9, rel_tol=U)

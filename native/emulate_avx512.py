"""Check the AVX-512 path on a machine without AVX-512: compile the kernels' AVX-512 source against SIMDe (portable
implementations of the intrinsics, https://github.com/simd-everywhere/simde) and compare it bitwise with the
installed extension's scalar path, over every tail length, unaligned views, every gradient / copy-out dtype, both
weight-decay modes, the streaming threshold, the gradient statistics, and the grouped step
(`fz_adam_step_segments`) against the scalar path's ungrouped calls on each segment; and the Lion and Adagrad
steps (`lion.c`, `adagrad.c`), ungrouped and grouped, the same way.

    pip install --target /tmp/simde cmeel-simde     # SIMDe's headers, from PyPI
    .venv/bin/python native/emulate_avx512.py --simde /tmp/simde/cmeel.prefix/include
    .venv/bin/python native/emulate_avx512.py --simde /tmp/simde/cmeel.prefix/include --isa avx512bf16

`--isa avx512bf16` runs the same checks on the avx512bf16 path (the bfloat16 copy-out through the VCVTNEPS2BF16
dispatch and its subnormal fix-up; the instruction itself follows its SDM definition, in C, in this build), plus
the copy-out of every kind of float32 bit pattern (subnormals, ties, NaNs, infinities) against the scalar path.

This is a development check, not part of the test suite: it validates the AVX-512 code's logic (lane order,
packing, tails, conversions), not the hardware; on an AVX-512 machine tests/test_native.py runs the real thing.
It needs an x86-64 CPU with AVX2, FMA and F16C (SIMDe then builds each 512-bit operation from two real 256-bit
ones, fused multiply-adds included). The emulated build is single-threaded.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import sys
import tempfile

import torch
from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# SIMDe builds each 512-bit operation from two real 256-bit ones where the compiler may use them; without FMA it
# would emulate a fused multiply-add as a multiply and an add (two roundings), which is not what AVX-512 does. So
# the check runs on an AVX2 + FMA + F16C machine.
NATIVE_HALVES = ["-mavx2", "-mfma", "-mf16c"]


def build(simde: str, tmp: str):
    sys.path.insert(0, HERE)
    import build as native_build  # native/build.py: the same declarations as the real extension

    ffi = FFI()
    ffi.cdef(native_build._cdef())
    ffi.set_source("_fzero_emulated", '#include "fzero_native.h"', sources=native_build.SOURCES,
                   include_dirs=[HERE, simde], define_macros=[("FZ_EMULATE_AVX512", "1")],
                   extra_compile_args=["-O1", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi",
                                       "-Wno-unused", *NATIVE_HALVES])  # fmt: skip
    path = ffi.compile(tmpdir=tmp)
    spec = importlib.util.spec_from_file_location("_fzero_emulated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simde", required=True, help="the include directory that holds simde/x86/avx512.h")
    ap.add_argument("--isa", choices=["avx512", "avx512bf16"], default="avx512", help="the path to check")
    args = ap.parse_args()
    isa = {"avx512": 2, "avx512bf16": 3}[args.isa]  # (FZ_ISA_* in fzero_native.h)
    from fzero import native

    native.set_isa("scalar")
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    with tempfile.TemporaryDirectory() as tmp:
        ffi, lib = build(args.simde, tmp)
        assert lib.fz_set_isa(isa) == 0 and lib.fz_isa() == isa, f"the emulated build must run its {args.isa} path"
        ptr = lambda t: ffi.cast("void *", t.data_ptr())  # noqa: E731
        copies = check_bf16_copy(ffi, lib, ptr, native) if args.isa == "avx512bf16" else 0
        gen = torch.Generator().manual_seed(0)
        cases = 0
        sizes = [*range(0, 80), 255, 1000, (1 << 20) + 21]
        for n in sizes:
            for offset in (0, 1, 3) if n < 100 else (0, 5):
                for gdt in codes:
                    for odt in (None, torch.bfloat16, torch.float16):
                        for decoupled in (True, False):
                            p, g, m = (torch.randn(n + offset, generator=gen)[offset:] * 3 for _ in range(3))
                            v = m.square()
                            g = g.to(gdt)
                            kw = {"step": 3, "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
                                  "decoupled": decoupled, "bias_correction": True, "grad_scale": 0.37}  # fmt: skip
                            want = [x.clone() for x in (p, m, v)]
                            w_out = torch.empty(n, dtype=odt) if odt is not None else None
                            native.adam_step(want[0], g, want[1], want[2], out=w_out, **kw)
                            got = [x.clone() for x in (p, m, v)]
                            g_out = torch.empty(n + offset, dtype=odt)[offset:] if odt is not None else None
                            h = native.adam_hyper(kw["step"], kw["lr"], *kw["betas"], kw["eps"], kw["weight_decay"],
                                                  decoupled, True, kw["grad_scale"])  # fmt: skip
                            rc = lib.fz_adam_step(ffi.new("fz_adam_hyper *", h._asdict()), n, ptr(p), ptr(g),
                                                  codes[gdt], ptr(m), ptr(v), ptr(got[0]), ptr(got[1]), ptr(got[2]),
                                                  ptr(g_out) if g_out is not None else ffi.NULL,
                                                  {None: -1, torch.bfloat16: 1, torch.float16: 2}[odt], 1)  # fmt: skip
                            assert rc == 0
                            for a, b in zip(want, got, strict=True):
                                assert torch.equal(a, b), (n, offset, gdt, odt, decoupled)
                            if odt is not None:
                                assert torch.equal(w_out.view(torch.int16), g_out.view(torch.int16)), (n, odt)
                            cases += 1
            for gdt in codes:
                x = (torch.randn(n, generator=gen) * 100).to(gdt)
                s, flag = ffi.new("double *"), ffi.new("int *")
                lib.fz_grad_stats(ptr(x), codes[gdt], n, s, flag, 1)
                want_s, want_flag = native.grad_stats(x)
                # the emulated AVX-512 sum adds in another order than the scalar path: float64 rounding only
                assert math.isclose(s[0], want_s, rel_tol=2 * max(n, 1) * 2.0**-53) and bool(flag[0]) == want_flag
        grouped = check_segments(ffi, lib, ptr, codes, native)
        others = check_lion_adagrad(ffi, lib, ptr, codes, native, sizes)
        print(
            f"{args.isa} path (emulated by SIMDe) equals the scalar path bitwise: {cases} Adam cases, "
            f"sizes 0-79, 255, 1000 and 2^20 + 21, offsets 0-5, every dtype pairing; statistics agree; "
            f"{grouped} grouped cases equal the scalar path's per-segment calls; {others} Lion and Adagrad cases "
            "(ungrouped and grouped)" + (f"; {copies} bfloat16 copies of special values" if copies else "")
        )


def check_bf16_copy(ffi, lib, ptr, native) -> int:
    """The bfloat16 copy-out of float32 values of every kind (random bit patterns of all exponents, subnormals of
    both signs alone among normal values, ties, NaNs, infinities) by an Adam step that leaves them as they are
    (lr 0, zero gradients and state), at every length 0-47 and output offsets 0-3, against the scalar path."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    bits[::3] &= 0x807FFFFF  # subnormals (and zeros), among normal values
    bits[1::7] = (bits[1::7] & 0xFFFF0000) | 0x8000  # ties
    bits[2::11] |= 0x7F800000  # infinities and NaNs
    unsigned = bits & 0xFFFFFFFF
    values = torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32).view(torch.float32)
    h = ffi.new("fz_adam_hyper *", native.adam_hyper(1, 0.0, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)._asdict())
    cases = 0
    for n in (*range(48), 4096):
        for offset in range(4):
            p = values[:n].clone()
            zero = torch.zeros(n)
            native.set_isa("scalar")
            want = torch.empty(n, dtype=torch.bfloat16)
            native.adam_step(p.clone(), zero, zero.clone(), zero.clone(), step=1, lr=0.0, out=want)
            got = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
            outs = [torch.empty(n) for _ in range(3)]  # (held here: the C call gets bare pointers)
            rc = lib.fz_adam_step(h, n, ptr(p), ptr(zero), 0, ptr(zero), ptr(zero), *map(ptr, outs), ptr(got), 1, 1)
            assert rc == 0 and torch.equal(want.view(torch.int16), got.view(torch.int16)), (n, offset)
            cases += 1
    return cases


def check_segments(ffi, lib, ptr, codes, native) -> int:
    """The emulated grouped step against the installed scalar path's ungrouped calls, one per segment: random
    tables (boundaries anywhere or at multiples of 16, empty segments, 1-4 groups with random hyper-parameters),
    segments of every length 0-40 in a shuffled order, unaligned views, every dtype pairing, both decay modes, and
    a buffer above the streaming threshold."""
    gen = torch.Generator().manual_seed(1)
    choice = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    lengths = torch.arange(41).repeat(2)
    every_length = lengths[torch.randperm(len(lengths), generator=gen)].cumsum(0).tolist()
    tables = [every_length]
    for n, grid, count in [(1000, 1, 50), (4000, 16, 200), (3001, 1, 3), ((1 << 20) + 21, 16, 300), (77, 1, 0)]:
        cuts = (torch.randint(0, n // grid + 1, (count,), generator=gen) * grid).sort().values.tolist()
        tables.append([*cuts, n])
    cases = 0
    for ends in tables:
        n = ends[-1]
        ngroups = choice([1, 2, 3, 4])
        group = torch.randint(0, ngroups, (len(ends),), generator=gen).tolist()
        hyper = [(choice([0.0, 1e-3, 0.3]), choice([0.0, 0.9]), choice([0.9, 0.999]), choice([1e-8, 1e-3]),
                  choice([0.0, 0.1])) for _ in range(ngroups)]  # fmt: skip
        for offset in (0, 3):
            for gdt in codes:
                for odt in (None, torch.bfloat16, torch.float16):
                    for decoupled in (True, False):
                        p, g, m = (torch.randn(n + offset, generator=gen)[offset:] * 3 for _ in range(3))
                        v = m.square()
                        g = g.to(gdt)
                        want = [x.clone() for x in (p, m, v)]
                        w_out = torch.empty(n, dtype=odt) if odt is not None else None
                        begin = 0
                        for end, k in zip(ends, group, strict=True):
                            lr, b1, b2, eps, wd = hyper[k]
                            native.adam_step(want[0][begin:end], g[begin:end], want[1][begin:end],
                                             want[2][begin:end], step=4, lr=lr, betas=(b1, b2), eps=eps,
                                             weight_decay=wd, decoupled=decoupled, grad_scale=0.37,
                                             out=w_out[begin:end] if odt is not None else None)  # fmt: skip
                            begin = end
                        got = [x.clone() for x in (p, m, v)]
                        g_out = torch.empty(n + offset, dtype=odt)[offset:] if odt is not None else None
                        hs = [native.adam_hyper(4, lr, b1, b2, eps, wd, decoupled, True, 0.37)._asdict()
                              for lr, b1, b2, eps, wd in hyper]  # fmt: skip
                        e, k = torch.tensor(ends, dtype=torch.int64), torch.tensor(group, dtype=torch.int64)
                        rc = lib.fz_adam_step_segments(ffi.new("fz_adam_hyper[]", hs), ngroups,
                                                       ffi.cast("int64_t *", e.data_ptr()),
                                                       ffi.cast("int64_t *", k.data_ptr()), len(ends), n, ptr(p),
                                                       ptr(g), codes[gdt], ptr(m), ptr(v), ptr(got[0]), ptr(got[1]),
                                                       ptr(got[2]), ptr(g_out) if g_out is not None else ffi.NULL,
                                                       {None: -1, torch.bfloat16: 1, torch.float16: 2}[odt],
                                                       1)  # fmt: skip
                        assert rc == 0
                        for a, b in zip(want, got, strict=True):
                            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (n, offset, gdt, odt)
                        if odt is not None:
                            assert torch.equal(w_out.view(torch.int16), g_out.view(torch.int16)), (n, odt)
                        cases += 1
    return cases


def check_lion_adagrad(ffi, lib, ptr, codes, native, sizes) -> int:
    """The emulated Lion and Adagrad steps (`lion.c`, `adagrad.c`) against the installed scalar path: every size of
    `sizes`, offsets, dtype pairing, with and without weight decay, ungrouped and with a two-group table (the
    reference: one ungrouped call per segment)."""
    gen = torch.Generator().manual_seed(2)
    low = {None: -1, torch.bfloat16: 1, torch.float16: 2}
    cases = 0
    for n in sizes:
        for offset in (0, 3) if n < 100 else (0, 5):
            for gdt in codes:
                for odt in low:
                    for wd in (0.0, 0.1):
                        p, g, m = (torch.randn(n + offset, generator=gen)[offset:] * 3 for _ in range(3))
                        g, s = g.to(gdt), m.square()
                        kernels = {
                            "lion": (m, [{"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": wd},
                                         {"lr": 0.1, "betas": (0.5, 0.9), "weight_decay": 0.0}]),
                            "adagrad": (s, [{"lr": 1e-2, "lr_decay": 0.1, "eps": 1e-10, "weight_decay": wd},
                                            {"lr": 0.1, "lr_decay": 0.0, "eps": 1e-3, "weight_decay": 0.0}]),
                        }  # fmt: skip
                        for grouped in (False, True):
                            cuts = [(0, n // 3, 1), (n // 3, n, 0)] if grouped else [(0, n, 0)]
                            for name, (state, groups) in kernels.items():
                                cases += _check_one(ffi, lib, ptr, codes, native, name, p, g, state, groups, cuts,
                                                    odt, low)  # fmt: skip
    return cases


def _check_one(ffi, lib, ptr, codes, native, name, p, g, state, groups, cuts, odt, low) -> int:
    n = p.numel()
    native.set_isa("scalar")
    want = [p.clone(), state.clone()]
    w_out = torch.empty(n, dtype=odt) if odt is not None else None
    for a, b, k in cuts:
        part = w_out[a:b] if w_out is not None else None
        step = native.lion_step if name == "lion" else functools.partial(native.adagrad_step, step=3)
        step(want[0][a:b], g[a:b], want[1][a:b], grad_scale=0.37, out=part, **groups[k])
    if name == "lion":
        hypers = [native.lion_hyper(h["lr"], *h["betas"], h["weight_decay"], 0.37) for h in groups]
    else:
        hypers = [native.adagrad_hyper(3, h["lr"], h["lr_decay"], h["eps"], h["weight_decay"], 0.37) for h in groups]
    got = [p.clone(), state.clone()]
    g_out = torch.empty(n + 3, dtype=odt)[3:] if odt is not None else None
    args = (n, ptr(p), ptr(g), codes[g.dtype], ptr(state), ptr(got[0]), ptr(got[1]),
            ptr(g_out) if g_out is not None else ffi.NULL, low[odt], 1)  # fmt: skip
    if len(cuts) == 1:
        rc = getattr(lib, f"fz_{name}_step")(ffi.new(f"fz_{name}_hyper *", hypers[0]), *args)
    else:
        ends = torch.tensor([b for _, b, _ in cuts], dtype=torch.int64)
        group = torch.tensor([k for _, _, k in cuts], dtype=torch.int64)
        rc = getattr(lib, f"fz_{name}_step_segments")(ffi.new(f"fz_{name}_hyper[]", hypers), len(hypers),
                                                      ffi.cast("int64_t *", ends.data_ptr()),
                                                      ffi.cast("int64_t *", group.data_ptr()), len(cuts),
                                                      *args)  # fmt: skip
    assert rc == 0
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (name, n, g.dtype, odt, len(cuts))
    if odt is not None:
        assert torch.equal(w_out.view(torch.int16), g_out.view(torch.int16)), (name, n, odt)
    return 1


if __name__ == "__main__":
    main()

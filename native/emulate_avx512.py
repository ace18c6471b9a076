"""Check the AVX-512 path on a machine without AVX-512: compile `adam.c`'s AVX-512 source against SIMDe (portable
implementations of the intrinsics, https://github.com/simd-everywhere/simde) and compare it bitwise with the
installed extension's scalar path, over every tail length, unaligned views, every gradient / copy-out dtype, both
weight-decay modes, the streaming threshold, and the gradient statistics.

    pip install --target /tmp/simde cmeel-simde     # SIMDe's headers, from PyPI
    .venv/bin/python native/emulate_avx512.py --simde /tmp/simde/cmeel.prefix/include

This is a development check, not part of the test suite: it validates the AVX-512 code's logic (lane order,
packing, tails, conversions), not the hardware; on an AVX-512 machine tests/test_native.py runs the real thing.
It needs an x86-64 CPU with AVX2, FMA and F16C (SIMDe then builds each 512-bit operation from two real 256-bit
ones, fused multiply-adds included). The emulated build is single-threaded.
"""

from __future__ import annotations

import argparse
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
    ffi.set_source("_fzero_emulated", '#include "fzero_native.h"', sources=[os.path.join(HERE, "adam.c")],
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
    args = ap.parse_args()
    from fzero import native

    native.set_isa("scalar")
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    with tempfile.TemporaryDirectory() as tmp:
        ffi, lib = build(args.simde, tmp)
        assert lib.fz_set_isa(2) == 0 and lib.fz_isa() == 2, "the emulated build must run its AVX-512 path"
        ptr = lambda t: ffi.cast("void *", t.data_ptr())  # noqa: E731
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
        print(
            f"AVX-512 path (emulated by SIMDe) equals the scalar path bitwise: {cases} Adam cases, "
            f"sizes 0-79, 255, 1000 and 2^20 + 21, offsets 0-5, every dtype pairing; statistics agree"
        )


if __name__ == "__main__":
    main()

"""cffi build script (API mode) for fzero's native kernels; `setup.py` hands it to setuptools (`cffi_modules`), so
`pip install` compiles `fzero.native._kernel` and nothing compiles at run time.

The extension is optional: if the compiler is missing or fails, the install still succeeds (setuptools prints
"building extension ... failed") and `fzero.native` uses its pure-torch twin, with one warning.

Portable flags only (never `-march=native`): the SIMD paths are functions with target attributes, picked at run
time, so a binary built on one x86-64 machine runs correctly on another. `-ffp-contract=off` keeps the compiler
from fusing multiply-adds on its own (the paths' bitwise agreement depends on it).

Environment knobs (build time):
  FZERO_OPENMP=0|1     build without / with OpenMP (default: with, except on macOS, whose clang lacks it)
  FZERO_NATIVE_CFLAGS  extra compiler flags, split on spaces
"""

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(__file__) or "."  # relative, as setuptools wants extension sources
HEADER = os.path.join(HERE, "fzero_native.h")
# the kernels (each file's top comment states its arithmetic) and what they share (common.c, fz_internal.h)
SOURCES = [os.path.join(HERE, f) for f in ("common.c", "adam.c", "lion.c", "adagrad.c")]
DEPENDS = [HEADER, os.path.join(HERE, "fz_internal.h")]


def _cdef() -> str:
    with open(HEADER) as f:
        text = f.read()
    decls = text.split("/* FZ_CDEF_BEGIN */")[1].split("/* FZ_CDEF_END */")[0]
    return re.sub(r"/\*.*?\*/", "", decls, flags=re.S)


def _flags() -> tuple[list[str], list[str]]:
    msvc = sys.platform == "win32"
    openmp = os.environ.get("FZERO_OPENMP", "0" if sys.platform == "darwin" else "1") != "0"
    if msvc:
        compile_args, link_args = ["/O2", "/fp:precise"], []
        if openmp:
            compile_args.append("/openmp")
    else:
        compile_args = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]
        link_args = []
        if openmp:
            compile_args.append("-fopenmp")
            link_args.append("-fopenmp")
    compile_args += os.environ.get("FZERO_NATIVE_CFLAGS", "").split()
    return compile_args, link_args


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
_compile_args, _link_args = _flags()
ffibuilder.set_source(
    "fzero.native._kernel",
    '#include "fzero_native.h"',
    sources=SOURCES,
    include_dirs=[HERE],
    depends=DEPENDS,
    extra_compile_args=_compile_args,
    extra_link_args=_link_args,
    optional=True,
)

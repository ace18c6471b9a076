"""The compiled extension `fzero.native._kernel` and the choice of the instruction-set path its kernels run.

Four paths are built into the one binary and chosen at run time from the CPU's features: `"avx512bf16"` (the
AVX-512 path with the bfloat16 copy-out by the AVX512_BF16 instruction `VCVTNEPS2BF16`), `"avx512"`, `"avx2"` and
`"scalar"`; `"torch"` is the pure-torch twin (`fzero.native.twin`), the only path where the extension is missing.
The choice is made at first use (`FZERO_ISA`, else the best the CPU supports), or by `set_isa`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import NamedTuple

__all__ = [
    "ISAS",
    "Extension",
    "available",
    "extension",
    "isa",
    "openmp",
    "parallel_threshold",
    "set_isa",
    "supported_isas",
]

try:
    from ._kernel import ffi, lib

    IMPORT_ERROR: ImportError | None = None
except ImportError as e:  # built without a compiler, or the build failed: the twin runs
    ffi = lib = None
    IMPORT_ERROR = e

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
"""The compiled paths, slowest first; each needs what the one before it needs (the C side's FZ_ISA_* codes)."""
_CODE = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}

_choice: str | None = None  # None until first use: then "torch" or one of ISAS
_warned = False


def available() -> bool:
    """Whether the compiled extension is installed (whatever path is chosen)."""
    return lib is not None


class Extension(NamedTuple):
    """The compiled extension's file and why it did not load (`extension()`)."""

    path: str | None
    """The file imported; or, when the import failed, the file the import system found (a broken build); or None
    when there is none (installed without a compiler)."""
    error: str | None
    """The import's error message; None when the extension loaded."""


def extension() -> Extension:
    """Where the compiled extension is and whether it loaded, for diagnostics (`fzero report`).

    Returns:
      `Extension(path, error)`: the loaded file and None, or (the file found or None) and the import's error.
    """
    name = f"{__package__}._kernel"
    if lib is not None:
        return Extension(getattr(sys.modules.get(name), "__file__", None), None)
    try:  # the import failed: is a file there at all (a broken build) or none (no build)?
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # (ValueError: the module is blocked in sys.modules)
        spec = None
    return Extension(spec.origin if spec is not None else None, str(IMPORT_ERROR))


def supported_isas() -> tuple[str, ...]:
    """The paths that can run on this machine: the compiled ISAs its CPU supports, then `"torch"` (always)."""
    if lib is None:
        return ("torch",)
    best = int(lib.fz_isa_detected())
    return (*ISAS[: best + 1], "torch")


def set_isa(name: str | None) -> str | None:
    """Force a path: `"scalar"`, `"avx2"`, `"avx512"`, `"avx512bf16"`, `"torch"` (the twin), or `None` / `"auto"`
    (the best this CPU supports). Overrides `FZERO_ISA`.

    Args:
      name: the path, case and surrounding blanks ignored.

    Returns:
      The path chosen before (None if none was chosen yet), so a caller can restore it.

    Raises:
      ValueError: for an unknown name, or a path this CPU (or this install) cannot run.
    """
    global _choice
    before = _choice
    _choice = _resolve(name, "set_isa")
    return before


def isa() -> str:
    """The path the kernels run: `"avx512bf16"`, `"avx512"`, `"avx2"`, `"scalar"` or `"torch"` (the twin).

    Returns:
      The path chosen, choosing it now (from `FZERO_ISA`) if none was.

    Raises:
      ValueError: `FZERO_ISA` names an unknown path, or one this CPU (or this install) cannot run.
    """
    global _choice
    if _choice is None:
        _choice = _resolve(os.environ.get("FZERO_ISA"), "FZERO_ISA")
    return _choice


def openmp() -> bool:
    """Whether the compiled kernels were built with OpenMP (False for the twin: torch threads it)."""
    return lib is not None and bool(lib.fz_openmp())


def parallel_threshold() -> int:
    """Calls on fewer elements than this run on one thread."""
    return int(lib.fz_parallel_threshold()) if lib is not None else 0


def _resolve(name: str | None, where: str) -> str:
    name = str(name or "auto").strip().lower()
    if name == "torch":
        return "torch"
    if name not in (*ISAS, "auto"):
        raise ValueError(f"{where}: unknown instruction-set path {name!r}; expected one of {', '.join(ISAS)}, "
                         "torch, auto")  # fmt: skip
    if lib is None:
        if name != "auto":
            raise ValueError(f"{where}: path {name!r} needs the compiled extension, which is not installed "
                             f"({IMPORT_ERROR}); only 'torch' can run")  # fmt: skip
        _warn_missing()
        return "torch"
    code = -1 if name == "auto" else _CODE[name]
    if lib.fz_set_isa(code) != 0:
        raise ValueError(f"{where}: this CPU cannot run the {name!r} path; it supports "
                         f"{', '.join(supported_isas())}")  # fmt: skip
    return ISAS[int(lib.fz_isa())]


def _warn_missing() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"fzero.native: the compiled CPU kernels (Adam, Lion, Adagrad) are not installed ({IMPORT_ERROR}); "
            "using their pure-torch twins, which are correct but slower. Install a C compiler and reinstall fzero "
            "(pip install --force-reinstall --no-deps .) to build them.",
            RuntimeWarning,
            stacklevel=3,
        )

"""`fzero report [--json]`: what this installation can run, for a bug report or a first look at a new machine (what
DeepSpeed's `ds_report` tells, for fzero).

    fzero report          # a table: one line per fact, each with its status
    fzero report --json   # the same facts as one JSON object

Sections: the versions (python, torch and its build, fzero, the packages fzero uses), the C kernel (is the extension
built and does it load, its paths, the one selected and why), the CPU (model, the instruction-set flags, cores,
threads), torch.distributed and CUDA, and transparent huge pages. Every line has a status:

- `OK`: works as fzero expects; `INFO`: a fact, neither good nor bad (an optional package not installed);
- `WARN`: fzero runs, but slower or with less than it could (e.g. the C kernel is not built: fzero falls back to
  its pure-torch twin with one warning, so the report warns too);
- `FAIL`: something a user needs is broken. The exit status is 1 when any line fails, else 0.

What fails: torch cannot initialise; a required package is missing; `FZERO_ISA` names an unknown path, a path this
CPU lacks, or a compiled path while the extension is missing or does not load (the user asked for the kernel, and
fzero itself refuses to run then); torch.distributed or its gloo backend is unavailable (`DistMesh` on the CPU and
every multi-process test need it). If `import torch` itself fails, `import fzero` fails before this command runs, and
Python exits with status 1 and the traceback.

The kernel's facts come from `fzero.native` (`extension`, `supported_isas`, `isa`): the report never detects the CPU's
paths itself, so it says what fzero will do, not a guess of it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["STATUSES", "Row", "collect", "exit_code", "render", "to_json"]

STATUSES = ("OK", "INFO", "WARN", "FAIL")
"""The statuses of a line, from best to worst."""

REQUIRED = ("torch", "optree", "einops", "cffi", "tqdm", "matplotlib", "safetensors")
"""fzero's dependencies when its installed metadata cannot be read (pyproject.toml's `dependencies`)."""

OPTIONAL = {
    "numpy": "checkpoints save numpy's RNG state when it is imported; tests",
    "transformers": "Hugging Face models (docs/transformers.md)",
    "peft": "LoRA adapters (docs/transformers.md)",
    "accelerate": "Accelerate and the Hugging Face Trainer on fzero (docs/integrations.md)",
    "lightning": "Lightning's FzeroStrategy (docs/integrations.md)",
    "mup": "the config's MuAdam / MuAdamW / MuSGD optimizers",
    "tensorboard": "the config's `tensorboard` monitor",
    "wandb": "the config's `wandb` monitor",
    "comet_ml": "the config's `comet` monitor",
    "deepspeed": "benchmarks/compare.py's side-by-side runs; the tests of fzero import-deepspeed and the monitors; "
    "its distribution for Accelerate's and the Trainer's DeepSpeed path (docs/integrations.md)",
    "hypothesis": "the property tests",
}
"""The optional packages fzero (or its tests and benchmarks) uses, with what for."""

CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "fma", "f16c")
"""The `/proc/cpuinfo` flags that matter to the kernel's paths and torch's CPU kernels."""

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_PROC_BIND", "KMP_AFFINITY")
"""The environment variables that change how many threads torch and the kernel run, and where."""

THP = "/sys/kernel/mm/transparent_hugepage"

VALUE_WIDTH = 22  # the text table's value column (a longer value, such as a path, pushes its note right)


@dataclass(frozen=True)
class Row:
    """One fact of the report.

    Attributes:
      name: its key within its section (an identifier: the JSON key).
      status: one of `STATUSES`.
      value: the fact, JSON-serialisable (a string, number, bool, list or None: unknown or absent).
      note: a short explanation, or what to do about a WARN / FAIL.
    """

    name: str
    status: str
    value: Any
    note: str = ""


Sections = dict[str, list[Row]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags.

    Args:
      parser: the `report` subcommand's parser.
    """
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the report, and the failing lines again on stderr.

    Args:
      args: the parsed flags (`json`).

    Returns:
      The exit status: 1 if any line is `FAIL`, else 0.
    """
    sections = collect()
    try:
        if args.json:
            print(json.dumps(to_json(sections), indent=2), flush=True)
        else:
            colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
            print(render(sections, colour=colour), flush=True)
    except BrokenPipeError:  # (`fzero report | head`: the reader left; Python's own advice, without a traceback)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    for section, rows in sections.items():
        for row in rows:
            if row.status == "FAIL":
                print(f"fzero report: FAIL {section}.{row.name}: {row.note or row.value}", file=sys.stderr)
    return exit_code(sections)


def collect() -> Sections:
    """Gather every section. A section whose gathering raises becomes one `FAIL` line naming the error, so a broken
    piece (torch that cannot initialise) is reported, not a traceback.

    Returns:
      The sections in order, each a list of rows.
    """
    collectors: dict[str, Callable[[], list[Row]]] = {
        "versions": _versions,
        "kernel": _kernel,
        "cpu": _cpu,
        "distributed": _distributed,
        "huge_pages": _huge_pages,
    }
    sections: Sections = {}
    for name, gather in collectors.items():
        try:
            sections[name] = gather()
        except Exception as e:  # (a report must survive whatever is broken, and say what it was)
            sections[name] = [Row("error", "FAIL", None, f"{type(e).__name__}: {e}")]
    return sections


def exit_code(sections: Sections) -> int:
    """The command's exit status.

    Args:
      sections: as `collect` returns.

    Returns:
      1 if any row is `FAIL`, else 0.
    """
    return int(any(row.status == "FAIL" for rows in sections.values() for row in rows))


def to_json(sections: Sections) -> dict[str, Any]:
    """The report as a JSON-serialisable object.

    Args:
      sections: as `collect` returns.

    Returns:
      `{"status": "OK" / "WARN" / "FAIL" (the worst line's; INFO counts as OK), "exit_code": ..., "sections":
      {section: {name: {"status", "value", "note"}}}}`.
    """
    worst = max((STATUSES.index(r.status) for rows in sections.values() for r in rows), default=0)
    return {
        "status": "OK" if STATUSES[worst] == "INFO" else STATUSES[worst],
        "exit_code": exit_code(sections),
        "sections": {
            section: {r.name: {"status": r.status, "value": r.value, "note": r.note} for r in rows}
            for section, rows in sections.items()
        },
    }


def render(sections: Sections, colour: bool = False) -> str:
    """The report as a table: a heading per section, one line per row (status, name, value, note).

    Args:
      sections: as `collect` returns.
      colour: colour the statuses with ANSI escapes (for a terminal).

    Returns:
      The text, without a final newline.
    """
    colours = {"OK": "\033[92m", "INFO": "", "WARN": "\033[93m", "FAIL": "\033[91m"}
    width = max((len(r.name) for rows in sections.values() for r in rows), default=0)
    rule = "-" * 100
    lines = ["fzero report", rule]
    counts = dict.fromkeys(STATUSES, 0)
    for section, rows in sections.items():
        lines.append(section.replace("_", " "))
        for r in rows:
            counts[r.status] += 1
            tag = f"[{r.status}]".ljust(6)
            if colour and colours[r.status]:
                tag = f"{colours[r.status]}{tag}\033[0m"
            lines.append(f"  {tag} {r.name.ljust(width)}  {_text(r.value).ljust(VALUE_WIDTH)}  {r.note}".rstrip())
        lines.append(rule)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    lines.append(f"{summary}; exit status {exit_code(sections)}")
    return "\n".join(lines)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "none set"
    return str(value)


def _versions() -> list[Row]:
    rows = [Row("python", "OK", platform.python_version(), sys.executable)]
    try:
        import torch

        torch.zeros(4).add_(1).sum().item()  # initialises torch's CPU allocator and kernels
    except Exception as e:  # (ImportError, or a broken build: a missing shared library, an ABI mismatch)
        rows.append(Row("torch", "FAIL", None, f"torch does not import or initialise: {type(e).__name__}: {e}"))
        return rows
    rows.append(Row("torch", "OK", torch.__version__, os.path.dirname(torch.__file__)))
    rows.append(Row("torch_build", "OK", _torch_build(torch), "the accelerator torch was built for"))
    capability = torch.backends.cpu.get_cpu_capability()
    rows.append(Row("torch_cpu_capability", "OK", capability, "the vector ISA of torch's own CPU kernels"))
    from .._version import __version__

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (fzero/, this file's grandparent)
    rows.append(Row("fzero", "OK", __version__, package))
    required = [n for n in _required() if n != "torch"]  # (torch: above, imported and initialised)
    for name in [*required, *(n for n in OPTIONAL if n not in required)]:
        try:
            version: str | None = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        if name in required:
            rows.append(Row(name, "OK" if version else "FAIL", version or "not installed", "required"))
        else:
            rows.append(
                Row(name, "OK" if version else "INFO", version or "not installed", f"optional: {OPTIONAL[name]}")
            )
    return rows


def _torch_build(torch: Any) -> str:
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}"
    return "CPU"


def _required() -> list[str]:
    """fzero's required packages, from its installed metadata (entries without an `extra` marker)."""
    try:
        requires = importlib.metadata.requires("fzero") or []
    except importlib.metadata.PackageNotFoundError:  # (running from a source tree that was never installed)
        return list(REQUIRED)
    names = [re.match(r"[A-Za-z0-9._-]+", r) for r in requires if "extra ==" not in r]
    return [m.group(0) for m in names if m] or list(REQUIRED)


def _kernel() -> list[Row]:
    from .. import native

    ext = native.extension()
    forced = os.environ.get("FZERO_ISA", "").strip()
    wants_compiled = forced.lower() in native.ISAS  # the user asked for the C kernel by name
    rows = []
    if ext.error is None:
        rows.append(Row("extension", "OK", ext.path, "built and loads"))
    else:
        what = f"built but does not load ({ext.error})" if ext.path else f"not built ({ext.error})"
        status = "FAIL" if wants_compiled else "WARN"
        advice = "fzero runs its pure-torch twin, correct but slower; install a C compiler and reinstall fzero"
        rows.append(Row("extension", status, ext.path, f"{what}; {advice}"))
    rows.append(Row("compiled_paths", "INFO", list(native.ISAS) if ext.error is None else [], "in the binary"))
    supported = [p for p in native.supported_isas() if p != "torch"]
    if ext.error is None:
        rows.append(Row("cpu_paths", "OK", supported, "the compiled paths this CPU (and its OS) can run"))
    else:
        rows.append(Row("cpu_paths", "INFO", None, "detected by the extension, which is missing"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fzero's fallback warning: the extension line above says the same)
        try:
            selected: str | None = native.isa()
        except ValueError as e:  # FZERO_ISA names an unknown path, or one this CPU or install cannot run
            rows.append(Row("selected", "FAIL", None, str(e)))
            selected = None
    if selected is not None:
        rows.append(_selected(selected, forced, supported))
    openmp = native.openmp()
    if ext.error is None:
        note = "the kernels run on torch.get_num_threads() threads" if openmp else "built without OpenMP: one thread"
        rows.append(Row("openmp", "OK" if openmp else "WARN", openmp, note))
        rows.append(Row("parallel_threshold", "INFO", native.parallel_threshold(), "elements; fewer run on one thread"))
    return rows


def _selected(selected: str, forced: str, supported: list[str]) -> Row:
    """The row of the path `fzero.native.isa()` chose, and why."""
    if forced and forced.lower() != "auto":
        return Row("selected", "OK", selected, f"forced by FZERO_ISA={forced}")
    if selected == "torch":
        return Row("selected", "WARN", selected, "the pure-torch twin: the extension is missing")
    why = "detected: the best path this CPU supports" + (" (FZERO_ISA=auto)" if forced else "")
    if selected == "scalar":  # (docs/native.md: the portable build calls fmaf through the PLT)
        return Row("selected", "WARN", selected, f"{why}; no AVX2: fzero.adamw (torch ops) is faster than cpu_adamw")
    return Row("selected", "OK", selected, why)


def _cpu() -> list[Row]:
    import torch

    model, flags = _cpuinfo()
    rows = [Row("model", "INFO", model or platform.processor() or platform.machine(), platform.machine())]
    if flags is None:
        rows.append(Row("flags", "INFO", None, "/proc/cpuinfo is not readable here"))
    else:
        missing = [f for f in CPU_FLAGS if f not in flags]
        rows.append(Row("flags", "OK", [f for f in CPU_FLAGS if f in flags], f"lacks {', '.join(missing)}" if missing
                        else "every flag the kernel's paths can use"))  # fmt: skip
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    rows.append(Row("cores", "INFO", cores, "os.cpu_count()"))
    rows.append(Row("usable_cores", "INFO", usable, "this process's CPU affinity"))
    threads = torch.get_num_threads()
    over = usable is not None and threads > usable
    note = f"more threads than the {usable} usable cores: set OMP_NUM_THREADS" if over else "torch.get_num_threads()"
    rows.append(Row("torch_threads", "WARN" if over else "OK", threads, note))
    rows.append(Row("interop_threads", "INFO", torch.get_num_interop_threads(), "torch.get_num_interop_threads()"))
    backends = {"openmp": torch.backends.openmp.is_available(), "mkl": torch.backends.mkl.is_available()}
    rows.append(Row("torch_parallel", "INFO", backends, "torch's build"))
    env = {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ}
    rows.append(Row("thread_variables", "INFO", env, ", ".join(THREAD_VARIABLES)))
    return rows


def _cpuinfo() -> tuple[str | None, set[str] | None]:
    """The first processor's model name and flags from `/proc/cpuinfo`; None for what it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:  # (not Linux)
        return None, None
    model = re.search(r"^model name\s*:\s*(.*)$", text, flags=re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, flags=re.M)  # (Features: ARM's name)
    return (model.group(1).strip() if model else None), (set(flags.group(1).split()) if flags else None)


def _distributed() -> list[Row]:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return [Row("torch_distributed", "FAIL", False, "this torch was built without torch.distributed")]
    cuda = torch.cuda.is_available()
    rows = [
        Row("torch_distributed", "OK", True, "DistMesh and fzero train --nproc need it"),
        Row("gloo", "OK" if dist.is_gloo_available() else "FAIL", dist.is_gloo_available(), "the CPU backend"),
    ]
    nccl = dist.is_nccl_available()
    rows.append(Row("nccl", "WARN" if cuda and not nccl else "OK" if nccl else "INFO", nccl, "the GPU backend"))
    rows.append(Row("mpi", "INFO", dist.is_mpi_available(), "not used by fzero"))
    if not torch.version.cuda:
        rows.append(Row("cuda", "INFO", cuda, f"torch is a {_torch_build(torch)} build"))
        return rows
    if not cuda:
        rows.append(Row("cuda", "WARN", False, f"torch is a CUDA {torch.version.cuda} build but sees no GPU"))
        return rows
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows.append(Row("cuda", "OK", True, f"CUDA {torch.version.cuda}"))
    rows.append(Row("cuda_devices", "OK", names, f"{len(names)} visible"))
    if nccl:
        version = torch.cuda.nccl.version()
        text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        rows.append(Row("nccl_version", "OK", text, "the NCCL torch was built with"))
    return rows


def _huge_pages() -> list[Row]:
    from ..host.hostmem import VARIABLE, huge_pages_requested

    requested = huge_pages_requested()
    enabled, defrag = _thp_setting("enabled"), _thp_setting("defrag")
    rows = []
    if enabled is None:
        rows.append(Row("thp_enabled", "INFO", None, f"{THP}/enabled is not readable (not Linux?)"))
    elif enabled == "never":
        note = (
            f"the kernel allows no huge pages: neither torch's ({VARIABLE}=1) nor those fzero asks for its own "
            "large step buffers (stage 3 then faults them in on 4 KiB pages every step)"
        )
        rows.append(Row("thp_enabled", "WARN" if requested else "INFO", enabled, note))
    else:
        note = (
            f"fzero's own large step buffers ask for huge pages (stage 3's page faults a step 19.5k -> 2.2k, "
            f"docs/performance.md); {VARIABLE}=1 can put torch's large CPU blocks on them too"
        )
        rows.append(Row("thp_enabled", "OK", enabled, note))
    rows.append(Row("thp_defrag", "INFO", defrag, "how hard the kernel works to find a huge page on a fault"))
    value = os.environ.get(VARIABLE)
    note = ("torch's CPU allocator asks for huge pages (blocks of 2 MiB or more)" if requested else
            "off by default (speed needs no setting), yet it still pays: with freed memory kept too "
            "(fzero.hostmem.enable_huge_pages() before the first tensor, then retain_freed_memory(); fzero train "
            "makes both) fzero's steps ran 1.11-1.19x faster, DDP's 1.07-1.13x (benchmarks/compare.py --tuned, "
            "2-core AVX2 EPYC, 2026-11-28; README, docs/performance.md)")  # fmt: skip
    rows.append(Row(VARIABLE, "OK" if requested else "INFO", value, note))
    return rows


def _thp_setting(name: str) -> str | None:
    """The selected value (the one in brackets) of `/sys/kernel/mm/transparent_hugepage/<name>`."""
    try:
        with open(f"{THP}/{name}") as f:
            text = f.read()
    except OSError:
        return None
    chosen = re.search(r"\[([^\]]+)\]", text)
    return chosen.group(1) if chosen else text.strip()

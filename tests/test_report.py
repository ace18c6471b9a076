"""`fzero report` (fzero/commands/report.py): the real command, in fresh interpreters, on this machine.

Its facts are checked against what this process finds itself (torch's version, `fzero.native`'s selected path, the
CPU's cores, /proc/cpuinfo, /sys); then with the compiled kernel really absent (a copy of the package without
`_kernel*.so`, first on `PYTHONPATH`) and really broken (a file there that is not a shared library), and with
`FZERO_ISA` forcing each path this machine can run, an unknown one, and a compiled one without the extension.

The interpreters start together (a few at a time) in one module fixture: each costs ~2 s of `import fzero`, so one
after the other they would take most of a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fzero import native
from fzero.commands.report import Row, exit_code, render, to_json

ROOT = Path(__file__).resolve().parent.parent
COMPILED = [p for p in native.supported_isas() if p != "torch"]
LACKING = [p for p in native.ISAS if p not in COMPILED]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without `FZERO_ISA` (scripts/isa-matrix sets it) and `PYTHONPATH`, plus `extra`."""
    base = {k: v for k, v in os.environ.items() if k not in ("FZERO_ISA", "PYTHONPATH")}
    return {**base, **extra}


def _copy_package(where: Path, kernel: bytes | None) -> Path:
    """A copy of the fzero package under `where` without the compiled kernel, or with `kernel` as its file."""
    shutil.copytree(ROOT / "fzero", where / "fzero", ignore=shutil.ignore_patterns("_kernel*", "__pycache__"))
    if kernel is not None:
        (where / "fzero" / "native" / "_kernel.abi3.so").write_bytes(kernel)
    return where


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every run of the command these tests read, by name, started together."""
    missing = _copy_package(tmp_path_factory.mktemp("missing"), None)
    broken = _copy_package(tmp_path_factory.mktemp("broken"), b"not a shared library\n")
    # (the copies run from their own directory: from ROOT, `-m` would import ROOT/fzero first)
    plans: dict[str, tuple[list[str], dict[str, str], Path]] = {
        "text": ([], dict(os.environ), ROOT),  # as this process runs, FZERO_ISA included if set
        "json": (["--json"], dict(os.environ), ROOT),
        "unknown": (["--json"], _env(FZERO_ISA="fast"), ROOT),
        "missing": (["--json"], _env(PYTHONPATH=str(missing)), missing),
        "missing_forced": ([], _env(PYTHONPATH=str(missing), FZERO_ISA=native.ISAS[0]), missing),  # (the table)
        "broken": (["--json"], _env(PYTHONPATH=str(broken)), broken),
    }
    for path in [*native.ISAS, "torch"]:
        plans[f"forced_{path}"] = (["--json"], _env(FZERO_ISA=path), ROOT)

    def run(plan: tuple[list[str], dict[str, str], Path]) -> subprocess.CompletedProcess:
        flags, env, cwd = plan
        cmd = [sys.executable, "-m", "fzero.cli", "report", *flags]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(plans, pool.map(run, plans.values()), strict=True))


def _json(r: subprocess.CompletedProcess) -> dict[str, Any]:
    return json.loads(r.stdout)


def _row(report: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    return report["sections"][section][name]


def test_text_report_on_this_machine(runs):
    r = runs["text"]
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "fzero report"
    headings = [line for line in lines if line and not line.startswith((" ", "-")) and line != "fzero report"]
    assert headings[:5] == ["versions", "kernel", "cpu", "distributed", "huge pages"]
    assert re.search(rf"^  \[OK\] +torch +{re.escape(torch.__version__)} ", r.stdout, flags=re.M)
    assert re.search(rf"^  \[OK\] +selected +{native.isa()} ", r.stdout, flags=re.M)
    assert re.search(r"^  \[OK\] +gloo +yes ", r.stdout, flags=re.M)
    assert "[FAIL]" not in r.stdout and r.stderr == ""
    assert re.fullmatch(r"\d+ OK, \d+ INFO, \d+ WARN, 0 FAIL; exit status 0", lines[-1])
    # every status line is one of the four, and the JSON run gives the same lines
    rows = [line for line in lines if line.startswith("  [")]
    assert all(re.match(r"  \[(OK|INFO|WARN|FAIL)\] +\S", line) for line in rows)
    report = _json(runs["json"])
    names = [(s, n) for s, section in report["sections"].items() for n in section]
    assert len(rows) == len(names)
    for line, (section, name) in zip(rows, names, strict=True):
        assert line.split()[:2] == [f"[{report['sections'][section][name]['status']}]", name]


def test_json_report_states_this_machines_facts(runs):
    r = runs["json"]
    assert r.returncode == 0, r.stderr
    report = _json(r)
    assert report["exit_code"] == 0 and report["status"] in ("OK", "WARN")
    assert _row(report, "versions", "torch")["value"] == torch.__version__
    if not torch.version.cuda and not torch.version.hip:
        assert _row(report, "versions", "torch_build")["value"] == "CPU"
    assert _row(report, "versions", "torch_cpu_capability")["value"] == torch.backends.cpu.get_cpu_capability()
    assert _row(report, "versions", "fzero")["value"] == importlib.metadata.version("fzero")
    assert _row(report, "versions", "fzero")["note"] == str(ROOT / "fzero")
    for name in ("optree", "cffi", "safetensors", "numpy", "hypothesis", "wandb", "deepspeed"):
        try:
            want = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            want = "not installed"
        assert _row(report, "versions", name)["value"] == want

    # the kernel: what fzero.native says in this process (the same environment, FZERO_ISA included)
    kernel = report["sections"]["kernel"]
    assert kernel["extension"]["value"] == native.extension().path and kernel["extension"]["status"] == "OK"
    assert kernel["cpu_paths"]["value"] == COMPILED
    assert kernel["selected"]["value"] == native.isa() and kernel["selected"]["status"] in ("OK", "WARN")
    assert kernel["openmp"]["value"] == native.openmp()

    cpu = report["sections"]["cpu"]
    assert cpu["cores"]["value"] == os.cpu_count()
    assert cpu["usable_cores"]["value"] == len(os.sched_getaffinity(0))
    # torch's default in a fresh process (tests/conftest.py lowers this one's to 2)
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True, env=dict(os.environ))  # fmt: skip
    assert cpu["torch_threads"]["value"] == int(fresh.stdout)
    if os.path.exists("/proc/cpuinfo"):
        flags_line = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), flags=re.M)
        assert flags_line is not None
        for flag in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "fma", "f16c"):
            assert (flag in cpu["flags"]["value"]) == (flag in flags_line.group(1).split())

    net = report["sections"]["distributed"]
    assert net["gloo"] == {"status": "OK", "value": dist.is_gloo_available(), "note": "the CPU backend"}
    assert net["nccl"]["value"] == dist.is_nccl_available() and net["mpi"]["value"] == dist.is_mpi_available()
    assert net["cuda"]["value"] == torch.cuda.is_available()

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{_row(report, 'huge_pages', 'thp_enabled')['value']}]" in thp.read_text()
    assert _row(report, "huge_pages", "THP_MEM_ALLOC_ENABLE")["value"] == os.environ.get("THP_MEM_ALLOC_ENABLE")


@pytest.mark.parametrize("path", [*native.ISAS, "torch"])
def test_forcing_a_path(runs, path):
    """Each path this machine runs is selected when forced, exit 0; a compiled path the CPU lacks fails, exit 1."""
    r = runs[f"forced_{path}"]
    selected = _row(_json(r), "kernel", "selected")
    if path in LACKING:
        assert r.returncode == 1 and selected["status"] == "FAIL"
        assert f"FZERO_ISA: this CPU cannot run the '{path}' path" in r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert selected == {"status": "OK", "value": path, "note": f"forced by FZERO_ISA={path}"}


def test_an_unknown_path_fails_naming_the_variable(runs):
    r = runs["unknown"]
    assert r.returncode == 1
    message = ("FZERO_ISA: unknown instruction-set path 'fast'; expected one of scalar, avx2, avx512, avx512bf16, "
               "torch, auto")  # fmt: skip
    assert _row(_json(r), "kernel", "selected") == {"status": "FAIL", "value": None, "note": message}
    assert f"fzero report: FAIL kernel.selected: {message}" in r.stderr
    assert _json(r)["exit_code"] == 1 and _json(r)["status"] == "FAIL"


def test_without_the_compiled_kernel_it_warns(runs, tmp_path):
    """fzero falls back to its pure-torch twin on its own, so a missing kernel is a WARN and exit 0."""
    r = runs["missing"]
    assert r.returncode == 0, r.stderr
    report = _json(r)
    assert _row(report, "versions", "fzero")["note"].endswith(os.path.join("missing0", "fzero"))  # the copy ran
    kernel = report["sections"]["kernel"]
    assert kernel["extension"]["status"] == "WARN" and kernel["extension"]["value"] is None
    assert kernel["extension"]["note"].startswith("not built (No module named 'fzero.native._kernel')")
    assert kernel["compiled_paths"]["value"] == [] and kernel["cpu_paths"]["value"] is None
    assert kernel["selected"] == {"status": "WARN", "value": "torch",
                                  "note": "the pure-torch twin: the extension is missing"}  # fmt: skip
    assert report["status"] == "WARN" and r.stderr == ""  # (fzero's fallback warning is the extension line)


def test_without_the_kernel_a_forced_compiled_path_fails(runs):
    r = runs["missing_forced"]
    assert r.returncode == 1
    assert re.search(r"^  \[FAIL\] extension +- +not built \(No module named", r.stdout, flags=re.M)
    message = f"FZERO_ISA: path '{native.ISAS[0]}' needs the compiled extension, which is not installed"
    assert re.search(rf"^  \[FAIL\] selected +- +{re.escape(message)}", r.stdout, flags=re.M)
    assert r.stdout.endswith(" 2 FAIL; exit status 1\n")
    assert f"fzero report: FAIL kernel.selected: {message}" in r.stderr


def test_a_broken_kernel_file_is_named(runs):
    """A file that does not load (a broken build) is reported with its path and the loader's error."""
    r = runs["broken"]
    assert r.returncode == 0, r.stderr
    extension = _row(_json(r), "kernel", "extension")
    assert extension["status"] == "WARN"
    assert extension["value"].endswith(os.path.join("broken0", "fzero", "native", "_kernel.abi3.so"))
    assert extension["note"].startswith("built but does not load (") and "_kernel.abi3.so" in extension["note"]
    assert _row(_json(r), "kernel", "selected")["value"] == "torch"


def test_render_and_exit_code():
    sections = {"a": [Row("x", "OK", True), Row("long_name", "WARN", ["p", "q"], "why")], "b": [Row("y", "FAIL", None)]}
    assert exit_code(sections) == 1 and exit_code({"a": sections["a"]}) == 0
    assert render(sections).splitlines()[2:4] == ["a", "  [OK]   x          yes"]
    assert "  [WARN] long_name  p, q" + " " * 18 + "  why" in render(sections)
    assert render(sections).endswith("1 OK, 0 INFO, 1 WARN, 1 FAIL; exit status 1")
    assert to_json(sections)["status"] == "FAIL" and to_json(sections)["sections"]["b"]["y"]["value"] is None

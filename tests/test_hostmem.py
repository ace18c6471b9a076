"""Huge pages for large host buffers are asked for explicitly (`fzero.hostmem.enable_huge_pages`), before the
process's first CPU tensor; `import fzero` leaves the environment alone."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or not pathlib.Path("/proc/self/smaps").exists(),
                               reason="a kernel without transparent huge pages")  # fmt: skip

# Run SETUP, then allocate a 109 MB buffer as a step allocates its large buffers, and print the flags of the
# mapping that holds it: "hg" is the kernel's record that the mapping was advised MADV_HUGEPAGE (torch's allocator
# does so under THP_MEM_ALLOC_ENABLE=1). Whether the kernel then finds free 2 MiB pages depends on the machine
# (fragmentation, other processes), so the tests check the advice, which is fzero's to give; benchmarks count the
# page faults.
PROBE = """
import fzero, torch
{setup}
x = torch.empty(27_300_000)
x.fill_(1.0)
addr, inside = x.data_ptr(), False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= addr < hi
    elif inside and head == "VmFlags:":
        print(line.split()[1:])
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose environment is ours without THP_MEM_ALLOC_ENABLE, plus `env`."""
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)


def advised(setup: str = "", **env: str) -> bool:
    """Whether a large buffer's mapping carries the huge-page advice, in a fresh process with `env` after `setup`."""
    return "'hg'" in _run(PROBE.format(setup=setup), **env).stdout


def test_import_leaves_the_environment_alone():
    _run("import os; before = dict(os.environ); import fzero; assert dict(os.environ) == before")


@needs_thp
def test_import_alone_asks_for_no_huge_pages():
    assert not advised()


@needs_thp
def test_large_buffers_are_advised_onto_huge_pages_when_asked():
    assert advised("assert fzero.hostmem.enable_huge_pages()")


@needs_thp
def test_the_environment_asks_without_a_call():
    assert advised(THP_MEM_ALLOC_ENABLE="1")


@needs_thp
def test_the_user_can_opt_out():
    assert not advised("assert not fzero.hostmem.enable_huge_pages()", THP_MEM_ALLOC_ENABLE="0")


@needs_thp
def test_too_late_after_the_first_cpu_tensor():
    """torch reads the variable once, at its first CPU allocation of any size: the documented timing."""
    assert not advised("torch.zeros(4)\nfzero.hostmem.enable_huge_pages()")

"""`import fzero` puts large host buffers on transparent huge pages (fzero.hostmem), unless the user opts out."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Allocate a 109 MB buffer as a step allocates its large buffers, and print the flags of the mapping that holds it:
# "hg" is the kernel's record that the mapping was advised MADV_HUGEPAGE (torch's allocator does so under
# THP_MEM_ALLOC_ENABLE=1). Whether the kernel then finds free 2 MiB pages depends on the machine (fragmentation,
# other processes), so the tests check the advice, which is fzero's to give; benchmarks count the page faults.
PROBE = """
import fzero, torch
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


def advised(**env: str) -> bool:
    """Whether a large buffer's mapping carries the huge-page advice, in a fresh process with `env`."""
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True)
    return "'hg'" in out.stdout


@pytest.mark.skipif(not THP.exists() or not pathlib.Path("/proc/self/smaps").exists(),
                    reason="a kernel without transparent huge pages")  # fmt: skip
def test_large_buffers_are_advised_onto_huge_pages():
    assert advised()


@pytest.mark.skipif(not THP.exists() or not pathlib.Path("/proc/self/smaps").exists(),
                    reason="a kernel without transparent huge pages")  # fmt: skip
def test_the_user_can_opt_out():
    assert not advised(THP_MEM_ALLOC_ENABLE="0")

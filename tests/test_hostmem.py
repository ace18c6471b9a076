"""`import fzero` puts large host buffers on transparent huge pages (fzero.hostmem), unless the user opts out."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Allocate and fill a fresh 109 MB buffer five times, as a step allocates its large buffers, and count the page faults
# per buffer: ~26,700 on 4 KiB pages, ~100 on 2 MiB pages.
PROBE = """
import resource, sys
import fzero, torch
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    x = torch.empty(27_300_000)
    x.fill_(1.0)
    del x
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 5)
"""
PAGES = 27_300_000 * 4 // 4096


def faults_per_buffer(**env: str) -> float:
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    out = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


MODE = THP.read_text() if THP.exists() else "[never]"


@pytest.mark.skipif("[never]" in MODE, reason="the kernel offers no huge pages")
def test_large_buffers_fault_in_on_huge_pages():
    # each 2 MiB page faults once (~100 per buffer); a quarter of the 4 KiB count leaves room for a kernel that
    # cannot find every huge page on a fragmented machine
    assert faults_per_buffer() < PAGES / 4


@pytest.mark.skipif("[madvise]" not in MODE, reason="huge pages follow torch's madvise only in madvise mode")
def test_the_user_can_opt_out():
    assert faults_per_buffer(THP_MEM_ALLOC_ENABLE="0") > PAGES / 2  # every 4 KiB page faults in

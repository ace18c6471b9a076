"""Huge pages for large host buffers are asked for explicitly (`fzero.hostmem.enable_huge_pages`), before the
process's first CPU tensor; `import fzero` leaves the environment alone."""

from __future__ import annotations

import os
import pathlib
import platform
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
    """`code` in a fresh interpreter whose environment is ours without THP_MEM_ALLOC_ENABLE and glibc's malloc
    settings (`MALLOC_*`, `GLIBC_TUNABLES`), plus `env`."""
    mine = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")
    environ = {k: v for k, v in os.environ.items() if k not in mine and not k.startswith("MALLOC_")} | env
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


# A "step" fills a fresh 64 MiB buffer; print each of 12 steps' page faults. By default glibc maps a block that large
# anew every time (its dynamic threshold stops at 32 MiB) and the kernel faults every page in again (at least 32 a
# step on huge pages, 16,384 on 4 KiB ones). A heap that keeps freed memory serves the steps from pages already
# mapped once it holds the steps' own blocks: torch's aligned allocation needs a little more than the block freed, so
# the heap grows one second block at step 2 or 3 (which, depends on its layout), and the steps alternate between the
# two from then on. Then free a 256 MiB buffer and print how much of it `release_freed_memory` hands back (resident
# MiB before minus after).
LINUX = pathlib.Path("/proc/self/statm").exists()
needs_glibc = pytest.mark.skipif(not LINUX or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's malloc on Linux")  # fmt: skip
FAULTS = """
import resource, torch, fzero
torch.set_num_threads(1)
print({setup})

def faults_of_a_fresh_buffer():
    x = torch.empty(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20

print(",".join(str(faults_of_a_fresh_buffer()) for _ in range(12)))
torch.empty(64 << 20).fill_(1.0)
before = resident_mib()
fzero.hostmem.release_freed_memory()
print(before - resident_mib())
"""


def _faults(setup: str, **env: str) -> tuple[str, list[int], float]:
    """(what `setup` printed, each step's page faults, MiB released) in a fresh process with `env` (`_run`)."""
    out = _run(FAULTS.format(setup=setup), **env).stdout.split()
    return out[0], [int(f) for f in out[1].split(",")], float(out[2])


@needs_glibc
def test_freed_memory_is_mapped_afresh_by_default():
    """The control: what `retain_freed_memory` removes is there to remove (the test below can fail)."""
    _, faults, _ = _faults("None")
    assert min(faults) >= 32


@needs_glibc
def test_retained_memory_serves_the_next_buffer_without_faults():
    took, faults, released = _faults("fzero.hostmem.retain_freed_memory()")
    assert took == "True"
    # after the first step, one more block at most (the heap's second); every other step faults a page or two at
    # most (Python's or glibc's own bookkeeping)
    assert sum(f > 8 for f in faults[1:]) <= 1, faults
    assert released >= 128  # the freed 256 MiB stayed until released


@needs_glibc
def test_the_environments_own_malloc_settings_win():
    took, faults, _ = _faults("fzero.hostmem.retain_freed_memory()", MALLOC_TRIM_THRESHOLD_="131072")
    assert took == "False"
    assert min(faults) >= 32
    took, _, _ = _faults("fzero.hostmem.retain_freed_memory()", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert took == "False"

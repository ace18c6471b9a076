"""This process's memory as /proc/self/status reports it, and a thread that keeps RssAnon's peak: what the memory
benchmarks (offload.py, bigger_than_memory.py, stage3_memory.py) read. Imports nothing beyond the standard library,
so a benchmark can measure its start before importing torch or fzero."""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["PeakRss", "proc_status", "rss_anon"]


def proc_status(key: str) -> int:
    """A field of /proc/self/status given in kB (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (RssAnon of /proc/self/status)."""
    return proc_status("RssAnon")


class PeakRss:
    """The peak RssAnon: sampled every `interval` seconds by a thread, and on every `sample()`. With a `cap` (bytes),
    a sample above it ends the process at once (exit 3) with a message: a memory-capped run that checks itself."""

    def __init__(self, interval: float = 0.005, cap: int | None = None) -> None:
        self.cap = cap
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def sample(self) -> int:
        """RssAnon now (bytes), taken into the peak."""
        now = rss_anon()
        self.peak = max(self.peak, now)
        if self.cap is not None and now > self.cap:
            print(f"RssAnon {now / 2**20:.0f} MiB over the cap {self.cap / 2**20:.0f} MiB", file=sys.stderr)
            os._exit(3)
        return now

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak

"""DeepSpeed's CPU accelerator, `deepspeed.accelerator.cpu_accelerator.CPU_Accelerator`, with its answers.

The CPU has no device memory: as DeepSpeed's, the "allocated" memory is the process's resident set size and its
peak the largest size read since the last reset; the total and available memory are the host's. DeepSpeed reads
them with psutil, which on Linux reads `/proc/self/statm` and `/proc/meminfo`: so does this module, the same numbers
without the dependency. Streams, events and graphs do not exist on the CPU (None, and a `with` block that does
nothing), as in DeepSpeed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from .abstract_accelerator import DeepSpeedAccelerator, _NoopContext

__all__ = ["CPU_Accelerator", "available_memory", "resident_memory", "total_memory"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LEGACY = {
    torch.bfloat16: torch.BFloat16Tensor,
    torch.uint8: torch.ByteTensor,
    torch.double: torch.DoubleTensor,
    torch.float: torch.FloatTensor,
    torch.half: torch.HalfTensor,
    torch.int: torch.IntTensor,
    torch.long: torch.LongTensor,
}


def resident_memory() -> int:
    """This process's resident set size in bytes (psutil's `Process().memory_info().rss`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key} line")


def total_memory() -> int:
    """The host's memory in bytes (psutil's `virtual_memory().total`)."""
    return _meminfo("MemTotal")


def available_memory() -> int:
    """The host's available memory in bytes (psutil's `virtual_memory().available`: the kernel's MemAvailable)."""
    return _meminfo("MemAvailable")


def _numa_nodes() -> int:
    """DeepSpeed's CPU device count without `LOCAL_SIZE`: the NUMA nodes `numactl --hardware` lists with cores (a
    node whose core list repeats the one before it counted once), 1 where numactl is missing or fails."""
    if shutil.which("numactl") is None:
        return 1
    try:
        lines = subprocess.check_output(["numactl", "--hardware"], text=True).split("\n")
    except (OSError, subprocess.SubprocessError):
        return 1
    cores = [line.split(" ")[3:] for line in lines if line.startswith("node ") and " cpus:" in line]
    count, previous = 0, None
    for listed in cores:
        if listed and listed != previous:
            count += 1
            previous = listed
    return count or 1


class CPU_Accelerator(DeepSpeedAccelerator):
    """DeepSpeed's CPU accelerator: device "cpu", backend gloo, memory from the process's resident set size."""

    def __init__(self) -> None:
        self._name = "cpu"
        self._communication_backend_name = "gloo"  # (DeepSpeed's "ccl" needs Intel's oneCCL bindings)
        self.max_mem = resident_memory()

    def is_synchronized_device(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------------- devices
    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> None:
        return None

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> Any:
        # DeepSpeed's answer, kept as is: the LOCAL_RANK string when the launcher set it, else the int 0
        return os.environ.get("LOCAL_RANK", 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """`LOCAL_SIZE` if set and positive, else the NUMA nodes with cores (as DeepSpeed counts them)."""
        local = int(os.environ.get("LOCAL_SIZE", 0))
        return local if local > 0 else _numa_nodes()

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return str(tensor.device).startswith("cpu")

    # ----------------------------------------------------------------------------------------------- rng
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # ------------------------------------------------------------------------------ streams, events, graphs
    @property
    def Stream(self) -> None:
        return None

    @property
    def Event(self) -> None:
        return None

    def stream(self, stream: Any) -> _NoopContext:
        return _NoopContext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> _NoopContext:
        return _NoopContext()

    def replay_graph(self, graph: Any) -> None:
        return None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    # -------------------------------------------------------------------------------------------- memory
    def get_rss(self) -> int:
        """The resident set size now; raises the recorded peak if above it."""
        mem = resident_memory()
        self.max_mem = max(self.max_mem, mem)
        return mem

    def reset_rss(self) -> int:
        """Restart the peak at the resident set size now, and return it."""
        self.max_mem = resident_memory()
        return self.max_mem

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self.get_rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self.get_rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        mem = self.get_rss()
        return {"allocated_bytes.all.current": mem, "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index: int | None = None) -> int:
        return total_memory()

    def available_memory(self, device_index: int | None = None) -> int:
        return available_memory()

    # -------------------------------------------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels on this CPU (DeepSpeed answers None rather than False where not)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # (as DeepSpeed: any failure of the probe means no)
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])

    def is_triton_supported(self) -> bool:
        return False

    def export_envs(self) -> list[str]:
        return []

    def _tensor(self, dtype: torch.dtype) -> Any:
        # torch's legacy constructors, as DeepSpeed's CPU accelerator returns: `FloatTensor(3)` has 3 elements
        return _LEGACY[dtype]

    # pinning: torch cannot pin memory for the CPU device; DeepSpeed's CPU accelerator keeps it a no-op
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        return tensor

    def _pin_empty(self, template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return template.new_empty(shape)

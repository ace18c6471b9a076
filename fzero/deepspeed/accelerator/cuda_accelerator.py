"""DeepSpeed's CUDA accelerator, `deepspeed.accelerator.cuda_accelerator.CUDA_Accelerator`: each method the
`torch.cuda` call DeepSpeed's makes, so a script's device, seed, stream and memory calls behave as under DeepSpeed.

Free memory comes from NVML where `pynvml` is installed (as DeepSpeed's), else the device's total less torch's
allocation. NVTX ranges go through `torch.cuda.nvtx` (DeepSpeed's optional `nvtx` package domains are not used).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from .abstract_accelerator import DeepSpeedAccelerator

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(DeepSpeedAccelerator):
    """DeepSpeed's CUDA accelerator: device "cuda", backend NCCL (gloo on Windows)."""

    def __init__(self) -> None:
        self._name = "cuda"
        self._communication_backend_name = "nccl" if sys.platform != "win32" else "gloo"

    def is_synchronized_device(self) -> bool:
        return False

    # ------------------------------------------------------------------------------------------- devices
    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: Any) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: Any = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return str(tensor.device).startswith("cuda:")

    # ----------------------------------------------------------------------------------------------- rng
    def set_rng_state(self, new_state: torch.Tensor, device_index: Any = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: Any = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ------------------------------------------------------------------------------ streams, events, graphs
    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    # -------------------------------------------------------------------------------------------- memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: Any = None) -> None:
        torch.cuda.reset_max_memory_allocated(device_index)

    def memory_cached(self, device_index: Any = None) -> int:
        return torch.cuda.memory_reserved(device_index)  # (torch's memory_cached is its deprecated alias)

    def max_memory_cached(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: Any = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Any = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: Any = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: Any = None) -> int:
        """Free device memory: NVML's where pynvml is installed (CUDA_VISIBLE_DEVICES remapped), else the total
        less torch's allocation (DeepSpeed's fallback)."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception:  # (no pynvml, or no NVML driver: DeepSpeed falls back the same way)
            return self.total_memory(device_index) - self.memory_allocated(device_index)
        index = self.current_device() if device_index is None else device_index
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            index = [int(i) for i in visible.split(",")][index]
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free

    # -------------------------------------------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True

    def is_fp16_supported(self) -> bool:
        """Compute capability 7 or above (6 with `DS_ALLOW_DEPRECATED_FP16=1`), as DeepSpeed decides."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float]
        if self.is_fp16_supported():
            out.append(torch.half)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_triton_supported(self) -> bool:
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

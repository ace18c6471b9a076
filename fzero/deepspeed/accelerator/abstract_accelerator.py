"""DeepSpeed's accelerator interface, `deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator`: what fzero's
two accelerators (`cpu_accelerator`, `cuda_accelerator`) answer alike, and the methods neither has.

The methods are DeepSpeed's, with its signatures and return values; they wrap torch and nothing of fzero's own state,
so a script's device, seed and memory calls mean what they meant under DeepSpeed. DeepSpeed's op builders (its JIT
C++ and CUDA extensions) and `set_compile_backend` are refused by name.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..refusal import refuse

__all__ = ["UNSUPPORTED", "DeepSpeedAccelerator"]

_OPS = "fzero builds none of DeepSpeed's ops: fzero.deepspeed.ops has its optimizers, over fzero's own C kernels"
UNSUPPORTED = {
    "op_builder_dir": _OPS,
    "create_op_builder": _OPS,
    "get_op_builder": _OPS,
    "build_extension": _OPS,
    "set_compile_backend": "fzero's engine does not compile the model (DeepSpeed's engine.compile); call "
    "torch.compile on the model yourself",
}


class _NoopContext:
    """DeepSpeed's `runtime.utils.noop_context`: a `with` block that does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class DeepSpeedAccelerator:
    """The methods both accelerators share; `_name` and `_communication_backend_name` are set by each."""

    _name: str
    _communication_backend_name: str
    _compile_backend = "inductor"
    supports_nvtx_domain = False

    def __getattr__(self, name: str) -> Any:
        # only reached for names the class lacks: DeepSpeed's refused methods raise NotImplementedError by name
        return refuse(f"{type(self).__module__}.{type(self).__name__}", name, UNSUPPORTED)

    def __repr__(self) -> str:
        return f"fzero.deepspeed {type(self).__name__}({self._name!r}, {self._communication_backend_name!r})"

    # ------------------------------------------------------------------------------------------------- misc
    def communication_backend_name(self) -> str:
        """The `torch.distributed` backend: "nccl" on CUDA, "gloo" on the CPU."""
        return self._communication_backend_name

    def random(self) -> Any:
        return torch.random

    def is_fp64_supported(self) -> bool:
        return True

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        """Write `local_accelerator_ids` (comma-separated) into `current_env`'s visible-devices variables."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_synchronized_device(self) -> bool:
        raise NotImplementedError  # each accelerator answers

    # ------------------------------------------------------------------------------------------- tensors
    def _tensor(self, dtype: torch.dtype) -> Any:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    @property
    def BFloat16Tensor(self) -> Any:
        return self._tensor(torch.bfloat16)

    @property
    def ByteTensor(self) -> Any:
        return self._tensor(torch.uint8)

    @property
    def DoubleTensor(self) -> Any:
        return self._tensor(torch.double)

    @property
    def FloatTensor(self) -> Any:
        return self._tensor(torch.float)

    @property
    def HalfTensor(self) -> Any:
        return self._tensor(torch.half)

    @property
    def IntTensor(self) -> Any:
        return self._tensor(torch.int)

    @property
    def LongTensor(self) -> Any:
        return self._tensor(torch.long)

    # ------------------------------------------------------------------------------------- pinned memory
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        return False

    def unregister_host_memory(self, address: int) -> None:
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """`tensor` in pinned host memory (`make_copy`), or a fresh pinned buffer of its shape and dtype (flat
        unless `match_shape`)."""
        if make_copy:
            return self._pin(tensor)
        return self._pin_empty(tensor, tuple(tensor.shape) if match_shape else (tensor.numel(),))

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """An uninitialised pinned host tensor of `size` (ints, or one tuple/list/Size)."""
        _require_host(device)
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self._pin_empty(torch.empty(0, dtype=dtype), tuple(int(d) for d in shape))

    def pin_empty_like(
        self, tensor: torch.Tensor, device: Any = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        _require_host(device)
        template = tensor.new_empty((0,), dtype=tensor.dtype if dtype is None else dtype, device="cpu")
        return self._pin_empty(template, tuple(tensor.shape))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        return None

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def _pin_empty(self, template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return template.new_empty(shape, pin_memory=True)


def _require_host(device: Any) -> None:
    try:
        host = torch.device(device).type == "cpu"
    except RuntimeError:
        host = False
    if not host:
        raise ValueError(f"pin_empty allocates host memory; device must be cpu, got {device!r}")

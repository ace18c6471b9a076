"""`Lifecycle`: DeepSpeed's engine methods about the engine itself rather than a step: `compile` (per unit:
`fzero.sharding.compile`), `is_compiled`, `destroy`, `empty_partition_cache`."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..host import scratch
from ..sharding.compile import Compiler, compile_units

__all__ = ["Lifecycle"]


class Lifecycle:
    """`compile`, `destroy` and `empty_partition_cache`, for `fzero.Engine`."""

    _device: torch.device
    _grad: Tensor | None
    _loss: Tensor | None
    monitor: Any

    if TYPE_CHECKING:  # (the engine's other parts)

        @property
        def module(self) -> torch.nn.Module: ...

        @property
        def state(self) -> Any: ...

        def _discard_micro_step(self) -> None: ...

        def close(self) -> None: ...

        def wait_for_checkpoint(self) -> Any: ...

    def compile(
        self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:  # fmt: skip
        """DeepSpeed's `engine.compile(backend, compile_kwargs)`: the model compiled unit by unit, the gathers,
        reductions and hooks outside the graphs (`fzero.sharding.compile`), at every stage. The next forward
        compiles; one graph serves every step (and every block with the same code).

        Args:
          backend: `torch.compile`'s backend (DeepSpeed's default on CPU and CUDA: "inductor").
          compile_kwargs: `torch.compile`'s other keyword arguments (`mode`, `fullgraph`, `dynamic`, `options`).
          schedule: DeepCompile's schedule: not supported (None).
          compiled_autograd_enabled: not supported (False): each unit's backward is its forward graph's own.

        Raises:
          NotImplementedError: `schedule` or `compiled_autograd_enabled`, naming what fzero does instead.
          TypeError: a key of `compile_kwargs` that `torch.compile` does not take.
        """
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile(schedule=...) (DeepCompile) is not supported by fzero: it compiles each unit's "
                "forward and its backward with torch.compile instead"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(compiled_autograd_enabled=True) is not supported by fzero: each unit's backward is "
                "compiled with its forward (AOTAutograd); the gathers and reductions between units stay eager"
            )
        self.compile_with({"backend": backend, **(compile_kwargs or {})})

    def compile_with(self, how: dict[str, Any] | Compiler) -> None:
        """`compile`'s work: the model's units compiled with `torch.compile`'s keyword arguments or a compiler
        (`fzero.sharding.compile.compile_units`); a log line names them."""
        names = compile_units(self.module, self.state.layout, how)
        self._compiled = how
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        self.monitor.printer(f"fzero: compiled the forward (and backward) of {len(names)} unit modules ({shown})")

    @property
    def is_compiled(self) -> bool:
        """DeepSpeed's: whether `engine.compile` compiled the model."""
        return getattr(self, "_compiled", None) is not None

    def destroy(self) -> None:
        """DeepSpeed's `engine.destroy()`: drop a micro-step in flight, wait for a background checkpoint save and
        close the monitors (their files flushed). The training state stays: the engine is released when the last
        reference to it goes."""
        self._discard_micro_step()
        self._grad = self._loss = None
        try:
            self.wait_for_checkpoint()  # (its failure is raised, after the rest is closed)
        finally:
            self.close()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release memory held for parameters between steps. fzero's stage 3 frees each unit after its
        module ran, so what is held is the step-sized buffers kept for the next step (`fzero.host.scratch`): they
        go, and the accelerator's cache with them."""
        scratch.clear()
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

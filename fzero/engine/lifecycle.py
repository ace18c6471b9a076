"""`Lifecycle`: DeepSpeed's engine methods about the engine itself rather than a step: `compile` (refused until
per-unit compilation exists), `is_compiled`, `destroy`, `empty_partition_cache`."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..host import scratch

__all__ = ["Lifecycle"]


class Lifecycle:
    """`compile`, `destroy` and `empty_partition_cache`, for `fzero.Engine`."""

    _device: torch.device
    _grad: Tensor | None
    _loss: Tensor | None

    if TYPE_CHECKING:  # (the engine's other parts)

        def _discard_micro_step(self) -> None: ...

        def close(self) -> None: ...

        def wait_for_checkpoint(self) -> Any: ...

    def compile(
        self, backend: Any = None, compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:  # fmt: skip
        """DeepSpeed's `engine.compile(...)`: not supported yet (torch's `nn.Module.compile` of the engine would
        compile the engine's own call, not the model's units).

        Raises:
          NotImplementedError: always, naming the alternative.
        """
        raise NotImplementedError(
            "engine.compile(...) (DeepSpeed's DeepSpeedEngine.compile) is not supported by fzero yet (per-unit "
            "compilation): compile the model itself before fzero.initialize, e.g. model.compile(backend=...) or "
            "model = torch.compile(model), which trains the same at ZeRO stages 0-2; at stage 3 train it eager"
        )

    @property
    def is_compiled(self) -> bool:
        """DeepSpeed's: whether `engine.compile` compiled the model (never, in fzero)."""
        return False

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

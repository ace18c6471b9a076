"""`Accumulation`: who decides where a gradient accumulation window ends, as DeepSpeed scripts say it.

fzero's transform chain counts: `accumulate(gradient_accumulation_steps)` updates on every GAS-th micro-step it
takes. DeepSpeed lets the script say it instead:

    engine.set_gradient_accumulation_boundary(False)     # what Accelerate does before every backward but the last
    for batch in window[:-1]:
        engine.backward(engine(batch))                   # here, each such backward is a micro-step of the chain
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(window[-1]))
    engine.step()                                        # the GAS-th micro-step: the update

A backward while the boundary is set to False ends its micro-step at once (the chain accumulates its gradient: no
update, and at stages 0-1 no communication), so one `step()` per window suffices, and a `step()` after such a backward
has nothing left to do. The chain honours the script's boundary exactly when it falls where its count does (every
GAS-th micro-batch: what Accelerate asks); a boundary elsewhere raises, naming both, before anything is computed.
The micro-step counter then counts micro-batches (as without the override); DeepSpeed's counts `step()` calls.

`no_sync()` is DeepSpeed's context for backwards that do not reduce: at stages 0 and 1 fzero's backwards never
reduce (the chain reduces once per window, at its boundary), so several backwards in it add their gradients
locally, reduced once by the micro-step's `step()` outside; `step()` inside it raises, and stages 2 and 3, which
reduce every micro-step, refuse it, as DeepSpeed does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..config import Config

__all__ = ["Accumulation"]


class Accumulation:
    """The accumulation boundary and `no_sync`, for `fzero.Engine`."""

    config: Config
    micro_steps: int
    inside_no_sync_ctxt: bool  # (DeepSpeed's attribute)
    _boundary: bool | None  # the script's boundary; None: the chain's count decides

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` (or backward) ends the accumulation window: the script's boundary if it set one
        (`set_gradient_accumulation_boundary`), else `(micro_steps + 1) % GAS == 0`."""
        if self._boundary is not None:
            return self._boundary
        return self._counted_boundary()

    def _counted_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: the script says whether the coming micro-batch ends the window (see the module docstring).

        Raises:
          TypeError: not a bool.
          ValueError: the boundary contradicts the chain's count of `gradient_accumulation_steps`.
        """
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary expects a bool, got {type(is_boundary).__name__}")
        self._check_boundary("set_gradient_accumulation_boundary", is_boundary)
        self._boundary = is_boundary

    def _check_boundary(self, where: str, boundary: bool | None = None) -> None:
        """Raise if the script's boundary (`boundary`, default the one set) is not where the chain's count puts
        it; called before any work is done."""
        boundary = self._boundary if boundary is None else boundary
        if boundary is None or boundary == self._counted_boundary():
            return
        gas = self.config.gas
        at = self.micro_steps % gas + 1
        raise ValueError(
            f"{where}: set_gradient_accumulation_boundary({boundary}) for micro-batch {at} of the window, but "
            f"gradient_accumulation_steps is {gas}: fzero's transform chain (accumulate({gas})) ends a window "
            f"after exactly {gas} micro-batches; set the boundary True for the last of them only, or configure "
            "gradient_accumulation_steps to the window you use"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's `engine.no_sync()`: backwards that add their gradients locally (see the module docstring).

        Raises:
          RuntimeError: at stages 2-3, or entered again inside itself.
        """
        if self.config.stage >= 2:
            raise RuntimeError(
                "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                f"{self.config.stage} (as in DeepSpeed): stages 2 and 3 reduce-scatter every micro-step's gradients; "
                "accumulate with gradient_accumulation_steps instead (engine.step() after every micro-batch)"
            )
        if self.inside_no_sync_ctxt:
            raise RuntimeError("no_sync context manager reentry is unsupported")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

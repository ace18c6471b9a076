"""`EngineCounters`: what the engine knows beyond the `TrainState`, in one typed record.

DeepSpeed's counters (`global_steps`, `global_samples`, `micro_steps`, `skipped_steps`), the updates applied by
an optimizer whose state keeps no count (`applied`), the open accumulation window's losses (the next report's
mean) and the last boundary's gradient norm. The engine reads and writes it; its checkpoints save and restore it
(`fzero.engine.checkpointing`) through `Checkpointable`, never through the engine's private fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import Tensor

from ..config import Config
from ..mesh import RankMesh
from ..state import TrainState

__all__ = ["Checkpointable", "EngineCounters"]


@dataclasses.dataclass
class EngineCounters:
    """The engine's counters (DeepSpeed 0.19's, see `fzero.engine.engine`).

    Attributes:
      global_steps, global_samples, micro_steps, skipped_steps: DeepSpeed's.
      applied: updates applied, for an optimizer whose state keeps no count of them.
      step_losses: the losses of the micro-steps of the open accumulation window.
      global_grad_norm: the last boundary step's gradient norm (unscaled, before clipping), None before one.
    """

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    applied: int = 0
    step_losses: list[Tensor] = dataclasses.field(default_factory=list)
    global_grad_norm: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The counters as JSON values; floats exact (hex), NaN and infinity included."""
        norm = self.global_grad_norm
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "applied_updates": self.applied,
            "step_losses": [float(x).hex() for x in self.step_losses],
            "global_grad_norm": None if norm is None else float(norm).hex(),
        }

    @classmethod
    def from_json(cls, counts: dict[str, int], record: dict[str, Any] | None) -> EngineCounters:
        """Counters from `counts` (the four DeepSpeed counters and `applied_updates`) and, where the checkpoint has
        one, the saved record's window losses and gradient norm."""
        out = cls(counts["global_steps"], counts["global_samples"], counts["micro_steps"], counts["skipped_steps"],
                  counts["applied_updates"])  # fmt: skip
        if record is not None:
            out.step_losses = [torch.tensor(float.fromhex(h)) for h in record["step_losses"]]
            norm = record["global_grad_norm"]
            out.global_grad_norm = None if norm is None else float.fromhex(norm)
        return out


class Checkpointable(Protocol):
    """What the engine's checkpoints read and restore (`fzero.Engine` is one)."""

    state: TrainState
    mesh: RankMesh
    config: Config
    optimizer: Any
    client_scheduler: Any
    counters: EngineCounters

    pending_checkpoint: Any

    def check_between_steps(self, what: str) -> None: ...

    def wait_for_checkpoint(self) -> Any: ...

    def restore(self, state: TrainState, counters: EngineCounters | None) -> None: ...

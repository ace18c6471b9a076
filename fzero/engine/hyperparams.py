"""`HyperParams`: the engine's optimizer as DeepSpeed scripts see it.

The next update's hyper-parameters (`get_lr()`, `get_mom()`), functions of the optimizer's applied updates, shown
in the optimizer object `initialize` returned (unless a client scheduler sets them there, where the optimizer then
reads them); the loss scale in use (`optimizer.cur_scale`); the client scheduler's step after each applied update;
DeepSpeed's overflow line for a skipped one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ..config import Config
from ..optim import Hyper, hyper_value
from ..state import TrainState
from ..step.microstep import loss_scale
from ..transforms.scaling import current_loss_scale
from .counters import EngineCounters

__all__ = ["HyperParams"]


class HyperParams:
    """The next update's hyper-parameters, per param group, for `fzero.Engine`."""

    state: TrainState
    config: Config
    optimizer: Any
    client_scheduler: Any
    counters: EngineCounters
    global_steps: int

    def _set_hypers(
        self,
        lr: Hyper | Sequence[Hyper],
        betas: tuple[Hyper, Hyper] | Sequence[tuple[Hyper, Hyper]] | None,
        param_groups: Sequence[dict[str, Any]],
        momentum: str,
    ) -> None:
        """Each param group's learning rate (and Adam's betas): one per group, or one for every group.

        Raises:
          ValueError: not one per group.
        """
        self._lrs: list[Hyper] = list(lr) if isinstance(lr, (list, tuple)) else [cast(Hyper, lr)]  # (else: one)
        self._betas: list[tuple[Hyper, Hyper]] | None = None
        if betas is not None:
            pairs = cast("Sequence[Sequence[Hyper]]", betas if isinstance(betas[0], (list, tuple)) else [betas])
            self._betas = [cast("tuple[Hyper, Hyper]", tuple(b)) for b in pairs]
        self._groups = list(param_groups)
        if len(self._groups) != len(self._lrs) or (self._betas is not None and len(self._betas) != len(self._lrs)):
            raise ValueError(
                f"Engine: {len(self._groups)} param groups but {len(self._lrs)} learning rates"
                + ("" if self._betas is None else f" and {len(self._betas)} betas")
            )
        self._momentum = momentum

    def applied_updates(self) -> int:
        """Updates the optimizer applied (skipped steps excluded): what the LR schedule is a function of."""
        opt = self.state.plan.state_of(self.state.tx_state, "update")
        return int(opt.count) if opt is not None and hasattr(opt, "count") else self.counters.applied

    def get_lr(self) -> list[float]:
        """The learning rate of the next update, one per param group (DeepSpeed's `engine.get_lr()`: its groups
        with parameters, in order)."""
        return self._lrs_at(self.applied_updates())

    def _lrs_at(self, n: int) -> list[float]:
        return [float(hyper_value(lr, n)) for lr in self._lrs]

    def get_mom(self) -> list[Any]:
        """The momentum of the next update, one per param group, as DeepSpeed's `engine.get_mom()` reads it: the
        groups' `momentum` for a config SGD, their `betas` otherwise (a client `torch.optim.SGD` has none: 0.0)."""
        return [group.get(self._momentum, 0.0) for group in self._groups]

    def _overflow_message(self, attempted: float) -> str:
        """DeepSpeed's overflow line, so that logs read the same."""
        head = f"fzero: OVERFLOW! Skipping step {self.global_steps + 1} (inf/nan gradients)."
        ls, now = current_loss_scale(self.state), loss_scale(self.state)
        if now != attempted:
            return f"{head} Attempted loss scale: {attempted:g}, reducing to {now:g}"
        if hasattr(ls, "cur_hysteresis"):
            h = int(ls.cur_hysteresis)
            return f"{head} Attempted loss scale: {attempted:g}, but hysteresis is {h + 1}. Reducing hysteresis to {h}"
        return head

    def _step_scheduler(self, lr_kwargs: dict[str, Any] | None) -> None:
        try:
            self.client_scheduler.step(**(lr_kwargs or {}))
        except TypeError:
            if lr_kwargs:
                raise
            self.client_scheduler.step(self.config.train_batch_size)  # DeepSpeed's fallback

    def _sync_view(self) -> None:
        """Show the next update's hyper-parameters in the optimizer object (unless a client scheduler drives
        them), and the loss scale in use (`cur_scale`; a client optimizer's too, as in DeepSpeed)."""
        self.optimizer.cur_scale = loss_scale(self.state)
        if self.client_scheduler is not None:
            return
        n = self.applied_updates()
        for i, group in enumerate(self._groups):
            group["lr"] = float(hyper_value(self._lrs[i], n))
            if self._betas is not None:
                group["betas"] = tuple(float(hyper_value(b, n)) for b in self._betas[i])

"""What DeepSpeed's optimizer classes share here: a `torch.optim.Optimizer` whose update is the fzero optimizer that
the same config `optimizer` block runs.

Each class is one of DeepSpeed's config optimizer types (`optimizer_type`: "Adam", "Lamb", "Lion", "Adagrad") and
says what a param group's values are as that block's `params` (`config_params`). Both uses read that one
translation (`fzero.config.optimizers.OptimizerType.block_hypers`):

- on its own, `step()` updates each parameter that has a gradient in place with the fzero optimizer the block
  builds (`OptimizerSpec.build`: the native CPU kernel where the parameter is in CPU memory and the type has one),
  keeping DeepSpeed's per-parameter state (`step`, and DeepSpeed's names for the buffers);
- given to `fzero.initialize(optimizer=...)`, the engine runs the same optimizer on its flat shards, group by group,
  reading each group's `lr` (and `betas`) at every update (`fzero.engine.client.client_spec`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...config.build import OptimizerSpec
from ...config.optimizers import OPTIMIZERS
from ...optim import Optimizer

__all__ = ["FunctionalOptimizer", "number"]


def number(value: Any) -> float:
    """A group's hyper-parameter as a plain float (a 0-d tensor read once), as the config's schema takes it."""
    return float(value.item() if isinstance(value, Tensor) else value)


class FunctionalOptimizer(torch.optim.Optimizer):
    """A DeepSpeed optimizer class over fzero's functional optimizer (see the module's notes).

    Subclasses set:
      optimizer_type: the config's `optimizer.type` the class is (a row of `fzero.config.optimizers.OPTIMIZERS`).
      state_keys: DeepSpeed's names of the state's buffers, in the order of the fzero state's (after its count).
      unused_keys: buffers DeepSpeed keeps that the update never reads (zero-filled, so that `state_dict()` has
        DeepSpeed's keys).
      state_type: the fzero state (`AdamState`, `LionState`, `AdagradState`).
      cpu_only: DeepSpeed's CPU classes, which update parameters in CPU memory only.
    and define `config_params(group)`.
    """

    optimizer_type: ClassVar[str]
    state_keys: ClassVar[tuple[str, ...]]
    unused_keys: ClassVar[tuple[str, ...]] = ()
    state_type: ClassVar[Callable[..., Any]]
    cpu_only: ClassVar[bool] = False

    def config_params(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The config block's `params` a param group's values are (DeepSpeed's names)."""
        raise NotImplementedError

    def functional(self, group: Mapping[str, Any], index: int, cpu: bool) -> Optimizer:
        """The fzero optimizer of param group `group` (number `index`), for parameters in CPU memory or not.

        Raises:
          ConfigError, ValueError: a hyper-parameter out of its range, naming the group and the key.
        """
        row = OPTIMIZERS[self.optimizer_type]
        kind, lr, hypers, options = row.block_hypers(
            self.config_params(group), f"{type(self).__name__}.param_groups[{index}]"
        )
        return OptimizerSpec(kind, lr, hypers, lr, options=options).build(cpu=cpu)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's hyper-parameters checked as the fzero optimizer's constructor checks them."""
        super().add_param_group(param_group)
        self.functional(self.param_groups[-1], len(self.param_groups) - 1, cpu=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]  # (torch's overloads)
        """Update every parameter that has a gradient, in place.

        Args:
          closure: recomputes the loss (run with gradients enabled), as torch's optimizers take it.

        Returns:
          The closure's loss, or None.

        Raises:
          ValueError: a parameter fzero's kernel cannot update here (see `check_param`).
          NotImplementedError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            built: dict[bool, Optimizer] = {}  # by whether the parameter is in CPU memory
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self.check_param(p, index, i)
                cpu = p.device.type == "cpu"
                if cpu not in built:
                    built[cpu] = self.functional(group, index, cpu)
                self._update(built[cpu], p)
        return loss

    def check_param(self, p: Tensor, group: int, index: int) -> None:
        """Raises for a parameter this class cannot update: a sparse gradient, a CPU class's parameter off the CPU
        (as DeepSpeed's assertion), or one in CPU memory that is not float32 (fzero's CPU kernels keep float32
        parameters; DeepSpeed's also update bfloat16 / float16 ones in place)."""
        where = f"{type(self).__name__}: param {index} of group {group}"
        if p.grad is not None and p.grad.is_sparse:
            raise NotImplementedError(f"{where} has a sparse gradient: fzero's optimizers take dense gradients")
        if self.cpu_only and p.device.type != "cpu":
            raise ValueError(
                f"{where} is on {p.device}: this optimizer updates parameters in CPU memory, as DeepSpeed's asserts "
                "(given to fzero.initialize, the engine runs its update wherever the master weights are)"
            )
        if p.device.type == "cpu" and p.dtype != torch.float32 and OPTIMIZERS[self.optimizer_type].native:
            raise ValueError(
                f"{where} is {p.dtype}: fzero's CPU kernel updates float32 parameters (DeepSpeed's also bfloat16 / "
                "float16 ones, rounding each update): keep float32 parameters, or train through fzero.initialize, "
                "whose bf16 / fp16 configs keep float32 master weights"
            )

    def _update(self, opt: Optimizer, p: Tensor) -> None:
        """One update of `p` and its state, in place (on contiguous copies where a tensor is not contiguous)."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            for key in (*self.state_keys, *self.unused_keys):
                state[key] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        given = [p, *(state[key] for key in self.state_keys)]
        work = [t if t.is_contiguous() else t.contiguous() for t in given]
        count = torch.tensor(int(state["step"]), dtype=torch.int64)
        assert p.grad is not None  # (step skips the others)
        opt.update(p.grad, self.state_type(count, *work[1:]), work[0], donate=True)
        for t, w in zip(given, work, strict=True):
            if t is not w:
                t.copy_(w)
        state["step"] = int(state["step"]) + 1


class FusedOptimizer(FunctionalOptimizer):
    """DeepSpeed's `FusedAdam` and `FusedLion`: `step` refuses the arguments DeepSpeed dropped, with its message.

    Attributes:
      dropped_step_arguments: DeepSpeed's message for them.
    """

    dropped_step_arguments = ""

    @torch.no_grad()
    def step(self, closure: Any = None, grads: Any = None, output_params: Any = None, scale: Any = None,
             grad_norms: Any = None, grad_scaler: Any = None) -> Any:  # fmt: skip
        """torch's `step(closure)`; DeepSpeed's deprecated arguments are refused as DeepSpeed refuses them.

        Raises:
          RuntimeError: `grads`, `output_params`, `scale` or `grad_norms` given (DeepSpeed's message).
        """
        if any(p is not None for p in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(self.dropped_step_arguments)
        return super().step(closure)

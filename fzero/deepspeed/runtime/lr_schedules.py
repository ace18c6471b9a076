"""`deepspeed.runtime.lr_schedules`: DeepSpeed's scheduler objects, over fzero's schedules (`fzero.optim.schedules`).

    from fzero.deepspeed.runtime.lr_schedules import WarmupLR
    engine, *_ = deepspeed.initialize(..., lr_scheduler=lambda opt: WarmupLR(opt, warmup_num_steps=100))

Each object writes its learning rates (and `OneCycle` its betas) into the optimizer's param groups, as DeepSpeed's
do, with the values of fzero's schedule for each group: bitwise DeepSpeed's (`fzero.optim.schedules` follows its
operations in its order). DeepSpeed's state after `L = last_batch_iteration` steps sets the rate of update `L + 1`,
which is fzero's schedule at `n = L + 1` applied updates. A config's `scheduler` block needs none of this: the
engine builds the same schedules itself. The LR range test is refused, as in fzero's config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...optim import schedules
from ..refusal import refuse
from ..utils.logging import logger

__all__ = [
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "get_torch_optimizer",
    "update_lr",
]

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
# the config keys of the schedules' parameters
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", \
    "warmup_type"  # fmt: skip
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"

_CONFIG = "give the config a `scheduler` block (the engine builds the schedule), or build a scheduler object here"
_UNSUPPORTED = {
    "LRRangeTest": "the LR range test is not implemented (nor is its config `scheduler` type)",
    **dict.fromkeys(
        """
        add_tuning_arguments parse_arguments get_config_from_args get_lr_from_config override_params
        override_lr_range_test_params override_1cycle_params override_warmupLR_params
        override_warmupCosineLR_params
        """.split(),
        f"DeepSpeed's command-line tuning arguments are not read: {_CONFIG}",
    ),
}

Schedule = Callable[[int], float]


def get_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """`optimizer` if it is a `torch.optim.Optimizer`, else the one it wraps (`.optimizer`).

    Raises:
      TypeError: neither.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def update_lr(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[Any]:
    """Write `lrs` into `param_groups` (in place into a tensor `lr`); returns the groups' learning rates."""
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """`value` for each param group: a list or tuple of one per group, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):  # (DeepSpeed warns and uses "log")
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        return WARMUP_LOG_RATE
    return warmup_type


class _Scheduled:
    """A DeepSpeed scheduler object: one learning-rate schedule per param group (and a beta1 schedule for each
    with OneCycle's momentum), functions of the applied updates `n = last_batch_iteration + 1`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lrs: list[Schedule], last_batch_iteration: int,
                 moms: list[Schedule] | None = None) -> None:  # fmt: skip
        self._lrs, self._moms = lrs, moms
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:  # the constructor writes the first update's values (DeepSpeed's)
            self._last_lr = update_lr(optimizer.param_groups, self.get_lr())
            self._write_moms()

    optimizer: torch.optim.Optimizer

    def get_lr(self) -> list[float]:
        """The learning rate of each group for the update after `last_batch_iteration` steps."""
        return [lr(self.last_batch_iteration + 1) for lr in self._lrs]

    def get_last_lr(self) -> list[Any]:
        """The learning rates last written into the groups.

        Raises:
          RuntimeError: nothing written yet (constructed with `last_batch_iteration` other than -1, not stepped).
        """
        if getattr(self, "_last_lr", None) is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or to `last_batch_iteration`) and write the groups' learning rates (and betas)."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())
        self._write_moms()

    def _write_moms(self) -> None:
        if self._moms is not None:  # DeepSpeed's OneCycle: (beta1, 0.99)
            for group, mom in zip(self.optimizer.param_groups, self._moms, strict=True):
                group["betas"] = (mom(self.last_batch_iteration + 1), 0.99)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Scheduled):
    """From `warmup_min_lr` to `warmup_max_lr` (default: each group's lr) over `warmup_num_steps`, then constant
    (`fzero.optim.schedules.warmup_lr`); per-group values as lists."""

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.optimizer = get_torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(self.optimizer, self._schedules(warmup_num_steps), last_batch_iteration)

    def _schedules(self, steps: int) -> list[Schedule]:
        pairs = zip(self.min_lrs, self.max_lrs, strict=True)
        return [schedules.warmup_lr(lo, hi, steps, self.warmup_type) for lo, hi in pairs]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then linear decay to `warmup_min_lr` at `total_num_steps` (`schedules.warmup_decay_lr`)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _schedules(self, steps: int) -> list[Schedule]:
        pairs = zip(self.min_lrs, self.max_lrs, strict=True)
        return [schedules.warmup_decay_lr(self.total_num_steps, lo, hi, steps, self.warmup_type) for lo, hi in pairs]


class WarmupCosineLR(_Scheduled):
    """Each group's lr at construction times a ratio warming up from `warmup_min_ratio` to 1, then a cosine down
    to `cos_min_ratio` at `total_num_steps` (`schedules.warmup_cosine_lr`)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.optimizer = get_torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        lrs = [schedules.warmup_cosine_lr(lr, total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio,
                                          self.warmup_type) for lr in self.org_lrs]  # fmt: skip
        super().__init__(self.optimizer, lrs, last_batch_iteration)


class OneCycle(_Scheduled):
    """DeepSpeed's 1Cycle: the learning rate up from `cycle_min_lr` to `cycle_max_lr` and back, then decaying;
    with `cycle_momentum` (and betas in the optimizer) beta1 inversely, beta2 held at 0.99, as DeepSpeed does
    (`schedules.one_cycle`, `schedules.one_cycle_momentum`)."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:  # fmt: skip
        self.optimizer = get_torch_optimizer(optimizer)
        shape = (cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count, cycle_second_stair_count,
                 decay_step_size)  # fmt: skip
        bounds = self._bounds(cycle_min_lr, cycle_max_lr, "cycle_min_lr", "cycle_max_lr")
        lrs = [schedules.one_cycle(lo, hi, decay_lr_rate, *shape) for lo, hi in bounds]
        self.cycle_momentum = cycle_momentum and "betas" in self.optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning(f"cycle_momentum is disabled because optimizer {type(self.optimizer).__name__} does not "
                           "support momentum, no betas attribute in defaults")  # fmt: skip
        moms = None
        if self.cycle_momentum:
            bounds = self._bounds(cycle_min_mom, cycle_max_mom, "cycle_min_mom", "cycle_max_mom")
            moms = [schedules.one_cycle_momentum(lo, hi, decay_mom_rate, *shape) for lo, hi in bounds]
        super().__init__(self.optimizer, lrs, last_batch_iteration, moms)

    def _bounds(self, low: Any, high: Any, low_name: str, high_name: str) -> list[tuple[Any, Any]]:
        lows, highs = _per_group(self.optimizer, low, low_name), _per_group(self.optimizer, high, high_name)
        return list(zip(lows, highs, strict=True))

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's (beta1, beta2) for the next update, None without momentum cycling."""
        if self._moms is None:
            return None
        return [(mom(self.last_batch_iteration + 1), 0.99) for mom in self._moms]


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

"""Functional optimizers on flat buffers: `init(params) -> state`, `update(grads, state, params) -> (params, state)`.

They know nothing of sharding: a shard, a full buffer and a single tensor are all just tensors, and every operation
is elementwise, so an update of a shard equals the same slice of the update of the whole buffer bitwise.
"""

from .adam import AdamState, adam, adamw
from .base import Hyper, Optimizer, hyper_value
from .cpu_adam import cpu_adam, cpu_adamw
from .groups import ParamGroups, param_groups
from .schedules import constant, one_cycle, one_cycle_momentum, warmup_cosine_lr, warmup_decay_lr, warmup_lr
from .sgd import SGDState, sgd

__all__ = [
    "AdamState",
    "Hyper",
    "Optimizer",
    "ParamGroups",
    "SGDState",
    "adam",
    "adamw",
    "constant",
    "cpu_adam",
    "cpu_adamw",
    "hyper_value",
    "one_cycle",
    "one_cycle_momentum",
    "param_groups",
    "sgd",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
]

"""Functional optimizers on flat buffers: `init(params) -> state`, `update(grads, state, params) -> (params, state)`.

They know nothing of sharding: a shard, a full buffer and a single tensor are all just tensors. Every operation of
`adam(w)`, `sgd`, `lion` and `adagrad` is elementwise, so an update of a shard equals the same slice of the update of
the whole buffer bitwise; `lamb`'s per-tensor norms are given the tensors' places (`fzero.optim.tensors`).

May import: `fzero.native`, `fzero.layout`.
"""

from .adagrad import adagrad
from .adam import AdamState, adam, adamw
from .base import AdagradState, Hyper, LionState, Optimizer, hyper_value
from .cpu_adagrad import cpu_adagrad
from .cpu_adam import cpu_adam, cpu_adamw
from .cpu_lion import cpu_lion
from .groups import ParamGroups, param_groups
from .lamb import lamb
from .lion import lion
from .muon import muon
from .schedules import constant, one_cycle, one_cycle_momentum, warmup_cosine_lr, warmup_decay_lr, warmup_lr
from .sgd import SGDState, sgd
from .stored import stored_in

__all__ = [
    "AdagradState",
    "AdamState",
    "Hyper",
    "LionState",
    "Optimizer",
    "ParamGroups",
    "SGDState",
    "adagrad",
    "adam",
    "adamw",
    "constant",
    "cpu_adagrad",
    "cpu_adam",
    "cpu_adamw",
    "cpu_lion",
    "hyper_value",
    "lamb",
    "lion",
    "muon",
    "one_cycle",
    "one_cycle_momentum",
    "param_groups",
    "sgd",
    "stored_in",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
]

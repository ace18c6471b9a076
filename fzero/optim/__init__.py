"""Functional optimizers on flat buffers: `init(params) -> state`, `update(grads, state, params) -> (params, state)`.

They know nothing of sharding: a shard, a full buffer and a single tensor are all just tensors, and every operation
is elementwise, so an update of a shard equals the same slice of the update of the whole buffer bitwise.
"""

from .adam import AdamState, adam, adamw
from .base import Hyper, Optimizer, hyper_value
from .sgd import SGDState, sgd

__all__ = ["AdamState", "Hyper", "Optimizer", "SGDState", "adam", "adamw", "hyper_value", "sgd"]

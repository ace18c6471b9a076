"""The state layer: the training state and the values it holds.

`TrainState` (an immutable pytree of sharded flat buffers), the `Plan` a chain makes of a step (`plan`), loss scales
as immutable values (`loss_scale`), mixed-precision policies (`precision`), the state's random stream (`rng`) and the
model-state bytes per rank (`memory`). It knows nothing of how the state is updated.

May import: `fzero.storage`, `fzero.layout`, `fzero.sharding`.
"""

from .train_state import (
    TrainState,
    count,
    pytree,
    pytree_dataclass,
    register_torch_pytree,
    static_field,
)

__all__ = [
    "TrainState",
    "count",
    "pytree",
    "pytree_dataclass",
    "register_torch_pytree",
    "static_field",
]

"""The step layer: the pure training step built from a model, a loss function, a transform and a mesh.

`init` (the first `TrainState`), `train_step`, `eval_step` and `state_dict`, on one `MicroStep` (`microstep`) that the
engine drives too.

May import: `fzero.storage`, `fzero.layout`, `fzero.mesh`, `fzero.sharding`, `fzero.state`, `fzero.transforms`.
"""

from .microstep import apply_gradients, compute_params, named_tensors
from .train import StepFn, eval_step, init, keeps_gathered, rank_seeds, state_dict, train_step

__all__ = [
    "StepFn",
    "apply_gradients",
    "compute_params",
    "eval_step",
    "init",
    "keeps_gathered",
    "named_tensors",
    "rank_seeds",
    "state_dict",
    "train_step",
]

"""fzero: ZeRO stages 0-3 as a functional library on `torch.func`.

mesh = fzero.SimMesh(world=4)                       # or fzero.DistMesh() under torchrun
tx = fzero.zero2(fzero.adamw(3e-4), accumulate=2)   # or fzero.chain(...) of the same pieces
state = fzero.init(model, tx, mesh)
step = fzero.train_step(model, loss_fn, tx, mesh)
state, metrics = step(state, batch)
model.load_state_dict(fzero.state_dict(state))
"""

from . import layout, native, optim
from ._version import __version__ as __version__
from .checkpoint import consolidate, load, save
from .engine import DeepSpeedEngine, add_config_arguments, init_distributed, initialize
from .host import hostmem, scratch
from .layout import Layout
from .mesh import CollectiveError, DistMesh, Ledger, Mesh, SimMesh
from .mesh.agreement import DesyncError
from .optim import (
    Optimizer,
    adagrad,
    adam,
    adamw,
    cpu_adagrad,
    cpu_adam,
    cpu_adamw,
    cpu_lion,
    lamb,
    lion,
    muon,
    param_groups,
    sgd,
)
from .sharding.bind import call
from .sharding.units import GatherPolicy
from .state import TrainState, loss_scale, precision, pytree
from .state.loss_scale import DynamicLossScale, LossScaleError, NoOpLossScale, StaticLossScale
from .state.memory import state_bytes
from .state.precision import Policy, get_policy
from .step import eval_step, init, state_dict, train_step
from .transforms import (
    Average,
    Context,
    EmptyState,
    Flow,
    Offload,
    StepInfo,
    Transform,
    accumulate,
    all_reduce,
    chain,
    clip_by_global_norm,
    gather,
    identity,
    named_chain,
    quantized_gather,
    quantized_reduce_scatter,
    reduce_scatter,
    scale_loss,
    shard_update,
    stateless,
    zero0,
    zero1,
    zero2,
    zero3,
)

__all__ = [
    "Average",
    "CollectiveError",
    "Context",
    "DeepSpeedEngine",
    "DesyncError",
    "DistMesh",
    "DynamicLossScale",
    "EmptyState",
    "Flow",
    "GatherPolicy",
    "Layout",
    "Ledger",
    "LossScaleError",
    "Mesh",
    "NoOpLossScale",
    "Offload",
    "Optimizer",
    "Policy",
    "SimMesh",
    "StaticLossScale",
    "StepInfo",
    "TrainState",
    "Transform",
    "accumulate",
    "adagrad",
    "adam",
    "adamw",
    "add_config_arguments",
    "all_reduce",
    "call",
    "chain",
    "clip_by_global_norm",
    "consolidate",
    "cpu_adagrad",
    "cpu_adam",
    "cpu_adamw",
    "cpu_lion",
    "eval_step",
    "gather",
    "get_policy",
    "hostmem",
    "identity",
    "init",
    "init_distributed",
    "initialize",
    "lamb",
    "layout",
    "lion",
    "load",
    "loss_scale",
    "muon",
    "named_chain",
    "native",
    "optim",
    "param_groups",
    "precision",
    "pytree",
    "quantized_gather",
    "quantized_reduce_scatter",
    "reduce_scatter",
    "save",
    "scale_loss",
    "scratch",
    "sgd",
    "shard_update",
    "state_bytes",
    "state_dict",
    "stateless",
    "train_step",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
]

"""Processes of tests/test_deepspeed_namespace.py, and the procedures both libraries run.

Each procedure takes the library's module (DeepSpeed's or `fzero.deepspeed`'s) and returns plain values (floats as
hex), so DeepSpeed 0.19.8 answers in a process of its own (`python -m tests.deepspeed_namespace_worker reference`)
and fzero in the test's, through the same code. `two_ranks` runs both libraries' collectives side by side on one
gloo group of 2 processes.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import json
import logging
import os
import re
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# DeepSpeed's module paths whose names fzero.deepspeed must have or refuse (tensor_fragment's are another's)
MODULES = [
    "accelerator",
    "accelerator.real_accelerator",
    "comm",
    "checkpointing",
    "moe",
    "moe.utils",
    "compression",
    "compression.helper",
    "runtime",
    "runtime.utils",
    "runtime.lr_schedules",
    "runtime.dataloader",
    "runtime.torch_autocast",
    "runtime.data_pipeline.constants",
    "runtime.data_pipeline.curriculum_scheduler",
    "utils",
    "utils.logging",
    "utils.groups",
    "utils.module_utils",
]
_NOT_NAMES = {"TYPE_CHECKING"}
ACCELERATOR_FIELDS = ("_name", "_communication_backend_name", "_compile_backend")


def hexes(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.detach().double().flatten()]


# ------------------------------------------------------------------------------------------------------- the names
def public_names(module: Any) -> list[str]:
    """The names a module of DeepSpeed defines for its users: its functions, classes and objects of DeepSpeed's own
    types, and its constants (not the modules, typing helpers and torch objects it merely imports)."""
    out = []
    for name in sorted(dir(module)):
        if name.startswith("_") or name in _NOT_NAMES:
            continue
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            continue
        owner = getattr(value, "__module__", None) if callable(value) else type(value).__module__
        constant = isinstance(value, (str, int, float, list, dict, tuple, datetime.timedelta))
        if (owner or "").startswith("deepspeed") or constant:
            out.append(name)
    return out


def module(root: Any, path: str) -> Any:
    """`root.path` (a dotted attribute path: `deepspeed.checkpointing` is an attribute, not an importable path)."""
    out = root
    for part in path.split("."):
        try:
            out = getattr(out, part)
        except AttributeError:
            out = importlib.import_module(f"{out.__name__}.{part}")
    return out


# ---------------------------------------------------------------------------------------------------- accelerator
def accelerator_answers(acc: Any) -> dict[str, Any]:
    """What a script reads of the CPU accelerator (values that do not change between two processes)."""
    torch.manual_seed(5)
    t = acc.FloatTensor([1.0, 2.0])
    stats = acc.memory_stats()
    return {
        "_name": acc._name,
        "_communication_backend_name": acc._communication_backend_name,
        "device_name": [acc.device_name(), acc.device_name(0)],
        "current_device_name": acc.current_device_name(),
        "device": acc.device(),
        "device_count": acc.device_count(),
        "is_available": acc.is_available(),
        "communication_backend_name": acc.communication_backend_name(),
        "is_bf16_supported": acc.is_bf16_supported(),
        "is_fp16_supported": bool(acc.is_fp16_supported()),  # (DeepSpeed's answers None for no)
        "is_fp64_supported": acc.is_fp64_supported(),
        "is_triton_supported": acc.is_triton_supported(),
        "supported_dtypes": [str(d) for d in acc.supported_dtypes()],
        "is_synchronized_device": acc.is_synchronized_device(),
        "use_host_timers": acc.use_host_timers(),
        "synchronize": acc.synchronize(),
        "initial_seed": acc.initial_seed(),
        "rng_state_is_torch's": torch.equal(acc.get_rng_state(), torch.get_rng_state()),
        "random": acc.random().__name__,
        "default_generator": acc.default_generator(0) is torch.default_generator,
        "Stream": acc.Stream,
        "Event": acc.Event,
        "current_stream": acc.current_stream(),
        "stream": acc.stream(None).__enter__(),
        "create_graph": acc.create_graph(),
        "empty_cache": acc.empty_cache(),
        "total_memory": acc.total_memory(),
        "memory_stats": sorted(stats),
        "peak_at_least_current": stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0,
        "FloatTensor": [str(t.dtype), str(t.device), t.tolist()],
        "LongTensor": str(acc.LongTensor([1]).dtype),
        "FloatTensor(3)": list(acc.FloatTensor(3).shape),
        "pin_memory_without_copy": acc.pin_memory(t, make_copy=False) is t,
        "pin_memory_is_identity": acc.pin_memory(t) is t,
        "is_pinned": acc.is_pinned(t),
        "on_accelerator": acc.on_accelerator(t),
        "export_envs": acc.export_envs(),
        "visible_devices_envs": acc.visible_devices_envs(),
        "get_compile_backend": acc.get_compile_backend(),
        "lazy_call": acc.lazy_call(lambda: 7),
        "range_push": acc.range_push("x"),
    }


def cuda_answers(acc: Any) -> dict[str, Any]:
    """What a script reads of the CUDA accelerator (on a machine with a GPU)."""
    t = acc.FloatTensor([1.0, 2.0])
    return {
        "names": [acc._name, acc.communication_backend_name(), acc.device_name(), acc.device_name(0)],
        "device": [str(acc.device(0)), acc.current_device(), acc.current_device_name(), acc.device_count()],
        "dtypes": [acc.is_bf16_supported(), acc.is_fp16_supported(), [str(d) for d in acc.supported_dtypes()]],
        "memory": [acc.total_memory(), acc.memory_allocated() >= 0, sorted(acc.memory_stats())[:5]],
        "tensor": [str(t.device), acc.on_accelerator(t), acc.on_accelerator(torch.ones(1))],
        "misc": [
            acc.is_available(),
            acc.is_synchronized_device(),
            acc.export_envs(),
            acc.is_triton_supported(),
            acc.Stream is torch.cuda.Stream,
            acc.Event is torch.cuda.Event,
            acc.is_current_stream_capturing(),
        ],
        "pinned": [acc.is_pinned(acc.pin_memory(torch.ones(2))), acc.is_pinned(torch.ones(2))],
    }


def current_device(acc: Any) -> list[Any]:
    """`current_device()` without and with `LOCAL_RANK` (the caller restores the environment)."""
    os.environ.pop("LOCAL_RANK", None)
    out = [acc.current_device()]
    os.environ["LOCAL_RANK"] = "1"
    return [*out, acc.current_device()]


# -------------------------------------------------------------------------------------------------------- logging
@contextlib.contextmanager
def captured(logger: logging.Logger, level: int = logging.INFO):
    """The messages `logger` emits inside the block, at `level` and above."""
    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(f"{record.levelname}:{record.getMessage()}")  # type: ignore[method-assign]
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def log_dist_messages(utils: Any) -> list[str]:
    """What `log_dist` logs on this process for a few `ranks` and levels."""
    with captured(utils.logger) as out:
        utils.log_dist("all", ranks=[-1])
        utils.log_dist("zero", ranks=[0])
        utils.log_dist("one", ranks=[1])
        utils.log_dist("none")
        utils.log_dist("warn", ranks=[0, 1], level=logging.WARNING)
        utils.log_dist("debug", ranks=[0, 1], level=logging.DEBUG)
    return out


def see_memory_usage_format(runtime_utils: Any) -> list[str]:
    """`see_memory_usage`'s printed lines with every number replaced by #."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        runtime_utils.see_memory_usage("quiet")
        runtime_utils.see_memory_usage("loud", force=True)
    return [re.sub(r"\d+(\.\d+)?", "#", line) for line in buf.getvalue().splitlines()]


# ----------------------------------------------------------------------------------------------- models and groups
class Block(nn.Module):
    def __init__(self, dropout: float | None = 0.3) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(dropout) if dropout is not None else nn.Identity()
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.drop(self.lin(x))) * scale)


class Net(nn.Module):
    def __init__(self, dropout: float | None = 0.3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(2))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, checkpoint: Any = None) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, scale=scale) if checkpoint is not None else block(x, scale)
        return self.head(x)


def checkpoint_grads(checkpoint: Any) -> dict[str, list[str]]:
    """Gradients (of the parameters, the input and a keyword input) of a model with dropout, its blocks run through
    `checkpoint` (None: not checkpointed), from seed 0."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Net()
        x = torch.randn(4, 6, requires_grad=True)
        scale = torch.full((6,), 1.5, requires_grad=True)
        model(x, scale, checkpoint).square().mean().backward()
    grads = {name: hexes(p.grad) for name, p in model.named_parameters()}
    return {**grads, "x": hexes(x.grad), "scale": hexes(scale.grad)}


class Checkpointed(nn.Module):
    """An input layer (so the blocks' input requires grad, as reentrant checkpointing needs), then `Net`'s blocks
    through `checkpoint` (None: plainly), without dropout: DeepSpeed's engine and fzero's draw their masks from
    different streams."""

    def __init__(self, checkpoint: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.net = Net(dropout=None)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.inp(x), torch.full((6,), 1.5), self.checkpoint)


ENGINE_SCHEDULES = {
    "WarmupDecayLR": {"total_num_steps": 8, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3, "cycle_min_mom": 0.85,
                 "cycle_max_mom": 0.95},
}  # fmt: skip
ENGINE_LR, ENGINE_STEPS = 0.01, 6


def engine_run(deepspeed: Any, schedule: str, lr_schedules: Any = None, checkpoint: Any = None) -> dict[str, Any]:
    """`ENGINE_STEPS` steps of `deepspeed.initialize`'s engine (torch's AdamW, one rank) on `Checkpointed(checkpoint)`
    with the schedule `schedule`: a client scheduler object of `lr_schedules`, or without it the config's `scheduler`
    block. The losses and learning rates (hex) and the final parameters."""
    torch.manual_seed(0)
    model = Checkpointed(checkpoint)
    adamw = {"lr": ENGINE_LR, "weight_decay": 0.01, "torch_adam": True}
    config: dict[str, Any] = {"train_batch_size": 4, "steps_per_print": 10**9,
                              "optimizer": {"type": "AdamW", "params": adamw}}  # fmt: skip
    kwargs: dict[str, Any] = {}
    if lr_schedules is None:
        config["scheduler"] = {"type": schedule, "params": ENGINE_SCHEDULES[schedule]}
    else:
        kwargs["lr_scheduler"] = lambda optimizer: getattr(lr_schedules, schedule)(
            optimizer, **ENGINE_SCHEDULES[schedule]
        )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)
    g = torch.Generator().manual_seed(1)
    losses, lrs = [], []
    for _ in range(ENGINE_STEPS):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        lrs.append(float(engine.get_lr()[0]).hex())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item().hex())
    params = {k.removeprefix("module."): hexes(v) for k, v in engine.module_state_dict().items()}
    return {"losses": losses, "lrs": lrs, "params": params}


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"name": "decay", "params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
        {"name": "no-decay", "params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]


def moe_split(moe_utils: Any) -> dict[str, Any]:
    """The MoE helpers on a dense model's param groups: the groups' keys, which parameters (by index), and which
    objects are the input's."""
    model = Net()
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def shape(groups: list[dict[str, Any]], given: list[dict[str, Any]]) -> list[Any]:
        return [
            [
                sorted(g),
                [index[id(p)] for p in g["params"]],
                any(g is h for h in given),
                any(g["params"] is h["params"] for h in given),
            ]
            for g in groups
        ]

    given = param_groups(model)
    split = moe_utils.split_params_into_different_moe_groups_for_optimizer(given)
    one = param_groups(model)[0]
    params = list(model.parameters())
    configured = moe_utils.configure_moe_param_groups(params)
    return {
        "list": [*shape(split, given), type(split).__name__],
        "dict": shape(moe_utils.split_params_into_different_moe_groups_for_optimizer(one), [one]),
        "tuple": len(moe_utils.split_params_into_different_moe_groups_for_optimizer(tuple(param_groups(model)))),
        "configure": [[*sorted(g), g["name"], len(g["params"])] for g in configured],
        "is_moe_param": [moe_utils.is_moe_param(p) for p in params[:2]],
        "shared_expert": [len(x) for x in moe_utils.split_params_into_shared_and_expert_params(params)],
        "has_moe_layers": list(moe_utils.has_moe_layers(model)),
        "is_moe_param_group": moe_utils.is_moe_param_group(given[0]),
    }


def attribute_paths(helper: Any) -> dict[str, Any]:
    """`recursive_getattr` / `recursive_setattr` on a model's dotted paths."""
    model = Net()
    got = helper.recursive_getattr(model, "blocks.1.lin")
    helper.recursive_setattr(model, "blocks.0.norm", nn.Identity())
    helper.recursive_setattr(model, "head", nn.Linear(6, 3))
    try:
        helper.recursive_getattr(model, "blocks.9")
        missing = None
    except (AttributeError, IndexError) as e:
        missing = type(e).__name__
    return {
        "get": got is model.blocks[1].lin,
        "weight": list(helper.recursive_getattr(model, "blocks.1.lin.weight").shape),
        "set": [
            type(model.blocks[0].norm).__name__,
            "blocks.0.norm.weight" in dict(model.named_parameters()),
            model.head.out_features,
        ],
        "missing": missing,
    }


# ---------------------------------------------------------------------------------------------------- schedules
SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 0.001], "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 5, "cos_min_ratio": 0.05}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": [0.01, 0.02],
            "cycle_first_step_size": 6,
            "cycle_second_step_size": 4,
            "decay_lr_rate": 0.1,
            "decay_step_size": 3,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "OneCycle",
        {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 8, "cycle_first_stair_count": 3},
    ),
]


def schedule_traces(lr_schedules: Any) -> list[Any]:
    """Each scheduler's learning rates and betas, as written into an AdamW's two param groups, over 25 steps, then
    after `step(3)` and after `load_state_dict`."""
    out = []
    for name, kwargs in SCHEDULES:
        opt = torch.optim.AdamW(param_groups(Net()), lr=0.005)
        sched = getattr(lr_schedules, name)(opt, **kwargs)

        def groups(opt=opt) -> list[Any]:
            return [[float(g["lr"]).hex(), [float(b).hex() for b in g["betas"]]] for g in opt.param_groups]

        trace = [groups()]
        for _ in range(25):
            sched.step()
            trace.append([*groups(), [float(v).hex() for v in sched.get_last_lr()], sched.last_batch_iteration])
        sched.step(3)
        trace.append(groups())
        sched.load_state_dict({"last_batch_iteration": 10})
        trace.append([sched.state_dict(), [float(v).hex() for v in sched.get_lr()]])
        out.append(trace)
    return out


# ------------------------------------------------------------------------------------------------- runtime utils
def runtime_helpers(runtime_utils: Any) -> dict[str, Any]:
    t = torch.ones(2, 3)
    nested = {"a": [t, (t, 3)], "b": "s"}
    copied = runtime_utils.copy_to_device(nested, "cpu", torch.is_tensor)
    moved = runtime_utils.move_to_device([t, {"k": t}], "cpu", torch.is_tensor)
    empty = nn.Parameter(torch.zeros(0))
    filtered = runtime_utils.filter_empty_parameters([{"params": [empty], "lr": 1}, {"lr": 2, "params": [empty, t]}])
    return {
        "copy": [copied["a"][0] is t, copied["a"][1][1], copied["b"], type(copied["a"][1]).__name__],
        "move": [moved[0] is t, moved[1]["k"] is t],
        "bytes": runtime_utils.get_tensor_bytes(nested),
        "call": runtime_utils.call_to_str("f", 1, "a", k=2.0),
        "unique": runtime_utils.get_only_unique_item([4, 4]),
        "filtered": [[sorted(g), g["lr"], len(g["params"])] for g in filtered],
        "model_parallel": runtime_utils.is_model_parallel_parameter(t),
        "noop": [runtime_utils.noop_decorator(len) is len, runtime_utils.noop_context().__enter__()],
    }


# ----------------------------------------------------------------------------------------------------- processes
def _deepspeed_without_shm() -> Any:
    """DeepSpeed, its comm backend told not to build its shared-memory collective (a C++ compile of a minute, for
    its inference all-reduce only: the collectives compared here are torch's either way)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    return deepspeed


def reference(out: str) -> None:
    """DeepSpeed's answers (one process, no launcher variables), written as JSON to `out`."""
    deepspeed = _deepspeed_without_shm()
    from deepspeed.compression import helper  # (its FutureWarning: kept in fzero's too)
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime import utils as runtime_utils

    acc = deepspeed.get_accelerator()
    results: dict[str, Any] = {
        "names": {path: public_names(module(deepspeed, path)) for path in MODULES},
        "accelerator_names": sorted(n for n in dir(acc) if not n.startswith("_") or n in ACCELERATOR_FIELDS),
        "accelerator": accelerator_answers(acc),
        "current_device": current_device(acc),
        "log_dist": log_dist_messages(deepspeed.utils),
        "see_memory_usage": see_memory_usage_format(runtime_utils),
        "checkpoint": checkpoint_grads(deepspeed.checkpointing.checkpoint),
        "no_checkpoint": checkpoint_grads(None),
        "moe": moe_split(deepspeed.moe.utils),
        "attributes": attribute_paths(helper),
        "schedules": schedule_traces(lr_schedules),
        "runtime": runtime_helpers(runtime_utils),
    }
    # a single-process job as a launcher starts it (DeepSpeed 0.19.8 asks mpi4py for these without one)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    deepspeed.comm.init_distributed()
    results["one_rank"] = one_rank_answers(deepspeed.comm, deepspeed.utils)
    results["engine"] = engine_run(deepspeed, "WarmupDecayLR", lr_schedules, deepspeed.checkpointing.checkpoint)
    deepspeed.comm.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def reference_cuda(out: str) -> None:
    """DeepSpeed's CUDA accelerator's answers (`DS_ACCELERATOR=cuda`), written as JSON to `out`."""
    deepspeed = _deepspeed_without_shm()
    with open(out, "w") as f:
        json.dump(cuda_answers(deepspeed.get_accelerator()), f)


def one_rank_answers(comm: Any, utils: Any) -> dict[str, Any]:
    t = torch.arange(4.0)
    comm.all_reduce(t)
    return {
        "rank": comm.get_rank(),
        "world": comm.get_world_size(),
        "local": comm.get_local_rank(),
        "initialized": comm.is_initialized(),
        "backend": dist.get_backend(),
        "all_reduce": t.tolist(),
        "log_dist": log_dist_messages(utils),
        "dp": [utils.groups._get_data_parallel_world_size(), utils.groups._get_data_parallel_rank()],
    }


def fzero_one_rank(out: str) -> None:
    """fzero's answers in a plain process (no launcher variables), written as JSON to `out`."""
    from fzero.deepspeed import comm, utils

    comm.init_distributed()
    results = one_rank_answers(comm, utils)
    comm.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def collectives(comm: Any, rank: int, world: int) -> dict[str, Any]:
    """Each collective of `comm` (DeepSpeed's or fzero's) on this rank's values, as hex."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, generator=g)
    out: dict[str, Any] = {"rank": comm.get_rank(), "world": comm.get_world_size(), "local": comm.get_local_rank()}
    for name, op in (("sum", comm.ReduceOp.SUM), ("avg", comm.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
        t = x.clone()
        comm.all_reduce(t, op=op)
        out[f"all_reduce_{name}"] = hexes(t)
    t = x.clone()
    comm.all_reduce(t, async_op=True).wait()
    out["all_reduce_async"] = hexes(t)
    gathered = [torch.empty(6) for _ in range(world)]
    comm.all_gather(gathered, x)
    out["all_gather"] = [hexes(v) for v in gathered]
    flat = torch.empty(6 * world)
    comm.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = hexes(flat)
    shard = torch.empty(6 // world)
    comm.reduce_scatter_tensor(shard, x, op=comm.ReduceOp.SUM)
    out["reduce_scatter_tensor"] = hexes(shard)
    comm.reduce_scatter_fn(shard, x)
    out["reduce_scatter_fn"] = hexes(shard)
    t = x.clone()
    comm.broadcast(t, src=1)
    out["broadcast"] = hexes(t)
    a2a = torch.empty(6)
    comm.all_to_all_single(a2a, x)
    out["all_to_all_single"] = hexes(a2a)
    received = torch.empty(6)
    if rank == 0:
        comm.send(x, dst=1)
        comm.recv(received, src=1)
    else:
        comm.recv(received, src=0)
        comm.send(x, dst=0)
    out["send_recv"] = hexes(received)
    peer = 1 - rank
    batch = [comm.P2POp(comm.isend, x, peer), comm.P2POp(comm.irecv, received, peer)]
    for request in comm.batch_isend_irecv(batch):
        request.wait()
    out["batch_isend_irecv"] = hexes(received)
    objects: list[Any] = [None] * world
    comm.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    comm.barrier()
    group = comm.new_group([1, 0])
    out["group"] = [
        comm.get_rank(group),
        comm.get_world_size(group),
        comm.get_global_rank(group, 0),
        comm.get_all_ranks_from_group(group),
        comm.get_all_ranks_from_group(None),
    ]
    return out


def two_ranks(rank: int, world: int, out_dir: str) -> None:
    """DeepSpeed's and fzero's comm, groups and log_dist on one gloo group of `world` processes."""
    from tests.spawn import init_worker, report

    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    deepspeed = _deepspeed_without_shm()
    deepspeed.comm.init_distributed()  # (the group exists: DeepSpeed takes it over)
    import fzero.deepspeed as fz

    results = {}
    for lib, name in ((deepspeed, "deepspeed"), (fz, "fzero")):
        results[name] = {
            "comm": collectives(lib.comm, rank, world),
            "log_dist": log_dist_messages(lib.utils),
            "groups": [
                lib.utils.groups._get_data_parallel_world_size(),
                lib.utils.groups._get_data_parallel_rank(),
                lib.utils.groups._get_sequence_data_parallel_world_size(),
                lib.utils.groups._get_model_parallel_world_size(),
                dist.get_world_size(lib.utils.groups._get_data_parallel_group()),
                lib.utils.groups._get_broadcast_src_rank(),
            ],
        }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, results)
    report(rank, out_dir, everyone)
    fz.comm.destroy_process_group()


if __name__ == "__main__":
    {"reference": reference, "fzero_one_rank": fzero_one_rank, "reference_cuda": reference_cuda}[sys.argv[1]](
        sys.argv[2]
    )

"""Worker of tests/test_dcp.py: real FSDP2 (`fully_shard` on each block and the root, a "cpu" device mesh, gloo) with
torch.optim.AdamW against fzero at stage 3 (the engine over a `DistMesh`), through DCP checkpoints both ways.

Every run sees the same global batch per step (`GLOBAL` samples, split evenly over the ranks) and reports the global
loss (the mean of the ranks' means) as float hex, and its tensors as safetensors files for the test to compare:

    A  FSDP2 (world 2) trains `SAVE_AT` steps, saves DCP, continues `MORE` steps (the reference);
       rank 0 imports the DCP with `import_dcp`; fzero (world 2, stage 3) loads it and continues.
    B  fzero (world 2, stage 3) trains `SAVE_AT` steps, saves, continues `MORE` steps (the reference);
       rank 0 exports the checkpoint with `export_dcp`; FSDP2 at world 2 and at world 1 (a group of rank 0 alone)
       loads it with get_state_dict, dcp.load, set_state_dict and continues.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from fzero.host import process_group
from tests.spawn import init_worker

GLOBAL, SAVE_AT, MORE, LR = 12, 3, 3, 1e-2  # samples per step (over 2 or 3 ranks), steps before / after the save
WIDTH = 16


class Net(nn.Module):
    """Three blocks (a Linear each, 272 parameters) and a head, with a buffer: FSDP2 shards each block and the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.head = nn.Linear(WIDTH, 4)
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return self.head(x * self.scale)


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of step `step`'s global batch (steps count from 1)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL, WIDTH, generator=g), torch.randn(GLOBAL, 4, generator=g)
    n = GLOBAL // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


def config(world: int) -> dict:
    """fzero's engine at stage 3 with torch's AdamW arithmetic (`torch_adam`) and its default weight decay, and no
    gradient clipping, as the FSDP2 loop (DeepSpeed 0.19.3+ clips at 1.0 unless told otherwise)."""
    return {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
    }


def global_loss(loss: torch.Tensor, group, world: int) -> str:
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return (total / world).item().hex()


# -------------------------------------------------------------------------------------------------------- FSDP2
def fsdp(mesh, seed: int, **hypers) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 on `net(seed)`: `fully_shard` on each block, then the root; torch's AdamW (`lr=LR` unless given)."""
    from torch.distributed.fsdp import fully_shard

    model = net(seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), **{"lr": LR, **hypers})


def hypers(opt) -> list[dict]:
    keys = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")
    return [{k: g[k] for k in keys} for g in opt.param_groups]


def fsdp_train(model, opt, steps: range, rank: int, world: int, group) -> list[str]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, group, world))
    return losses


def fsdp_tensors(model, opt) -> dict[str, torch.Tensor]:
    """Parameters, buffer and AdamW state, whole (every rank takes part in the gathers)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    out = {f"model/{k}": whole(v) for k, v in msd.items()}
    for name, state in osd["state"].items():
        out.update({f"{field}/{name}": whole(v) for field, v in state.items()})
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def fsdp_load(model, opt, path: str, group=None) -> None:
    """The DCP recipe's load: nothing but get_state_dict, dcp.load and set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# -------------------------------------------------------------------------------------------------------- fzero
def engine(world: int, seed: int):
    import fzero

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on config keys
        eng, *_ = fzero.initialize(model=net(seed), config=config(world), printer=lambda *a: None)
    return eng


def fzero_train(eng, steps: range, rank: int, world: int) -> list[str]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world)
        loss = loss_fn(eng(x), y)
        eng.backward(loss)
        eng.step()
        losses.append(global_loss(loss, None, world))
    return losses


def run(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from fzero.interop.dcp import export_dcp, import_dcp

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store")
    path = lambda name: os.path.join(out_dir, name)  # noqa: E731
    results: dict = {}

    def keep(name: str, tensors: dict[str, torch.Tensor]) -> None:
        if rank == 0:
            save_file({k: v.contiguous() for k, v in tensors.items()}, path(f"{name}.safetensors"))

    # A: FSDP2 saves, fzero continues
    mesh = init_device_mesh("cpu", (world,))
    model, opt = fsdp(mesh, seed=0)
    losses = fsdp_train(model, opt, range(1, SAVE_AT + 1), rank, world, None)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path("fsdp_dcp"))
    keep("fsdp_saved", fsdp_tensors(model, opt))
    results["fsdp"] = losses + fsdp_train(model, opt, range(SAVE_AT + 1, SAVE_AT + MORE + 1), rank, world, None)
    keep("fsdp_final", fsdp_tensors(model, opt))
    if rank == 0:
        import_dcp(path("fsdp_dcp"), path("fz_from_fsdp"), Net())
    dist.barrier()
    eng = engine(world, seed=1)  # another initialisation: the checkpoint must replace it
    eng.load_checkpoint(path("fz_from_fsdp"))
    results["fzero_from_fsdp"] = fzero_train(eng, range(SAVE_AT + 1, SAVE_AT + MORE + 1), rank, world)
    keep("fzero_from_fsdp_final", eng.module_state_dict())

    # B: fzero saves, FSDP2 continues at world 2 and at world 1
    eng = engine(world, seed=0)
    losses = fzero_train(eng, range(1, SAVE_AT + 1), rank, world)
    eng.save_checkpoint(path("fz_run"))
    results["fzero"] = losses + fzero_train(eng, range(SAVE_AT + 1, SAVE_AT + MORE + 1), rank, world)
    keep("fzero_final", eng.module_state_dict())
    if rank == 0:
        export_dcp(path("fz_run"), path("fz_dcp"))
    dist.barrier()
    # other hyper-parameters in the constructor: set_state_dict must put the checkpoint's in their place
    model, opt = fsdp(mesh, seed=2, lr=0.5, weight_decay=0.25)
    fsdp_load(model, opt, path("fz_dcp"))
    results["fsdp_loaded_groups"] = hypers(opt)
    keep("fsdp_loaded", fsdp_tensors(model, opt))
    results["fsdp_from_fzero"] = fsdp_train(model, opt, range(SAVE_AT + 1, SAVE_AT + MORE + 1), rank, world, None)
    keep("fsdp_from_fzero_final", fsdp_tensors(model, opt))
    alone = dist.new_group([0])  # (every rank creates it)
    if rank == 0:
        model, opt = fsdp(DeviceMesh.from_group(alone, "cpu"), seed=3, lr=0.5)
        fsdp_load(model, opt, path("fz_dcp"), alone)
        results["fsdp1_loaded_groups"] = hypers(opt)
        keep("fsdp1_loaded", fsdp_tensors(model, opt))
        results["fsdp1_from_fzero"] = fsdp_train(model, opt, range(SAVE_AT + 1, SAVE_AT + MORE + 1), 0, 1, alone)
        keep("fsdp1_from_fzero_final", fsdp_tensors(model, opt))
        with open(path("results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

"""Workers for tests/test_checkpoint_hybrid_dist.py: checkpoints of hybrid-sharded `DistMesh` states over real gloo
processes (fzero/checkpoint/hybrid.py).

- `resume` (4 processes, `DistMesh` (2, 2)): hybrid stages 1-3 trained, saved at an optimizer step's boundary,
  loaded into a fresh state and trained on, beside the run that never stopped (also a state offloaded to NVMe); a
  stage-1 state saved in the middle of an accumulation window, and a save without the mesh (refused); the parent's
  `SimMesh((2, 2))` checkpoint loaded and saved again.
- `reshard` (4 processes: the (2, 2) checkpoint continued on (1, 4) and (4, 1); 3 processes: on a 1-D mesh of 3):
  each target's final state saved, for the parent to compare with `SimMesh` runs of the same shapes.

The parent runs the same functions on a `SimMesh` (`rank` None: batches with every rank's rows).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import optree
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fzero
from fzero.examples.gpt import GPT
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import lm_loss, tiny_gpt

SHAPE = (2, 2)  # (replicate, shard) of the runs that save
GLOBAL = 12  # examples per micro-step, split over the ranks: divisible by 3 and 4, so every target sees the same data
STEPS, AT = 4, 2  # optimizer steps in all; the checkpoint is taken after AT of them
CASES = [(3, 1), (1, 2), (2, 2)]  # (stage, accumulate) of the hybrid runs that save and resume
TARGETS = {
    4: [(1, 4), (4, 1)],
    3: [None],
}  # by process count: the shapes the (2, 2) checkpoint continues on (None: 1-D)
DTYPE = torch.float64  # (the one comparison that is not bitwise, (4, 1)'s, has a tight float64 bound: tests/bounds.py)


def model(dtype: torch.dtype = DTYPE) -> GPT:
    return tiny_gpt(0, dtype)


def name(stage: int, micro: int) -> str:
    return f"zero{stage}-{micro}"


def shape_name(shape: tuple[int, int] | None, world: int) -> str:
    return f"1d{world}" if shape is None else f"{shape[0]}x{shape[1]}"


def make_mesh(shape: tuple[int, int] | None, sim: bool, world: int):
    """A `SimMesh` (`sim`) or `DistMesh` of the given (replicate, shard) shape, or 1-D of `world` (shape None)."""
    if shape is None:
        return fzero.SimMesh(world) if sim else fzero.DistMesh()
    axes = {"replicate": shape[0], "shard": shape[1]}
    return fzero.SimMesh(shape=axes) if sim else fzero.DistMesh(shape=axes)


def make_tx(stage: int, micro: int, hybrid: bool):
    return getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro, hybrid=hybrid)


def batches(micro: int) -> list[dict[str, torch.Tensor]]:
    """`STEPS * micro` micro-batches of `GLOBAL` sequences, without a world axis (`split` gives each rank its rows)."""
    g = torch.Generator().manual_seed(7)
    cfg = model().cfg
    toks = [torch.randint(0, cfg.vocab_size, (GLOBAL, cfg.seq_len + 1), generator=g) for _ in range(STEPS * micro)]
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]


def split(batch: dict, world: int, rank: int | None) -> dict:
    """`batch` cut into `world` equal parts on a leading world axis; rank `rank`'s part (None: all of them)."""
    parts = {k: v.unflatten(0, (world, -1)) for k, v in batch.items()}
    return parts if rank is None else {k: v[rank] for k, v in parts.items()}


def train(mesh, tx, state, data: list[dict], rank: int | None, dtype: torch.dtype = DTYPE):
    net = model(dtype)
    step = fzero.train_step(net, lm_loss(net), tx, mesh)
    for batch in data:
        state, _ = step(state, split(batch, mesh.world, rank))
    return state


def leaves(state) -> list[torch.Tensor]:
    return optree.tree_leaves(state, namespace="fzero")


def differing(a, b) -> list[str]:
    """The paths of the leaves of two states of one structure that are not bitwise equal."""
    paths, xs, _ = optree.tree_flatten_with_path(a, namespace="fzero")
    ys = leaves(b)
    assert len(xs) == len(ys), (len(xs), len(ys))
    return [str(p) for p, x, y in zip(paths, xs, ys, strict=True) if not (x.dtype == y.dtype and torch.equal(x, y))]


def generator_digest() -> str:
    """sha256 of this process's torch generator state."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def params(state, mesh) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in fzero.state_dict(state, mesh).items() if k != "head.weight"}  # (tied)


def resume(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-{world}")
    mesh = make_mesh(SHAPE, False, world)
    net = model()
    results: dict = {}
    saved3 = None
    for stage, micro in CASES:
        tx = make_tx(stage, micro, True)
        data = batches(micro)
        state = train(mesh, tx, fzero.init(net, tx, mesh), data[: AT * micro], rank)
        root = f"{out_dir}/{name(stage, micro)}"
        torch.manual_seed(100 + rank)  # each rank its own generator: replica 0's are saved
        generator = generator_digest()
        fzero.save(state, root, mesh=mesh, data_position=AT * micro)
        straight = train(mesh, tx, state, data[AT * micro :], rank)

        torch.manual_seed(999)
        loaded, extra = fzero.load(root, fzero.init(net, tx, mesh), mesh, restore_rng=True)
        restored = generator_digest()
        resumed = train(mesh, tx, loaded, data[extra["data_position"] :], rank)
        results[name(stage, micro)] = {
            "loaded": differing(loaded, state),  # every leaf of this rank's state, bitwise
            "resumed": differing(resumed, straight),
            "world": extra["world"],
            "files": sorted(p.name for p in Path(extra["path"]).iterdir()),
            "generator": generator,
            "restored": restored,
        }
        full = {f"straight/{k}": v for k, v in params(straight, mesh).items()}
        full |= {f"resumed/{k}": v for k, v in params(resumed, mesh).items()}
        if rank == 0:
            save_file(full, f"{out_dir}/{name(stage, micro)}.st")
        if (stage, micro) == CASES[0]:
            saved3 = state

    # a stage-1 state in the middle of an accumulation window: each rank's local gradients differ between replicas
    tx = make_tx(1, 2, True)
    mid = train(mesh, tx, fzero.init(net, tx, mesh), batches(2)[:1], rank)
    try:
        fzero.save(mid, f"{out_dir}/mid", mesh=mesh)
        results["mid"] = None
    except ValueError as e:
        results["mid"] = str(e)
    try:  # a hybrid DistMesh state's save needs its mesh (for its replica count and to agree)
        fzero.save(state, f"{out_dir}/mid", mesh=None)
        results["no_mesh"] = None
    except TypeError as e:
        results["no_mesh"] = str(e)
    dist.barrier()  # (every rank has tried before any looks for what the saves left)
    results["mid_left"] = sorted(p.name for p in Path(out_dir).glob("*mid*"))

    # the parent's SimMesh((2, 2)) checkpoint of the first case, at the same point: this rank's part, bitwise (the
    # two runs are bitwise equal: tests/test_hybrid.py); saved again from here, for the parent to load
    stage, micro = CASES[0]
    tx = make_tx(stage, micro, True)
    from_sim, _ = fzero.load(f"{out_dir}/sim", fzero.init(net, tx, mesh), mesh)
    results["from_sim"] = differing(from_sim, saved3)
    fzero.save(from_sim, f"{out_dir}/from-sim", mesh=mesh)

    # a state offloaded to NVMe: the replicas compare the checksums its store keeps; a load writes each rank's part
    # into the new state's own store
    Path(f"{out_dir}/swap-{rank}").mkdir()
    offload = fzero.Offload("nvme", path=f"{out_dir}/swap-{rank}", chunk=4096)
    tx = fzero.zero3(fzero.cpu_adamw(1e-2), hybrid=True, offload=offload)
    data, net32 = batches(1), model(torch.float32)
    state = train(mesh, tx, fzero.init(net32, tx, mesh), data[:AT], rank, torch.float32)
    fzero.save(state, f"{out_dir}/nvme", mesh=mesh)
    straight = params(train(mesh, tx, state, data[AT:], rank, torch.float32), mesh)
    loaded, _ = fzero.load(f"{out_dir}/nvme", fzero.init(net32, tx, mesh), mesh)
    resumed = params(train(mesh, tx, loaded, data[AT:], rank, torch.float32), mesh)
    results["nvme"] = {
        "offloaded": type(loaded.params).__name__,
        "resumed": [k for k in straight if not torch.equal(straight[k], resumed[k])],
    }
    with open(f"{out_dir}/results-{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()


def reshard(rank: int, world: int, out_dir: str) -> None:
    """Continue the (2, 2) checkpoint `out_dir/ckpt` (saved here first when `world` is 4) on each target shape, and
    save the final states."""
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-{world}")
    net = model()
    stage, micro = CASES[0]
    data = batches(micro)
    if world == 4:
        mesh = make_mesh(SHAPE, False, world)
        tx = make_tx(stage, micro, True)
        state = train(mesh, tx, fzero.init(net, tx, mesh), data[: AT * micro], rank)
        fzero.save(state, f"{out_dir}/ckpt", mesh=mesh, data_position=AT * micro)
    for shape in TARGETS[world]:
        mesh = make_mesh(shape, False, world)
        tx = make_tx(stage, micro, shape is not None)
        loaded, extra = fzero.load(f"{out_dir}/ckpt", fzero.init(net, tx, mesh), mesh)
        final = train(mesh, tx, loaded, data[extra["data_position"] :], rank)
        fzero.save(final, f"{out_dir}/final-{shape_name(shape, world)}", mesh=mesh)
        full = params(final, mesh)  # (a collective: every rank)
        if rank == 0:
            save_file(full, f"{out_dir}/final-{shape_name(shape, world)}.st")
    dist.barrier()
    process_group.shutdown()

"""Workers for the checkpoint tests.

- `resume`: a rank of a real gloo group: trains, saves mid-run, resumes from the files, and writes what it got;
  also loads a checkpoint the parent saved at another world size. Run by `tests/test_checkpoint_dist.py`.
- ``python -m tests.ckpt_worker save-loop ROOT [background]``: saves a large-ish state again and again, printing each
  finished save, until it is killed (`tests/test_checkpoint_faults.py` and `test_checkpoint_background.py` kill it
  with SIGKILL at random moments).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import fzero
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import lm_batches, lm_loss, tiny_gpt

# (preset, accumulate, micro-step of the save): zero1 saved mid-accumulation keeps each rank's local gradients
CASES = [("zero1", 2, 3), ("zero3", 2, 2)]
STEPS = 3  # optimizer steps, i.e. STEPS * accumulate micro-steps


def noisy_loss(model):
    """The LM loss times a random factor from the process's generator, so the result depends on the RNG state."""
    inner = lm_loss(model)
    return lambda params, batch: inner(params, batch) * (1 + 0.1 * torch.rand(()))


def batches(world: int, micro: int):
    return lm_batches(tiny_gpt(0), world, micro, 2, STEPS, 11)


def local(batch: dict, rank: int | None) -> dict:
    return batch if rank is None else {k: v[rank] for k, v in batch.items()}


def train(state, step, data, start: int, rank: int | None):
    for batch in data[start:]:
        state, _ = step(state, local(batch, rank))
    return state


def resume(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    for preset, micro, at in CASES:
        model = tiny_gpt(0)
        tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
        step = fzero.train_step(model, noisy_loss(model), tx, mesh)
        data = batches(world, micro)
        root = f"{out_dir}/{preset}"

        torch.manual_seed(100 + rank)  # each rank its own generator: the checkpoint keeps each one
        state = fzero.init(model, tx, mesh)
        state = train(state, step, data[:at], 0, rank)
        fzero.save(state, root, mesh=mesh, data_position=at, user_state={"rank0_only": True})
        straight = fzero.state_dict(train(state, step, data, at, rank), mesh)

        torch.manual_seed(999)  # a fresh process would not have the saved generator state
        like = fzero.init(model, tx, mesh)
        resumed, extra = fzero.load(root, like, mesh, restore_rng=True)
        again = fzero.state_dict(train(resumed, step, data, extra["data_position"], rank), mesh)

        # the parent's checkpoint of world 3: load at world 2, train the remaining steps, save for comparison
        plain = fzero.train_step(model, lm_loss(model), tx, mesh)
        moved, extra3 = fzero.load(f"{out_dir}/from3", fzero.init(model, tx, mesh), mesh)
        moved = train(moved, plain, data, extra3["data_position"], rank)
        fzero.save(moved, f"{out_dir}/moved-{preset}", mesh=mesh)
        if rank == 0:
            tensors = {f"straight/{k}": v for k, v in straight.items() if k != "head.weight"}
            tensors |= {f"resumed/{k}": v for k, v in again.items() if k != "head.weight"}
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out_dir}/{preset}.st")
    background(rank, world, out_dir, mesh)
    # failures reach every rank: none hangs in a collective, all raise the same kind of error
    outcomes = []
    try:
        fzero.save(moved, f"{out_dir}/moved-zero3", mesh=mesh)  # exists: rank 0 refuses
    except fzero.checkpoint.CheckpointError as e:
        outcomes.append(f"{type(e).__name__}: {e}")
    if rank == 0:
        damaged = f"{out_dir}/zero3/step2/rank-00001-of-00002.safetensors"
        data = bytearray(open(damaged, "rb").read())
        data[-3] ^= 1
        open(damaged, "wb").write(bytes(data))
    dist.barrier()
    try:
        fzero.load(f"{out_dir}/zero3", like, mesh)  # rank 1 verifies the damaged file, rank 0 learns from it
    except fzero.checkpoint.CheckpointError as e:
        outcomes.append(f"{type(e).__name__}: {e}")
    with open(f"{out_dir}/outcomes-{rank}.txt", "w") as f:
        f.write("\n".join(outcomes))
    dist.barrier()
    process_group.shutdown()


def background(rank: int, world: int, out_dir: str, mesh: fzero.DistMesh) -> None:
    """A background save at stage 3 while 3 donated steps overwrite the state (and gather and reduce over the
    group meanwhile): rank 0 keeps the state at the call and after the steps, for the parent to compare."""
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.adamw(1e-2))
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True)
    data = lm_batches(model, world, 1, 2, 5, 3)
    state = train(fzero.init(model, tx, mesh), step, data[:2], 0, rank)
    handle = fzero.save(state, f"{out_dir}/background", mesh=mesh, data_position=2, blocking=False)
    at_call = fzero.state_dict(state, mesh)
    state = train(state, step, data, 2, rank)
    handle.wait()
    after = fzero.state_dict(state, mesh)
    if rank == 0:
        tensors = {f"at_call/{k}": v for k, v in at_call.items()} | {f"after/{k}": v for k, v in after.items()}
        save_file({k: v.contiguous() for k, v in tensors.items() if "head" not in k}, f"{out_dir}/background.st")


def save_loop(root: str, background: bool = False) -> None:
    """Save states whose every parameter equals the save's index, forever (`background`: each save in the
    background, overwriting the state's buffers in place while it writes, as a donated step would)."""
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    tx = fzero.zero2(fzero.adamw(1e-3))
    state = fzero.init(model, tx, fzero.SimMesh(2))
    i = int(fzero.checkpoint.read_latest(root).removeprefix("s")) + 1 if fzero.checkpoint.read_latest(root) else 0
    while True:
        state = state.replace(params=torch.full_like(state.params, float(i)))
        if not background:
            fzero.save(state, root, tag=f"s{i}", data_position=i, overwrite=True)  # killed after its rename
        else:
            handle = fzero.save(state, root, tag=f"s{i}", data_position=i, overwrite=True, blocking=False)
            while not handle.done():
                state.params.fill_(-1.0)  # the staged copy is what is written
            handle.wait()
        print("saved", i, flush=True)
        i += 1


if __name__ == "__main__":
    if sys.argv[1] == "save-loop":
        save_loop(sys.argv[2], background=sys.argv[3:] == ["background"])

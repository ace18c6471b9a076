"""The step time while a checkpoint is written in the background, against steps without a save, and the blocking
save beside it.

The model is `benchmarks/compare.py`'s 27.3M-parameter GPT, trained by fzero's core (`train_step(donate=True)`,
AdamW, fp32) on 2 gloo processes of 1 thread each, at `--stage` (default 2). Each process runs as a user's script
would: glibc's default allocator (no `fzero.hostmem.retain_freed_memory`). Every round runs four variants in a
shuffled order, each `--steps` steps after the previous variant's:

- `steps` and `steps again`: steps alone (timed twice in the rotation: the A/A spread is the run's own noise);
- `background`: `fzero.save(state, ..., blocking=False)`, then the steps; the save call's time (copying the state
  to host memory) is reported apart, and the steps that started while the write was still going are the row;
- `blocking`: `fzero.save(state, ...)` (its time is reported apart), then the steps.

Every save writes a new checkpoint (sha256, fsync unless `--no-fsync`, atomic) to `--dir`, removed after its
round. Prints medians over the rounds (rank 0's times; the ranks step in lockstep), and each row's ratio to `steps`.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_background.py --rounds 5`
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fzero
from benchmarks.compare import LR, WD, batches, lm_loss, make_model
from fzero.host import process_group

VARIANTS = ("steps", "steps again", "background", "blocking")


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    process_group.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = fzero.DistMesh()
    model = make_model()
    preset = {1: fzero.zero1, 2: fzero.zero2, 3: fzero.zero3}[args.stage]
    tx = preset(fzero.adamw(LR, weight_decay=WD))
    state = fzero.init(model, tx, mesh)
    model.to("meta")  # (the state holds the parameters)

    def loss_fn(params, b):
        return lm_loss(fzero.call(model, params, b["x"]), b["y"])

    train = fzero.train_step(model, loss_fn, tx, mesh, donate=True)
    data = batches(rank, 8)
    i = 0

    def steps(n: int, handle=None) -> list[tuple[float, bool]]:
        nonlocal state, i
        out = []
        for _ in range(n):
            writing = handle is not None and not handle.done()
            t0 = time.perf_counter()
            state, _ = train(state, data[i % len(data)])
            out.append((time.perf_counter() - t0, writing))
            i += 1
        return out

    steps(2)  # warm-up
    rows: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "save call", "blocking save", "overlapped")}
    order = random.Random(0)
    for r in range(args.rounds):
        root = Path(args.dir) / f"round{r}"
        variants = list(VARIANTS)
        order.shuffle(variants)
        for v in variants:
            dist.barrier()
            if v.startswith("steps"):
                rows[v].append(statistics.median(t for t, _ in steps(args.steps)))
            elif v == "blocking":
                t0 = time.perf_counter()
                fzero.save(state, root, mesh=mesh, tag=f"b{i}", fsync=args.fsync)
                rows["blocking save"].append(time.perf_counter() - t0)
                rows[v].append(statistics.median(t for t, _ in steps(args.steps)))
            else:
                t0 = time.perf_counter()
                handle = fzero.save(state, root, mesh=mesh, tag=f"a{i}", blocking=False, fsync=args.fsync)
                rows["save call"].append(time.perf_counter() - t0)
                timed = steps(args.steps, handle)
                during = [t for t, w in timed if w]
                handle.wait()
                rows["overlapped"].append(len(during))
                rows[v].append(statistics.median(during) if during else float("nan"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        report(rows, args, handle.staged_bytes)
    dist.barrier()
    process_group.shutdown()


def report(rows: dict[str, list[float]], args: argparse.Namespace, staged: int) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    base = med["steps"]
    print(f"27.3M GPT, fzero core stage {args.stage}, fp32, 2 gloo ranks x 1 thread, default malloc; median of "
          f"{args.rounds} rounds x {args.steps} steps; staged copy {staged / 2**20:.0f} MiB/rank; "
          f"fsync={args.fsync}")  # fmt: skip
    print("| variant | step s | vs steps | rounds min-max s |")
    print("|---|---|---|---|")
    for v in VARIANTS:
        vals = [x for x in rows[v] if x == x]
        lo, hi = (min(vals), max(vals)) if vals else (float("nan"),) * 2
        print(f"| {v} | {med[v]:.3f} | {med[v] / base:.2f}x | {lo:.3f}-{hi:.3f} |")
    aa = abs(med["steps again"] / base - 1)
    print(f"A/A spread (steps again vs steps): {aa * 100:.1f}%")
    print(f"background save: call (copy to host memory) {med['save call']:.3f} s, steps overlapping the write "
          f"{med['overlapped']:.0f} of {args.steps}")  # fmt: skip
    print(f"blocking save: {med['blocking save']:.2f} s ({med['blocking save'] / base:.1f} steps)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps timed per variant and round")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--no-fsync", dest="fsync", action="store_false", help="save with fsync=False (both saves)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        store = os.path.join(tmp, "store")
        mp.start_processes(worker, args=(2, store, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()

"""Stage 3 against stage 2: step time on 2 gloo processes, prefetch on and off, in one run.

    .venv/bin/python benchmarks/zero3.py [--layers 8] [--d-model 256] [--steps 8] [--rounds 5]

The small GPT of `fzero.examples.gpt` (wider by default), AdamW, one rank's batch of 8 x 128 bytes per step. Every
variant runs in the same two processes, in alternating rounds (so machine noise hits them alike); each round
times `--steps` steps after a warm-up. Prints the median step time, its ratio to stage 2, the elements gathered at
peak and the communication per step in units of Psi.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch
from fzero.host import process_group

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike

VARIANTS = {
    "stage 2": (fzero.zero2, None),
    "stage 3, prefetch 1": (fzero.zero3, fzero.GatherPolicy(prefetch=1)),
    "stage 3, prefetch 0": (fzero.zero3, fzero.GatherPolicy(prefetch=0)),
}


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = fzero.DistMesh()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=4)
    model = GPT(cfg)
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(rank)
    batches = [sample_batch(tokens, 8, cfg.seq_len, gen) for _ in range(args.steps)]
    runs = {}
    for name, (preset, policy) in VARIANTS.items():
        tx = preset(fzero.adamw(1e-3))
        step = fzero.train_step(model, gpt_loss(model), tx, mesh, donate=True, gather=policy)
        runs[name] = [fzero.init(model, tx, mesh), step, []]
    for run in runs.values():  # warm-up
        run[0], _ = run[1](run[0], batches[0])
    psi = runs["stage 2"][0].layout.real_numel
    info = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for b in batches:
                run[0], metrics = run[1](run[0], b)
            run[2].append((time.perf_counter() - t0) / len(batches))
            comm = sum(e["elements"] for k, e in metrics["comm"].items() if k != "all_reduce")
            info[name] = (metrics["gathered_peak"], comm / psi)
    if rank == 0:
        print(f"GPT {psi / 1e6:.2f}M params, {args.layers} blocks, d_model {args.d_model}, 2 gloo ranks, "
              f"median of {args.rounds} rounds x {args.steps} steps")  # fmt: skip
        base = statistics.median(runs["stage 2"][2])
        for name, run in runs.items():
            med = statistics.median(run[2])
            peak, comm = info[name]
            print(f"  {name:22s} {med * 1e3:8.1f} ms/step  ratio {med / base:.3f}  gathered peak "
                  f"{peak / psi:.2f} Psi  comm {comm:.2f} Psi")  # fmt: skip
    process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(2, f"{tmp}/store", args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()

"""The main job: train the small GPT on the bundled corpus with fzero, on the ranks `torchrun` started.

    torchrun --standalone --nproc_per_node 2 -m fzero.examples.train_gpt --stage 3

Each rank draws its own batches (seeded by rank), the step is `fzero.train_step` under the chosen ZeRO preset over
a `DistMesh` (gloo on CPU, NCCL on GPU), and rank 0 prints the loss, tokens/s and the bytes the collectives moved.
Without torchrun it runs as a single rank.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch

PRESETS = {0: fzero.zero0, 1: fzero.zero1, 2: fzero.zero2, 3: fzero.zero3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3, choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    mesh: fzero.Mesh = fzero.DistMesh() if distributed else fzero.SimMesh(world=1)
    rank, world = mesh.local_ranks[0], mesh.world
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)  # the same initial model on every rank (rank 0's is broadcast anyway)
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    model = GPT(cfg)
    peak, warmup = args.lr, max(1, args.warmup)
    tx = PRESETS[args.stage](
        fzero.adamw(lambda t: peak * min(1.0, (t + 1) / warmup), betas=(0.9, 0.95), weight_decay=0.1),
        accumulate=args.accumulate,
    )
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, gpt_loss(model), tx, mesh, donate=True)
    tokens = corpus_tokens()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    n_params = state.layout.real_numel
    say(
        f"fzero main job: GPT {n_params / 1e6:.2f}M params, ZeRO-{args.stage}, {world} rank(s) over {mesh!r}, "
        f"{args.batch}x{args.seq_len} tokens/rank/micro-step, accumulate {args.accumulate}"
    )
    tokens_per_step = args.batch * args.seq_len * args.accumulate * world
    losses: list[float] = []
    t0 = time.perf_counter()
    timed_from, timed_t0 = 2, None  # the first steps warm up allocators and are not timed
    for i in range(args.steps):
        if i == timed_from:
            timed_t0 = time.perf_counter()
        for _ in range(args.accumulate):
            batch = sample_batch(tokens, args.batch, args.seq_len, gen)
            if not distributed:
                batch = {k: v.unsqueeze(0) for k, v in batch.items()}
            state, metrics = step(state, batch)
        loss = float(metrics["loss"])
        losses.append(loss)
        if (i + 1) % args.log_every == 0 or i == 0:
            elapsed = time.perf_counter() - (timed_t0 or t0)
            done = i + 1 - (timed_from if timed_t0 else 0)
            comm = sum(e["elements"] for e in metrics["comm"].values())
            say(
                f"step {i + 1:4d}  loss {loss:.4f}  tokens/s {done * tokens_per_step / elapsed:9.0f}  "
                f"comm/step {comm / n_params:.2f} Psi"
            )
    total = time.perf_counter() - (timed_t0 or t0)
    timed_steps = args.steps - (timed_from if timed_t0 else 0)
    summary = {
        "first_loss": losses[0],
        "final_loss": sum(losses[-5:]) / len(losses[-5:]),
        "tokens_per_s": timed_steps * tokens_per_step / total,
    }
    say(
        f"done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the last 5 steps), "
        f"{summary['tokens_per_s']:.0f} tokens/s over {timed_steps} timed steps, "
        f"{time.perf_counter() - t0:.1f}s in all"
    )
    if distributed:
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()

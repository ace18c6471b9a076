"""Step overhead: fzero's stage-0 step against a plain PyTorch loop on one rank, in one run.

    .venv/bin/python benchmarks/step_overhead.py [--reps 7] [--steps 10]

Both train the same small GPT on the same batches: the plain loop does `loss.backward()` and
`torch.optim.AdamW(fused=True).step()`; fzero runs `train_step` under `zero0` on a one-rank `SimMesh`, with each
gradient engine (`autodiff="autograd"`, the default, and `"func"`), pure and with buffer donation. Rounds alternate
between the variants (so machine noise hits all alike); each round times `--steps` steps after a warm-up, and the
script prints the median time per step and its ratio to the plain loop.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike


def plain(model, batches):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loss_fn = torch.nn.functional.cross_entropy

    def run(n):
        for b in batches[:n]:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(b["x"]).flatten(0, 1), b["y"].flatten()).backward()
            opt.step()

    return run


def functional(model, batches, donate, autodiff):
    mesh = fzero.SimMesh(world=1)
    tx = fzero.zero0(fzero.adamw(1e-3))
    step = fzero.train_step(model, gpt_loss(model), tx, mesh, donate=donate, autodiff=autodiff)
    state = [fzero.init(model, tx, mesh)]
    sim = [{k: v.unsqueeze(0) for k, v in b.items()} for b in batches]

    def run(n):
        s = state[0]
        for b in sim[:n]:
            s, _ = step(s, b)
        state[0] = s

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(0)
    batches = [sample_batch(tokens, args.batch, cfg.seq_len, gen) for _ in range(args.steps)]
    runs = {
        "torch loop (AdamW fused)": plain(model, batches),
        "fzero (autograd, pure)": functional(model, batches, donate=False, autodiff="autograd"),
        "fzero (autograd, donate)": functional(model, batches, donate=True, autodiff="autograd"),
        "fzero (torch.func, pure)": functional(model, batches, donate=False, autodiff="func"),
        "fzero (torch.func, donate)": functional(model, batches, donate=True, autodiff="func"),
    }
    for run in runs.values():  # warm-up: allocator, first-call dispatch
        run(2)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT {n_params / 1e6:.2f}M params, batch {args.batch}x{cfg.seq_len}, {torch.get_num_threads()} threads, "
          f"median of {args.reps} rounds x {args.steps} steps")  # fmt: skip
    base = statistics.median(times["torch loop (AdamW fused)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:28s} {med * 1e3:8.2f} ms/step   ratio {med / base:.3f}")


if __name__ == "__main__":
    main()

"""Host time per step: fzero's core and engine at stages 0-3 against DDP, where the model's arithmetic is negligible.

    .venv/bin/python benchmarks/host_overhead.py [--precision fp32 bf16] [--rounds 11] [--steps 8] [--nproc 1]

A 12-layer GPT of width 32 (vocabulary 64, 2 x 8 tokens a step), on `--nproc` gloo processes of one thread each:
what is left of a step is each trainer's own Python and small operations, the host time that on a GPU the device
waits for whenever the host is behind it (`benchmarks/gpu.py` times the same trainers there). The trainers are
`benchmarks/compare.py`'s (`ddp`, `fzero-zeroN`: the functional core, `fzero-engine-zeroN`: `fzero.initialize`),
run in rotation, `--rounds` rounds of `--steps` steps after three warm-up steps; each figure is rank 0's process CPU
time per step (`time.process_time`: what this process computed, less sensitive than wall time to the other jobs of a
shared machine), the median over rounds, and its ratio to DDP's.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import compare  # (benchmarks/): its trainers (no process setting: what a user's script runs)
import torch
import torch.multiprocessing as mp

from fzero.examples.gpt import GPT, GPTConfig
from fzero.host import process_group

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=12, n_head=2, d_model=32)
MICRO = 2


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    compare.init(rank, world, store, 1)
    try:
        torch.manual_seed(0)
        template = GPT(CFG)
        g = torch.Generator().manual_seed(1 + rank)
        toks = torch.randint(0, CFG.vocab_size, (args.steps, MICRO, CFG.seq_len + 1), generator=g)
        data = [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]
        for precision in args.precision:
            built = {
                name: make(copy.deepcopy(template), precision) for name, make in compare.ddp_core_engine(MICRO).items()
            }
            for step in built.values():
                for batch in data[:3]:
                    step(batch)
            times: dict[str, list[float]] = {name: [] for name in built}
            order = list(built)
            for r in range(args.rounds):
                for name in compare.rotated(order, r):
                    t0 = time.process_time()
                    for batch in data:
                        built[name](batch)
                    times[name].append((time.process_time() - t0) / len(data))
            if rank == 0:
                base = statistics.median(times["ddp"])
                for name, t in times.items():
                    med = statistics.median(t)
                    print(f"{precision:5s} {name:20s} {med * 1e3:7.2f} ms  {med / base:5.2f}x DDP")
    finally:
        process_group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    print(f"GPT {sum(p.numel() for p in GPT(CFG).parameters()):,} params, {args.nproc} gloo rank(s) x 1 thread")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.nproc, f"{tmp}/store", args), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()

"""Step time on one CUDA GPU: fzero's core and engine (ZeRO stages 0-3, NCCL group of one) against DDP.

One process, one GPU, so this measures what fzero adds around the model's own kernels on a GPU (host work, syncs,
copies), not the collectives' speed: with one rank they move nothing. Trainers run in rotation, `--rounds` rounds of
`--steps` steps each after two warm-up steps, the median per trainer, and its ratio to DDP's in the same run.

    python benchmarks/gpu.py --precision bf16 fp32 --rounds 5 --steps 5
    python benchmarks/gpu.py --precision bf16 --diagnose     # per trainer: host syncs a step, the top kernels

`--diagnose` (instead of timing) runs each trainer's step once more with `torch.cuda.set_sync_debug_mode("warn")`,
counting the host synchronizations it makes (each one empties the launch queue: the GPU idles while the host
catches up), then profiles two steps and prints the five largest CUDA kernels and host operations by their own time.

The trainers are `benchmarks/compare.py`'s (`ddp`, `fzero_core`, `fzero_engine`: the same optimizer and settings, on
the model's device); importing it changes no process setting (compare.py's `--tuned` rows run in their own).
Needs CUDA (`DS_ACCELERATOR` is set to `cuda` here); CI has none, docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

os.environ["DS_ACCELERATOR"] = "cuda"  # before compare.py, which would set the CPU

import compare  # (benchmarks/): its trainers, which follow the model's device
import torch

from fzero.examples.gpt import GPT, GPTConfig
from fzero.host import process_group

CFG = GPTConfig(vocab_size=32000, seq_len=512, n_layer=12, n_head=12, d_model=768)
MICRO = 8


def model_and_data(steps: int) -> tuple[GPT, list[dict[str, torch.Tensor]]]:
    """The template model on the GPU (seed 0) and `steps` micro-batches of `MICRO` x `seq_len` tokens."""
    torch.manual_seed(0)
    template = GPT(CFG).cuda()
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, CFG.vocab_size, (steps, MICRO, CFG.seq_len + 1), generator=g).cuda()
    return template, [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]


def measure(precision: str, rounds: int, steps: int) -> dict[str, float]:
    template, data = model_and_data(steps)
    built = {name: make(copy.deepcopy(template), precision) for name, make in compare.ddp_core_engine(MICRO).items()}
    for step in built.values():
        step(data[0])
        step(data[1 % steps])
    times: dict[str, list[float]] = {name: [] for name in built}
    order = list(built)
    for r in range(rounds):
        for name in compare.rotated(order, r):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for batch in data:
                built[name](batch)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def diagnose(precision: str, steps: int) -> None:
    import warnings

    from torch.profiler import ProfilerActivity, profile

    template, data = model_and_data(max(steps, 2))
    for name, make in compare.ddp_core_engine(MICRO).items():
        step = make(copy.deepcopy(template), precision)
        step(data[0])
        step(data[1])
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(data[0])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for batch in data[:2]:
                step(batch)
            torch.cuda.synchronize()
        events = prof.key_averages()
        print(f"{precision} {name}: {syncs} host synchronization(s) a step")
        for key, what in (("self_device_time_total", "CUDA"), ("self_cpu_time_total", "host")):
            top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:5]
            print(f"    {what}: " + "; ".join(f"{e.key[:40]} {getattr(e, key) / 2e3:.2f} ms" for e in top))
        del step
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", nargs="+", default=["bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--diagnose", action="store_true", help="host syncs and top kernels per trainer, no timing")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        process_group.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            n = sum(p.numel() for p in GPT(CFG).parameters())
            print(f"{torch.cuda.get_device_name()}, GPT {n / 1e6:.1f}M params, {MICRO}x{CFG.seq_len} tokens a step")
            for precision in args.precision:
                if args.diagnose:
                    diagnose(precision, args.steps)
                    continue
                med = measure(precision, args.rounds, args.steps)
                base = med["ddp"]
                for name, t in med.items():
                    print(f"{precision:5s} {name:20s} {t * 1e3:8.2f} ms  {t / base:5.2f}x DDP")
        finally:
            process_group.shutdown()


if __name__ == "__main__":
    main()

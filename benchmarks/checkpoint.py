"""Checkpoint throughput: `fzero.save` / `fzero.load` against `torch.save` / `torch.load` of the same tensors.

The state: an MLP of `--layers` square layers of width `--width` (each a unit), ZeRO-2 with AdamW on a 2-rank
`SimMesh`: master shards, the full compute copy (stored once, split over the ranks' files), two Adam moments.
The baseline writes the very tensors fzero's files hold (the same bytes) with `torch.save` into one file, and reads
them back with `torch.load` (`weights_only=True`, the safe mode). fzero's numbers include what torch's do not:
sha256 of every byte (on save and, with verification, on load), fsync of every file and directory, the atomic
rename. Each round runs every variant once, in a shuffled order; the table shows medians, MB/s over the state's
bytes, and the ratio to the matching torch variant. Files are read back from the page cache (both sides alike).
Also measured: the consolidation's peak anonymous memory against the largest unit (it streams one unit at a time).

Run: `PYTHONPATH=. .venv/bin/python benchmarks/checkpoint.py` (defaults: 8 layers of 2048, 403 MB saved).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

import fzero
from fzero.checkpoint import Checkpoint


def build(width: int, layers: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(width, width) for _ in range(layers)]))
    tx = fzero.zero2(fzero.adamw(1e-3))
    state = fzero.init(model, tx, fzero.SimMesh(world))
    g = torch.Generator().manual_seed(1)
    adam = state.tx_state["shard_update"]
    exp_avg = torch.randn(adam.exp_avg.shape, generator=g)  # non-zero moments, as after training
    adam = adam._replace(exp_avg=exp_avg, exp_avg_sq=exp_avg.abs())
    return model, tx, state.replace(tx_state={**state.tx_state, "shard_update": adam})


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Exactly the tensors fzero's files hold (all ranks), as owned copies."""
    with Checkpoint(path) as ckpt:
        return {
            f"{r}/{k}": ckpt.read(k, r).clone()
            for r in range(ckpt.manifest.world)
            for k, e in ckpt.entries.items()
            if e.in_file(r)
        }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_save(tensors, path: Path, fsync: bool) -> None:
    torch.save(tensors, path)
    if fsync:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())


def peak_anon_mib(fn) -> tuple[float, float]:
    """(peak RssAnon growth in MiB while `fn` runs, seconds), sampled every 2 ms."""

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))

    base, peak, stop = anon(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    seconds = timed(fn)
    stop.set()
    t.join()
    return (max(peak[0], anon()) - base) / 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tx, state = build(args.width, args.layers, args.world)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="fzero-ckpt-bench-"))
    try:
        path = fzero.save(state, work / "ckpt", tag="t")
        tensors = stored_tensors(path)
        mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
        like = fzero.init(model, tx, fzero.SimMesh(args.world))
        baseline = work / "state.pt"

        torch_save(tensors, baseline, fsync=True)
        # every save writes new files, as a training loop saving step after step does (rewriting one file in place
        # lets the file system reuse its blocks: faster, and not what a checkpoint does); old files are removed
        # between rounds, outside the timing
        fresh = work / "fresh"
        variants = {
            "save: torch.save": lambda: torch_save(tensors, fresh / "state.pt", fsync=False),
            "save: torch.save + fsync": lambda: torch_save(tensors, fresh / "state.pt", fsync=True),
            "save: fzero.save (sha256, fsync, atomic)": lambda: fzero.save(state, fresh, tag="t"),
            "save: fzero.save, fsync=False": lambda: fzero.save(state, fresh, tag="t", fsync=False),
            "load: torch.load (weights_only)": lambda: torch.load(baseline, weights_only=True),
            "load: fzero.load (verify sha256)": lambda: fzero.load(path, like),
            "load: fzero.load, verify=False": lambda: fzero.load(path, like, verify=False),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        order = list(variants)
        for _ in range(args.rounds):
            random.Random(len(times[order[0]])).shuffle(order)  # no variant always runs after the same one
            for name in order:
                fn = variants[name]
                shutil.rmtree(fresh, ignore_errors=True)
                fresh.mkdir()
                os.sync()  # start every variant with no dirty pages of the previous one in flight
                times[name].append(timed(fn))

        print(f"state: {mb:.0f} MB saved ({args.layers} units of {args.width}x{args.width}, ZeRO-2 AdamW, world "
              f"{args.world}); median of {args.rounds} rounds, shuffled")  # fmt: skip
        print(f"| {'variant':<44} | {'s':>6} | {'min-max s':>11} | {'MB/s':>6} | vs torch |")
        print(f"|{'-' * 46}|{'-' * 8}|{'-' * 13}|{'-' * 8}|{'-' * 10}|")
        ref = {
            "save": statistics.median(times["save: torch.save"]),
            "load": statistics.median(times["load: torch.load (weights_only)"]),
        }
        for name, ts in times.items():
            m = statistics.median(ts)
            spread = f"{min(ts):.2f}-{max(ts):.2f}"
            print(f"| {name:<44} | {m:6.3f} | {spread:>11} | {mb / m:6.0f} | {ref[name[:4]] / m:8.2f}x |")

        unit_mib = (args.width * args.width + args.width) * 4 / 2**20
        peak, seconds = peak_anon_mib(lambda: fzero.checkpoint.write_consolidated(path, work / "model.safetensors"))
        print(f"consolidate to one file: {seconds:.2f}s, peak anonymous memory +{peak:.0f} MiB "
              f"(largest unit {unit_mib:.0f} MiB, all parameters {unit_mib * args.layers:.0f} MiB)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

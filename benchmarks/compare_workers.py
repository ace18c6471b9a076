"""`benchmarks/compare.py`'s worker processes: the timed rotation (every trainer in one pair of processes), the
profile, and each trainer alone in a fresh pair (its peak memory and its first steps).

Each worker is started by `torch.multiprocessing.start_processes` (spawn), one per rank, and rank 0 writes its
results as JSON beside the process group's store file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from compare_trainers import (
    CFG,
    COLLECTIVE_TIMEOUT_S,
    TUNING,
    batches,
    build_all,
    has_ledger,
    rotated,
    step_ledger,
)

from fzero.host import process_group


def init(rank: int, world: int, store: str, threads: int) -> None:
    """This process's gloo group (rank `rank` of `world`, rendezvous at file `store`) and its `threads` threads."""
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what launchers set
    # a rank whose peer is gone fails within minutes rather than gloo's default half hour: the run ends, naming it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip


def release(steps: dict) -> None:
    """The worker's end: drops its trainers while the process group is alive, then shuts the group down (not
    `destroy_process_group`: see `fzero.host.process_group`). A DDP whose reducer outlives the group frees the gloo
    group itself, holding the GIL, while gloo's threads wait for the GIL to free a finished collective's tensors: a
    worker hung at its exit that way (2026-11-29, DDP alone in fresh processes; `gdb`: `~ProcessGroupGloo` under the
    `Reducer`'s dealloc)."""
    steps.clear()
    gc.collect()  # the trainers' closures and modules hold cycles
    process_group.shutdown()


def time_worker(
    rank: int, world: int, store: str, args: argparse.Namespace, precision: str, n_layer: int = CFG.n_layer
) -> None:
    """`args.only` in one pair of processes, in rotating order: two warm-up steps each, then `args.rounds` rounds of
    `args.steps` steps each; rank 0 writes `times-{precision}.json` (medians over the rounds, wall and CPU)."""
    init(rank, world, store, args.threads)
    steps: dict = {}
    try:
        steps, skipped = build_all(args.only, precision, n_layer)
        data = batches(rank, args.steps)
        for step in steps.values():  # warm-up: two steps each
            step(data[0])
            step(data[1 % len(data)])
        times: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for r in range(args.rounds):
            for name in rotated(order, r):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for batch in data:
                    steps[name](batch)
                c1 = time.process_time()  # (before the barrier: the CPU this rank's steps took, its threads' too)
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / len(data))
                cpu[name].append((c1 - c0) / len(data))
        comm = {name: step_ledger(name, precision, data, n_layer) for name in steps if args.comm and has_ledger(name)}
        if rank == 0:
            result = {name: statistics.median(t) for name, t in times.items()}
            cpu_median = {name: statistics.median(t) for name, t in cpu.items()}
            with open(os.path.join(os.path.dirname(store), f"times-{precision}.json"), "w") as f:
                json.dump({"median": result, "all": times, "cpu": cpu_median, "skipped": skipped, "comm": comm,
                           "tuning": TUNING}, f)  # fmt: skip
    finally:
        release(steps)


PHASES = {  # torch profiler event names -> phase; the first matching pattern wins
    "communication (waiting)": ("c10d", "gloo", "wait", "all_to_all", "broadcast", "allreduce", "all_gather",
                                "reduce_scatter", "barrier"),
    "optimizer": ("adam", "fzero.shard_update", "fzero::"),
    "copies, casts, fills": ("copy_", "cat", "clone", "_to_copy", "fill_", "zero_", "contiguous", "stack", "index"),
}  # fmt: skip


def _phase(name: str) -> str:
    low = name.lower()
    for phase, patterns in PHASES.items():
        if any(p in low for p in patterns):
            return phase
    return "compute (other aten ops)" if low.startswith("aten::") else "other (autograd nodes, record_function)"


def profile_worker(rank: int, world: int, store: str, args: argparse.Namespace, precision: str) -> None:
    """Rank 0's per-phase split of a step: self CPU time of the profiler's events, by phase; the rest of the wall
    time (Python, waiting outside collectives) as "unaccounted"."""
    from torch.profiler import ProfilerActivity, profile

    init(rank, world, store, args.threads)
    steps: dict = {}
    try:
        steps, _ = build_all(args.only, precision)
        data = batches(rank, args.steps)
        for name, step in steps.items():
            step(data[0])
            step(data[1 % len(data)])
            dist.barrier()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for batch in data:
                    step(batch)
            wall = (time.perf_counter() - t0) / len(data)
            if rank == 0:
                split: dict[str, float] = {}
                for e in prof.key_averages():
                    if e.key.startswith("ProfilerStep") or "#" in e.key:
                        continue
                    split[_phase(e.key)] = split.get(_phase(e.key), 0.0) + e.self_cpu_time_total / 1e6 / len(data)
                split["unaccounted (Python, idle)"] = max(0.0, wall - sum(split.values()))
                cells = " | ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(split.items()))
                print(f"| {name} | {wall * 1e3:.0f} ms | {cells} |", flush=True)
                # fzero's own phases (record_function ranges; inclusive, so a nested range counts in its parent too)
                ranges = {e.key: e.cpu_time_total / 1e3 / len(data) for e in prof.key_averages()
                          if e.key.startswith("fzero.")}  # fmt: skip
                if ranges:
                    print(f"|   fzero phases | {' | '.join(f'{k} {v:.0f} ms' for k, v in sorted(ranges.items()))} |")
                ops = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")),
                             key=lambda e: -e.self_cpu_time_total)[:10]  # fmt: skip
                cells = " | ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / len(data):.1f} ms ({e.count // len(data)})"
                                   for e in ops)  # fmt: skip
                print(f"|   top ops (self ms a step, calls) | {cells} |", flush=True)
            # one more step for its large allocations (blocks a step maps or takes from the heap afresh), apart from
            # the timed ones: recording every allocation slows a step
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as allocs:
                step(data[0])
            if rank == 0:
                big = [e.self_cpu_memory_usage for e in allocs.events() if e.self_cpu_memory_usage >= 2 << 20]
                print(f"|   allocations of 2 MiB or more | {len(big)} a step, {sum(big) / 2**20:.0f} MiB |", flush=True)
    finally:
        release(steps)


def high_water_mib(reset: bool = False) -> float:
    """This process's peak resident set (`VmHWM`) in MiB since the last reset; with `reset`, a new one starts after
    it is read (Linux's `clear_refs`)."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return hwm


def alone_worker(
    rank: int, world: int, store: str, name: str, precision: str, threads: int, n_steps: int, n_layer: int = CFG.n_layer
) -> None:
    """Trainer `name` alone in a fresh pair of processes (`--memory`, `--first-steps`): builds it, then runs
    `n_steps` steps, each on a micro-batch of its own (`--fresh`: one round's run of a trainer).

    Rank 0 writes `alone-{name}-{precision}.json`: `peak` (MiB per rank over the process's life, the larger rank's;
    None for a skipped trainer), `built` and `stepped` (the peak while building the model and the trainer, and
    during the steps), `build_s` (wall time to build it), `steps_s` and `cpu_s` (rank 0's wall and process CPU time
    of each step, its threads' included) and `to_last_s`
    (from the trainer built to the end of the last step, both ranks there: the time a user waits for step
    `n_steps`), `skipped` (why it was not built, or None) and `tuning` (the process settings it ran with).
    """
    init(rank, world, store, threads)
    steps: dict = {}
    try:
        data = batches(rank, n_steps)  # (made before the clock starts; the same tokens as the timed rotation's)
        high_water_mib(reset=True)
        dist.barrier()
        t0 = time.perf_counter()
        steps, skipped = build_all([name], precision, n_layer)
        dist.barrier()
        built_at = time.perf_counter()
        phases = [high_water_mib(reset=True)]  # the model built and the trainer set up (fzero.init: the state)
        marks, cpu_marks = [built_at], [time.process_time()]
        for batch in data if name in steps else ():
            steps[name](batch)
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())
        dist.barrier()
        to_last = time.perf_counter() - built_at
        phases.append(high_water_mib())  # the steps
        life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, the process's whole life
        figures = torch.tensor([life, *phases])
        dist.all_reduce(figures, dist.ReduceOp.MAX)
        peak, built, stepped = figures.tolist()
        if rank == 0:
            print(f"alone: {name}: peak memory {peak:.0f} MiB; building the model and the trainer {built:.0f}, the "
                  f"{n_steps} steps {stepped:.0f} (the larger rank's)", flush=True)  # fmt: skip
            result = {
                "peak": peak if name in steps else None,
                "built": built,
                "stepped": stepped,
                "build_s": built_at - t0,
                "steps_s": [b - a for a, b in itertools.pairwise(marks)],
                "cpu_s": [b - a for a, b in itertools.pairwise(cpu_marks)],
                "to_last_s": to_last if name in steps else None,
                "skipped": skipped.get(name),
                "tuning": TUNING,
            }
            with open(os.path.join(os.path.dirname(store), f"alone-{name}-{precision}.json"), "w") as f:
                json.dump(result, f)
    finally:
        release(steps)

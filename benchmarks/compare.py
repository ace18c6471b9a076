"""fzero against DDP, FSDP2 and DeepSpeed: step time and peak memory, side by side, on 2 gloo processes (or
`--nproc`).

    .venv/bin/python benchmarks/compare.py [--precision fp32 bf16] [--rounds 5] [--steps 4] [--only NAME ...]
                                            [--memory] [--first-steps [10]] [--tuned [--default-malloc]]
                                            [--threads 1] [--profile] [--floor] [--nproc 2] [--comm] [--sweep 6,12,24]
                                            [--compile] [--fresh] [--json PATH]

The same model (a 27.3M-parameter 6-layer pre-LN transformer: `fzero.examples.gpt` with vocabulary 8192, width 512,
8 heads, an untied head), the same data (each rank its own micro-batch of 4 x 64 tokens) and the same optimizer
(AdamW, lr 1e-4, weight decay 0.01), under:

- `ddp`: `DistributedDataParallel` with torch's fused AdamW (bf16: `autocast`, fp32 parameters); `ddp-again`, the
  A/A row: the same, built a second time, timed in the same rotation (added beside `ddp`, in the middle of the
  rotation);
- `fsdp2-zeroN`: `fully_shard` on every block and the root (`reshard_after_forward=False` for ZeRO-2-like, True for
  ZeRO-3-like; bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), torch's AdamW;
- `deepspeed-zeroN`: DeepSpeed's engine with the same JSON config, when DeepSpeed is installed (`pip install
  ".[bench]"`; it runs on the CPU with `DS_ACCELERATOR=cpu`), `memory_efficient_linear` off (on, its default,
  DeepSpeed's stage 3 replaces `torch.nn.functional.linear` for the whole process: every trainer of the rotation would
  run through DeepSpeed's linear, as they did in the runs before 2026-11-28 evening that had a `deepspeed-zero3` row);
- `fzero-zeroN` (the functional core, `train_step(donate=True)`, the loss through `fzero.call`, its defaults: each
  unit's reduction overlapped with the backward on a mesh of several processes; the model moved to `meta` after
  `fzero.init`, which copies its parameters into the state), `fzero-zeroN-serial` (the same, each reduction waited for:
  `GatherPolicy(overlap_reduce=False)`), `fzero-zeroN-fresh` (stages 0-2: the same, every step-sized buffer fresh:
  `fzero.scratch.disabled()`), `fzero-zeroN-rooted` (stages 2-3: the same with the embedding and the head in the
  root unit, `units="module_list"`, the default layout before 2026-11-29) and `fzero-engine-zeroN`
  (`fzero.initialize`, the config's defaults; its module's parameters then views of the state's at stages 0-2, empty
  at stage 3: no fzero trainer keeps the model's copy);
  at stage 3 both gather every unit again for its backward but the last (`GatherPolicy(reuse_distance=0)`,
  `stage3_max_reuse_distance` unset); `fzero-zero3-keep` and `fzero-engine-zero3-keep` keep every unit of this model
  gathered from its forward into its backward (a distance of 1e9, DeepSpeed's default: a gather fewer per unit, the
  whole model gathered at the forward's end);
- ZeRO++ and hybrid sharding at stage 3, on `DistMesh(shape={"replicate": nproc // 2, "shard": 2})` (a shard group
  of 2 consecutive ranks standing for a node): `fzero-hybrid3` (`zero3(hybrid=True)`: sharded over `shard`,
  averaged over `replicate`), and sharded over all ranks `fzero-hpz3` (`hpz=True`), `fzero-qwz3` (`qwz=True`),
  `fzero-qgz3` (`qgz=True`), `fzero-zero++3` (all three). They run only when named in `--only` (an even `--nproc`),
  e.g. `--nproc 4 --only ddp fzero-zero3 fzero-hybrid3 fzero-hpz3 fzero-qwz3 fzero-qgz3 fzero-zero++3`.

No process makes a `fzero.hostmem` call by default: the rows measure what a user's own script gets (`import fzero`
changes no process setting; `fzero train` makes the tuned ones). `--tuned` adds the tuned rows: the same trainers in a
second pair of processes, started after the first, that ask for huge pages and keep the memory their steps free for
the next step (`fzero.hostmem.enable_huge_pages()` and `retain_freed_memory()` at import, before the first tensor:
both are process-wide, so they cannot share a pair with the default rows), printed as `<trainer>-tuned` with their
own DDP and A/A rows, each row's ratio to the tuned DDP and to the plain DDP (the latter across two pairs of
processes), and the tuning's gain on the trainer (its plain row over its tuned one). `--default-malloc` (only with
`--tuned`) keeps glibc's malloc in the tuned pair: huge pages alone (`FZERO_BENCH_MALLOC=default`; the default rows
never tune it).

Every ratio stands beside the run's own A/A spread, `|ddp-again / ddp - 1|` (two identical DDPs' medians in the same
rotation: what this run's noise alone does to a ratio), and the table says which rows are "within the A/A spread" of
DDP (their ratio to DDP within 1 +- the spread: this run cannot tell them from DDP), for the wall time and the CPU
time apart.

Every trainer lives in the same processes and runs in rotating order, round after round (machine noise hits them
alike); each round times `--steps` steps after two warm-up steps. Shared processes share an allocator and its state
(glibc raises its mmap threshold when a large mapped block is freed), so a trainer's speed there may depend on those
built and timed beside it. `--fresh` times what a user's process runs instead, one trainer: each round starts every
trainer alone in a fresh pair of processes, in rotating order, and takes the median of its `--steps` steps after 3
warm-up steps (the A/A row: two DDPs, each in its own fresh pairs); it costs a start and a build per trainer and
round (~12 s with 11 steps on a shared 2-core machine), and takes neither `--sweep`, `--profile` nor `--comm`. With
`--first-steps` the same runs also give the time to step N (the round with the median one). Prints the median step
time per trainer, its ratio to DDP's, rank 0's process CPU time per step (`time.process_time`: its threads', gloo's
included; on a machine whose cores the ranks fill, a step costs what its CPU time costs) and its ratio to DDP's,
with `--floor` its ratio to the floor (the same model's forward + backward alone, without communication or
optimizer, plus the update alone over a 1/W share of the parameters: the physical limit of a ZeRO step on this
machine; `floor-fwdbwd` and `floor-update` are timed in the same rotation), and with `--memory` the peak resident
memory per rank of each trainer run alone in a fresh pair of processes (the table: over the process's life; a line
per trainer also splits it into building the model and the trainer, `fzero.init` for fzero's, and its steps: 3
steps, or `--first-steps`' N). `--first-steps [N]` (N: 10 when not given) times the first steps in those same fresh
pairs: the wall time from the trainer built to the end of step N (a micro-batch each, both ranks there), each
trainer's ratio to DDP's beside the fresh runs' own A/A spread (`ddp-again` alone against `ddp` alone), N times the
steady median beside it, and rank 0's time of each step. It costs one fresh pair of processes per trainer (and per
`-tuned` trainer): the start and imports (~5 s), the build (3 s for fzero's, 7-10 s for DDP's on a shared 2-core
AVX2 machine) and N steps: about 35 s a trainer there in fp32 at 6 layers (2.4 s a step under the other jobs' load);
with `--memory` both come from the same fresh pairs (its steps phase then covers the N steps). `--profile` prints
instead rank 0's per-phase split of a step (compute, waiting on communication, optimizer, copies; the profiler's
self CPU time, the rest of the wall time unaccounted), and for fzero's steps the time inside each of its
`record_function` phases (`fzero.gather`, `fzero.forward_backward`, `fzero.reduce`, `fzero.update`, `fzero.agree`;
the engine's `fzero.forward`, `fzero.backward`), its ten costliest aten ops (self time and calls a step), and the
count and total size of one step's allocations of 2 MiB or more (`torch.profiler`'s `profile_memory`, in a step of
their own). On a machine the ranks' threads fill, an op's self time includes the time its thread waited for a core
(gloo's threads run on the same cores): a small op can show tens of milliseconds.

`--nproc N` runs N processes instead of 2 (`--rounds` and `--steps` then default to 3 and 2: on this 2-core machine
4 processes share the cores). With `--comm`, or whenever a 2-D trainer above runs, every `fzero-zeroN*` and 2-D row
also gets the bytes per step per rank of one step (rank 0's ledger, the step after one warm-up step, every trainer
on the same 2-D `DistMesh`: a 1-D `DistMesh` records no bytes, and the 1-D trainers' collectives over all ranks are
the same on it): the payload per axis (`world`: over all ranks) and the bytes received from outside the rank's
shard group (`fzero.mesh.Ledger.crossing(shape, "shard")`: the slow, cross-node share when a shard group is a node),
with `fzero-zero3`'s cross-node bytes over the row's.

`--compile` adds, right after each row, its compiled twin `NAME-compiled` where it has one: DDP on
`torch.compile(model)`, FSDP2 with each block compiled under `fully_shard` (`block.compile()`, torchtitan's way),
DeepSpeed's `engine.compile()`, fzero's core with `train_step(compile=True)` and its engine with `engine.compile()`
(each unit compiled: `fzero.sharding.compile`), all with inductor; the first steps, which compile, are the warm-up.
With `ddp-compiled` comes `ddp-again-compiled`, the compiled A/A row, and a second table: each compiled row against
DDP compiled, beside that A/A spread, and against its eager twin, each also round by round.

`--json PATH` also writes every round's figures (by precision and trainer, with the command line) to PATH, for
ratios the tables do not print (one row over another, round by round).

`--sweep 6,12,24` repeats the run for each layer count (the model otherwise the same; `--only` then defaults to
`ddp fsdp2-zero3 deepspeed-zero3 fzero-zero3 fzero-engine-zero3`): each size is timed in its own processes, every
row as a ratio to DDP's in the same run, and with `--memory` each trainer alone per size. It prints one table per
metric, a row per trainer and a column per size, with each row's ratio-to-DDP trend from the smallest to the largest
size (flat: within 5%) and, for the fzero rows, whether their peak RSS is at most FSDP2's and DeepSpeed's at stage 3
at every size. A memory worker that dies is named and its cell left empty rather than ending the sweep.

The trainers (and the model, the data, the tuned settings) are in `benchmarks/compare_trainers.py`, the worker
processes in `benchmarks/compare_workers.py`, the tables in `benchmarks/compare_report.py`; this module re-exports
the names other benchmarks import from it (`make_model`, `batches`, `lm_loss`, `LR`, `WD`, `init`,
`ddp_core_engine`, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, also as `benchmarks.compare`

import torch.multiprocessing as mp
from compare_report import Run, n_params, report, report_comm, report_sweep, spread, trend, within, within_peers
from compare_trainers import (
    AGAIN,
    CFG,
    COLLECTIVE_TIMEOUT_S,
    COMPILED,
    FLOOR,
    LR,
    MALLOC,
    MICRO,
    PEERS3,
    SWEEP,
    TUNED,
    TUNING,
    WD,
    ZEROPP3,
    Step,
    apply_tuning,
    batches,
    build_all,
    ddp,
    ddp_core_engine,
    deepspeed_engine,
    device_type,
    ds_config,
    floor_forward_backward,
    floor_update,
    fresh_buffers,
    fsdp2,
    fzero_core,
    fzero_engine,
    grid,
    grid_mesh,
    has_ledger,
    lm_loss,
    make_model,
    rotated,
    step_ledger,
    trainers,
)
from compare_workers import alone_worker, high_water_mib, init, profile_worker, time_worker

__all__ = [  # the names other benchmarks import from here (re-exported from the modules above)
    "AGAIN", "CFG", "COLLECTIVE_TIMEOUT_S", "FLOOR", "LR", "MALLOC", "MICRO", "PEERS3", "SWEEP", "TUNED", "TUNING",
    "WD", "ZEROPP3", "Run", "Step", "alone_worker", "apply_tuning", "batches", "build_all", "ddp", "ddp_core_engine",
    "deepspeed_engine", "device_type", "ds_config", "floor_forward_backward", "floor_update", "fresh_buffers",
    "fsdp2", "fzero_core", "fzero_engine", "grid", "grid_mesh", "has_ledger", "high_water_mib", "init",
    "layer_counts", "lm_loss", "main", "make_model", "measure", "n_params", "profile_worker", "report",
    "report_comm", "report_sweep", "rotated", "spread", "step_ledger", "time_worker", "trainers", "trend",
    "tuned_processes", "within", "within_peers",
]  # fmt: skip


def layer_counts(text: str) -> list[int]:
    """`--sweep`'s layer counts: "6,12,24" -> [6, 12, 24]."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep takes layer counts separated by commas (6,12,24), got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--sweep takes positive layer counts, got {text!r}")
    return counts


@contextlib.contextmanager
def tuned_processes(tuned: bool, default_malloc: bool) -> Iterator[None]:
    """Within: the worker processes started ask for the tuned settings at import (`tuned`: `FZERO_BENCH_TUNED=1`;
    with `default_malloc`, huge pages alone), or for none; the environment is restored after. This process never
    applies them: it only starts the workers."""
    saved = {key: os.environ.get(key) for key in (TUNED, MALLOC)}
    for key in (TUNED, MALLOC):
        os.environ.pop(key, None)
    if tuned:
        os.environ[TUNED] = "1"
        if default_malloc:
            os.environ[MALLOC] = "default"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(tmp: str, precision: str, args: argparse.Namespace, n_layer: int = CFG.n_layer) -> Run:
    """Times `args.only` together in one pair of processes (with `--fresh`, each alone in fresh pairs, round after
    round) and, with `--memory` or `--first-steps`, runs each alone in a fresh pair.

    Args:
      tmp: an empty folder for the process-group stores and the workers' result files.
      precision: "fp32" or "bf16".
      args: the parsed command line.
      n_layer: the model's layer count.

    Returns:
      `{"times": ..., "alone": ...}`: the time worker's results (`median`, `all`, `cpu`, `skipped`, `comm`,
      `tuning`) and, by trainer, the alone worker's (`peak` MiB per rank, `build_s`, `steps_s`, `to_last_s`: None
      for one skipped, or, under `--sweep`, one whose worker died).
    """
    if args.fresh:
        return measure_fresh(tmp, precision, args)
    store = os.path.join(tmp, f"store-{precision}")
    mp.start_processes(time_worker, args=(args.nproc, store, args, precision, n_layer), nprocs=args.nproc,
                       start_method="spawn")  # fmt: skip
    with open(os.path.join(tmp, f"times-{precision}.json")) as f:
        times = json.load(f)
    alone: dict[str, dict] = {}
    n_steps = args.first_steps or 3
    for name in times["median"] if args.memory or args.first_steps else ():
        sized = f", {n_layer} layers" if args.sweep else ""
        print(f"alone: {name} ({precision}{sized})", flush=True)  # a worker that dies is named
        try:
            alone[name] = run_alone(tmp, name, precision, args, n_steps, n_layer)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if not args.sweep:
                raise
            print(f"alone: {name} ({precision}{sized}): the worker died: {e}", flush=True)  # keep the sweep
            alone[name] = {"peak": None, "to_last_s": None}
    return {"times": times, "alone": alone}


def run_alone(tmp: str, name: str, precision: str, args: argparse.Namespace, n_steps: int, n_layer: int) -> dict:
    """Trainer `name` alone in a fresh pair of processes for `n_steps` steps: the alone worker's JSON."""
    store = os.path.join(tmp, f"store-alone-{name}-{precision}")
    mp.start_processes(alone_worker, args=(args.nproc, store, name, precision, args.threads, n_steps, n_layer),
                       nprocs=args.nproc, start_method="spawn")  # fmt: skip
    with open(os.path.join(tmp, f"alone-{name}-{precision}.json")) as f:
        return json.load(f)


FRESH_WARMUP = 3
"""`--fresh`'s warm-up steps in each fresh pair (the user script's): a fresh process's first steps build its heap."""


def measure_fresh(tmp: str, precision: str, args: argparse.Namespace) -> Run:
    """`--fresh`: each trainer of `args.only` alone in a fresh pair of processes, as a user's script runs one,
    `args.rounds` rounds in rotating order (machine noise hits them alike); a round's figure is the median of its
    `args.steps` steps after `FRESH_WARMUP`, wall and CPU time (rank 0's).

    Returns:
      `measure`'s `{"times", "alone"}`: `times` the median over the rounds (`all`: each round's), `alone` by trainer
      the round whose time to step `--first-steps` (else to its last timed step) is the median, with the highest
      peak of the rounds.
    """
    n_first = args.first_steps or FRESH_WARMUP + args.steps
    n_steps = max(n_first, FRESH_WARMUP + args.steps)
    timed = slice(FRESH_WARMUP, FRESH_WARMUP + args.steps)
    order = list(args.only)
    rounds: dict[str, list[dict]] = {name: [] for name in order}
    for r in range(args.rounds):
        for name in rotated(order, r):
            print(f"fresh: round {r + 1}/{args.rounds}: {name} ({precision})", flush=True)
            os.makedirs(folder := os.path.join(tmp, f"round-{r}"), exist_ok=True)
            rounds[name].append(run_alone(folder, name, precision, args, n_steps, CFG.n_layer))
    skipped = {name: runs[0]["skipped"] for name, runs in rounds.items() if runs[0]["skipped"]}
    kept = {name: runs for name, runs in rounds.items() if name not in skipped}
    wall = {name: [statistics.median(a["steps_s"][timed]) for a in runs] for name, runs in kept.items()}
    cpu = {name: [statistics.median(a["cpu_s"][timed]) for a in runs] for name, runs in kept.items()}
    alone = {}
    for name, runs in kept.items():
        for a in runs:  # the time to step n_first, rank 0's steps (the worker's last barrier is past step n_steps)
            a["to_last_s"], a["steps_s"] = sum(a["steps_s"][:n_first]), a["steps_s"][:n_first]
        middle = sorted(runs, key=lambda a: a["to_last_s"])[len(runs) // 2]
        alone[name] = {**middle, "peak": max(a["peak"] for a in runs)}
    times = {
        "median": {name: statistics.median(t) for name, t in wall.items()},
        "all": wall,
        "cpu": {name: statistics.median(t) for name, t in cpu.items()},
        "skipped": skipped,
        "comm": {},
        "tuning": next(iter(rounds.values()))[0]["tuning"],  # the workers' (this process applies none)
    }
    return {"times": times, "alone": {**alone, **{name: {"peak": None, "to_last_s": None} for name in skipped}}}


def rotation(only: list[str]) -> list[str]:
    """`only` with the A/A rows: `ddp-again` in the middle of the rotation when `ddp` is there (and it is not), and
    `ddp-again-compiled` likewise beside `ddp-compiled`."""
    for base, again in (("ddp", AGAIN), ("ddp" + COMPILED, AGAIN + COMPILED)):
        if base in only and again not in only:
            middle = (len(only) + 1) // 2
            only = [*only[:middle], again, *only[middle:]]
    return only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --nproc above 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 4 (2 with --nproc above 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="+", default=None, choices=list(trainers()),
                        help="default: every 1-D trainer (with --sweep: " + " ".join(SWEEP) + "); ddp brings "
                        "ddp-again, the A/A row")  # fmt: skip
    parser.add_argument("--floor", action="store_true",
                        help="also time the floor (forward + backward alone, ZeRO's share of the update alone) and "
                        "print every row's ratio to their sum")  # fmt: skip
    parser.add_argument("--memory", action="store_true", help="also peak RSS per rank, each trainer alone")
    parser.add_argument("--first-steps", type=int, nargs="?", const=10, default=0, metavar="N",
                        help="also the time to step N (default 10), each trainer alone in fresh processes")  # fmt: skip
    parser.add_argument("--tuned", action="store_true",
                        help="also the -tuned rows: a second pair of processes with fzero.hostmem's huge pages and "
                        "freed memory kept")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="instead of timing: rank 0's per-phase profile")
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (the 2-D trainers: an even number)")
    comm_help = "also the fzero rows' bytes per step, per axis and cross-node (on with a 2-D row)"
    parser.add_argument("--comm", action="store_true", help=comm_help)
    parser.add_argument("--sweep", type=layer_counts, default=None, metavar="L1,L2,...",
                        help="repeat for each layer count; one table per metric, a column per size")  # fmt: skip
    parser.add_argument("--default-malloc", action="store_true",
                        help="with --tuned: the -tuned rows keep glibc's malloc (huge pages alone)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true",
                        help="time each trainer alone in a fresh pair of processes, round after round (as a user's "
                        f"script runs one), its --steps after {FRESH_WARMUP} warm-up steps")  # fmt: skip
    parser.add_argument("--compile", action="store_true",
                        help="also each row's compiled twin (NAME-compiled) beside it, where it has one")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the run's figures (every round's, by precision) to PATH as JSON")  # fmt: skip
    args = parser.parse_args()
    if args.default_malloc and not args.tuned:
        parser.error("--default-malloc changes the -tuned rows (the default rows never tune malloc): add --tuned")
    if args.sweep and args.profile:
        parser.error("--sweep times and measures memory; --profile profiles one size: give one of them")
    if args.sweep and (args.tuned or args.first_steps):
        parser.error("--sweep takes neither --tuned nor --first-steps: run them at one size")
    if args.fresh and (args.sweep or args.profile or args.comm):
        parser.error("--fresh times each trainer in its own processes; --sweep, --profile and --comm use the shared "
                     "rotation: give one or the other")  # fmt: skip
    if args.first_steps < 0:
        parser.error(f"--first-steps takes a positive step count, got {args.first_steps}")
    if args.only is None:
        eager = [n for n in trainers() if n not in FLOOR and n not in ZEROPP3 and not n.endswith(COMPILED)]
        args.only = list(SWEEP) if args.sweep else eager
    if args.compile:  # each compiled twin right after its eager row
        args.only = [m for n in args.only for m in (n, n + COMPILED) if m == n or m in trainers()]
    args.only = rotation(list(dict.fromkeys(args.only)))
    if args.rounds is None:
        args.rounds = 5 if args.nproc <= 2 else 3
    if args.steps is None:
        args.steps = 4 if args.nproc <= 2 else 2
    args.comm = args.comm or (not args.fresh and any(n in ZEROPP3 for n in args.only))
    if args.comm:
        grid(args.nproc)  # an odd count fails here, naming --nproc, not in the workers
    if args.floor:
        args.only = [*args.only, *(n for n in FLOOR if n not in args.only)]
    variants = (False, True) if args.tuned else (False,)
    saved: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            if args.sweep:
                runs = {}
                for n in args.sweep:
                    print(f"sweep: {n} layers ({precision})", flush=True)
                    os.mkdir(folder := os.path.join(tmp, f"layers-{n}-{precision}"))
                    with tuned_processes(False, False):
                        run = measure(folder, precision, args, n)
                    runs[n] = (run["times"], {name: a["peak"] for name, a in run["alone"].items()})
                report_sweep(runs, precision, args)
                continue
            if args.profile:
                for tuned in variants:
                    which = "-tuned processes (huge pages, freed memory kept)" if tuned else "no fzero.hostmem call"
                    print(f"\n{precision}: rank 0's self CPU time per step by phase (torch.profiler), {args.steps} "
                          f"steps; {which}")  # fmt: skip
                    store = os.path.join(tmp, f"store-prof-{precision}-{'tuned' if tuned else 'plain'}")
                    with tuned_processes(tuned, args.default_malloc):
                        mp.start_processes(profile_worker, args=(args.nproc, store, args, precision),
                                           nprocs=args.nproc, start_method="spawn")  # fmt: skip
                continue
            results = []
            for tuned in variants:  # the plain pair first, then the tuned pair: process-wide settings apart
                os.mkdir(folder := os.path.join(tmp, f"{precision}-{'tuned' if tuned else 'plain'}"))
                with tuned_processes(tuned, args.default_malloc):
                    results.append(measure(folder, precision, args))
            report(results[0], results[1] if args.tuned else None, precision, n_params(CFG.n_layer), args)
            saved[precision] = {"plain": results[0], "tuned": results[1] if args.tuned else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "runs": saved}, f, indent=1)


if __name__ == "__main__":
    main()

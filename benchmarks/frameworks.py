"""Each training framework on fzero against the same framework on its own DDP and on DeepSpeed: optimizer-step time,
side by side, on 2 gloo processes.

    .venv/bin/python benchmarks/frameworks.py [--rounds 5] [--steps 4] [--only NAME ...] [--stage 2 3]

The same model (GPT-2 from `transformers.GPT2Config`: 4 layers, width 256, 4 heads, vocabulary 8192, sequences of
64, tied head, no dropout; fp32), the same data (fixed random tokens, each rank its own micro-batch of 4 through the
framework's own sampler), accumulation 1 (a step is one micro-batch), clipping at 1.0, AdamW lr 1e-4, weight decay
0.01 (the framework's: `torch.optim.AdamW`'s defaults for Accelerate and Lightning, the Trainer's default `optim`,
`adamw_torch_fused`, for the Trainer; DeepSpeed and fzero take the framework's optimizer), in each framework's
ordinary loop, per framework:

- `<fw>-ddp`: the framework's plain data-parallel path (`accelerate.Accelerator(cpu=True)`,
  `Trainer(args=TrainingArguments(use_cpu=True))`, `lightning.Trainer(strategy="ddp")`), and `<fw>-ddp-again`, the
  A/A row: the same, built a second time, timed in the same rotation (the Trainer's DDP takes its default
  `find_unused_parameters=True` for a model without gradient checkpointing: what Trainer users run);
- `<fw>-fzero-zeroN`: fzero's integration at ZeRO stage N (`fzero.integrations.accelerate.Accelerator`,
  `FzeroTrainingArguments` + `FzeroTrainer`, `fzero.integrations.lightning.FzeroStrategy`);
- `<fw>-deepspeed-zeroN`: DeepSpeed itself (`DS_ACCELERATOR=cpu`) through the framework's own DeepSpeed path (see
  `frameworks_workers.py` for the CPU process set-up each path needs; for Lightning, its `DeepSpeedStrategy` with
  three set-up methods replaced, since it refuses any accelerator but CUDA). A row that cannot run is printed with its
  reason in one line, never timed as something else: every fzero and DeepSpeed row checks the engine it trained on.

`<fw>` is `accelerate`, `trainer` (Hugging Face's `Trainer`) or `lightning` (its rows need Lightning and
`fzero.integrations.lightning`; without either the table says so in their place). `--only` takes row names or framework
names (`--only trainer lightning-ddp`); naming `<fw>-ddp` brings its A/A row. `--stage` picks the ZeRO stages of
the fzero and DeepSpeed rows.

Every row lives in the same 2 processes (gloo, `OMP_NUM_THREADS=1` and one torch thread per rank), in an order
rotated each round, for `--rounds` rounds. A framework owns its loop, so a row is one complete run of the
framework, built fresh each round (Accelerate's process state reset before each), of 2 warm-up steps and then
`--steps` timed ones (after each row, what it changed process-wide is undone: see `frameworks_workers.isolated`):
rank 0 takes a timestamp at the end of every optimizer step in the framework's own hook
(Accelerate: the loop's, after `zero_grad`; Trainer: `TrainerCallback.on_step_end`; Lightning:
`on_train_batch_end`), and the row's figure for the round is the mean interval after the warm-up (a step plus the
framework's own work between steps: fetching the batch, callbacks, logging checks). Building a row is not timed.

Prints, per framework, the median over the rounds of each row's step time, its ratio to `<fw>-ddp`, rank 0's
process CPU time per step (its threads', gloo's included) and its ratio, and the run's own A/A spread
`|<fw>-ddp-again / <fw>-ddp - 1|` with each row's "within the A/A spread" marker (`compare_report.within`: within
1 +- the spread, this run cannot tell the row from the framework's DDP), the median time of the row's whole run
(built, 2 + `--steps` steps, torn down: the set-up cost beside the step) and the engine it trained on. The helpers
are benchmarks/compare.py's (`compare_report.spread`, `within`, `ratio_cell`). The defaults take about 8 minutes
on a shared 2-core machine (5 s a row and round, 18 rows).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules

import torch.multiprocessing as mp
from compare_report import AGAIN, ratio_cell, spread, within
from frameworks_workers import FRAMEWORKS, MICRO, MODEL, SEQ, WARMUP, n_params, time_worker

TITLES = {"accelerate": "Accelerate", "trainer": "Hugging Face Trainer", "lightning": "Lightning"}


def framework_rows(framework: str, stages: list[int]) -> list[str]:
    """A framework's rows in rotation order, its A/A row in the middle."""
    fzero = [f"{framework}-fzero-zero{s}" for s in stages]
    ds = [f"{framework}-deepspeed-zero{s}" for s in stages]
    return [f"{framework}-ddp", *fzero, f"{framework}-{AGAIN}", *ds]


def available(framework: str) -> str | None:
    """Why a framework's rows cannot be built here, or None (Lightning: fzero's strategy module and Lightning)."""
    if framework != "lightning":
        return None
    for module in ("lightning", "fzero.integrations.lightning"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not there"
    return None


def select(only: list[str] | None, stages: list[int]) -> tuple[list[str], dict[str, str]]:
    """The rows to time (`only`: row or framework names; a `<fw>-ddp` brings its A/A row), and the frameworks left
    out with why.

    Raises:
      SystemExit: a name in `only` that is neither a row nor a framework (naming the choices).
    """
    every = {fw: framework_rows(fw, stages) for fw in FRAMEWORKS}
    missing = {fw: why for fw in FRAMEWORKS if (why := available(fw))}
    wanted = set(only or FRAMEWORKS)
    known = set(FRAMEWORKS) | {r for rows in every.values() for r in rows}
    if unknown := sorted(wanted - known):
        raise SystemExit(f"--only: unknown {unknown}; rows are {sorted(known - set(FRAMEWORKS))} or a framework")
    rows = []
    for fw, names in every.items():
        for r in names:
            picked = fw in wanted or r in wanted or (r == f"{fw}-{AGAIN}" and f"{fw}-ddp" in wanted)
            if picked and fw not in missing:
                rows.append(r)
    return rows, {fw: why for fw, why in missing.items() if fw in wanted or any(r.startswith(fw) for r in wanted)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(times: dict, args: argparse.Namespace, missing: dict[str, str], seconds: float) -> None:
    """The tables: per framework, each row's median step time and CPU time beside the framework's A/A spread."""
    median, cpu, every = times["median"], times["cpu_median"], times["all"]
    print(f"\nGPT-2 {n_params() / 1e6:.1f}M parameters ({MODEL['n_layer']} layers, width {MODEL['n_embd']}, "
          f"vocabulary {MODEL['vocab_size']}), fp32; 2 gloo ranks x 1 thread, micro-batch {MICRO} x {SEQ} per rank, "
          f"accumulation 1, clipping 1.0; median of {args.rounds} rounds of {WARMUP} warm-up + {args.steps} timed "
          f"steps (rank 0's step ends); the whole run {seconds:.0f} s")  # fmt: skip
    for fw in FRAMEWORKS:
        if fw in missing:
            print(f"\n{TITLES[fw]}: no rows ({missing[fw]})")
            continue
        names = [r for r in args.rows if r.startswith(f"{fw}-")]
        if not names:
            continue
        short = {r: r.removeprefix(f"{fw}-") for r in names}
        mine = {short[r]: median.get(r) for r in names}
        mine_cpu = {short[r]: cpu.get(r) for r in names}
        aa, aa_cpu = spread(mine), spread(mine_cpu)
        print(f"\n{TITLES[fw]}")
        if aa is not None:
            each = " ".join(
                f"{b / a - 1:+.1%}" for a, b in zip(every[f"{fw}-ddp"], every[f"{fw}-{AGAIN}"], strict=True)
            )
            print(f"A/A spread (|{fw}-{AGAIN} / {fw}-ddp - 1|): step time {aa:.1%}, CPU time {aa_cpu:.1%}; "
                  f"round by round: {each}")  # fmt: skip
        else:
            print(f"A/A spread: - (needs both {fw}-ddp and {fw}-{AGAIN})")
        print("| trainer | step s | vs DDP | within A/A | CPU s | CPU vs DDP | CPU within A/A | whole run s | engine |")
        print("|---|---|---|---|---|---|---|---|---|")
        base, cpu_base = mine.get("ddp"), mine_cpu.get("ddp")
        for r in names:
            if r in times["skipped"]:
                print(f"| {r} | skipped: {times['skipped'][r]} | | | | | | | |")
                continue
            t, c = median[r], cpu[r]
            cell, ratio = ratio_cell(t, base)
            cpu_cell, cpu_ratio = ratio_cell(c, cpu_base)
            engine = times["engines"].get(r, "-")
            print(f"| {r} | {t:.3f} | {cell} | {within(short[r], ratio, aa)} | {c:.3f} | {cpu_cell} | "
                  f"{within(short[r], cpu_ratio, aa_cpu)} | {times['whole_median'][r]:.1f} | {engine} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per row and round")
    parser.add_argument("--only", nargs="+", default=None, help="row or framework names (default: every row)")
    parser.add_argument("--stage", nargs="+", type=int, default=[2, 3], choices=[1, 2, 3])
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    args.rows, missing = select(args.only, args.stage)
    for fw, why in missing.items():
        print(f"{TITLES[fw]}: no rows ({why})", flush=True)
    if not args.rows:
        raise SystemExit("no rows to time")
    args.port = free_port()
    os.environ["OMP_NUM_THREADS"] = "1"  # (the workers inherit it: set before torch starts its thread pool there)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(time_worker, args=(2, store, args), nprocs=2, start_method="spawn")
        with open(os.path.join(tmp, "times.json")) as f:
            times = json.load(f)
    report(times, args, missing, time.perf_counter() - t0)


if __name__ == "__main__":
    main()

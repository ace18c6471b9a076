"""`benchmarks/compare.py`'s tables: step time beside the run's own A/A spread, the `-tuned` rows, the first steps,
the bytes per step, and `--sweep`'s tables.

A run's A/A spread is `|ddp-again / ddp - 1|`: DDP built twice and timed in the same rotation (or, for the first
steps, each alone in its own fresh processes), so the spread is what this run's noise alone does to a ratio. A row
"within the A/A spread" of DDP is one whose ratio to DDP differs from 1 by at most that spread: this run cannot tell
it from DDP.
"""

from __future__ import annotations

import argparse
import statistics

from compare_trainers import AGAIN, CFG, COMPILED, FLOOR, MICRO, PEERS3, grid, make_model

import fzero

Run = dict
"""One set of processes' figures (`compare.measure`): `times` (the time worker's JSON) and `alone` (by trainer, the
alone worker's JSON; empty without `--memory` or `--first-steps`)."""


def n_params(n_layer: int) -> int:
    """The parameter count of `make_model(n_layer)`."""
    return sum(p.numel() for p in make_model(n_layer).parameters())


def spread(figures: dict[str, float | None]) -> float | None:
    """The A/A spread of `figures` (by trainer): `|ddp-again / ddp - 1|`, or None without both rows."""
    a, b = figures.get("ddp"), figures.get(AGAIN)
    return abs(b / a - 1) if a and b else None


def within(name: str, ratio: float | None, aa: float | None) -> str:
    """Whether a ratio to DDP is within the A/A spread `aa`: "yes", "no, slower" / "no, faster" (by how much beyond
    the spread), or "-" where either is unknown; DDP's own rows say what they are."""
    if name.removesuffix("-tuned") == "ddp":
        return "(the base)"
    if name.removesuffix("-tuned") == AGAIN:
        return "(the A/A row)"
    if ratio is None or aa is None:
        return "-"
    off = ratio - 1
    if abs(off) <= aa:
        return "yes"
    return f"no, {'slower' if off > 0 else 'faster'} by {abs(off) - aa:.1%} beyond"


def per_round(rounds: dict[str, list[float]], name: str, base: str = "ddp") -> str:
    """Row `name`'s ratio to row `base` (DDP) round by round, as a cell: the median of the per-round ratios (each
    round's two figures were timed minutes apart at most, so a drift of the machine's load between rounds cancels),
    their range, and in how many rounds the row was the faster one (a sign test's reading: faster in every one of 5
    rounds happens by chance 1 time in 32 when the two are the same), "-" where either row lacks its rounds."""
    if not rounds.get(name) or not rounds.get(base):
        return "-"
    if name == base:
        return "1.00x"
    ratios = [a / b for a, b in zip(rounds[name], rounds[base], strict=True)]
    faster = sum(r < 1 for r in ratios)
    return (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, faster in "
            f"{faster}/{len(ratios)})")  # fmt: skip


def ratio_cell(value: float | None, base: float | None) -> tuple[str, float | None]:
    """`value / base` as a table cell and as a number (None where either is missing)."""
    if not value or not base:
        return "-", None
    return f"{value / base:.2f}x", value / base


def header(run: Run, precision: str, psi: int, args: argparse.Namespace) -> None:
    """The table's first lines: the setup, the process settings and the A/A spread."""
    tuning = run["times"].get("tuning", "none")
    settings = "no fzero.hostmem call (what a user's own script runs)" if tuning == "none" else f"tuned: {tuning}"
    where = ("each trainer alone in a fresh pair of processes each round, its steps after its warm-up (--fresh)"
             if args.fresh else "every trainer in the same pair of processes")  # fmt: skip
    print(f"\n{precision}: {psi / 1e6:.1f}M parameters, {args.nproc} gloo ranks x {args.threads} thread(s), "
          f"micro-batch {MICRO} x {CFG.seq_len}, median of {args.rounds} rounds of {args.steps} steps, {where}; "
          f"process settings: {settings}")  # fmt: skip
    median, cpu = run["times"]["median"], run["times"]["cpu"]
    aa, aa_cpu = spread(median), spread(cpu)
    if aa is not None:
        rounds = run["times"].get("all", {})
        each = " ".join(f"{b / a - 1:+.1%}" for a, b in zip(rounds["ddp"], rounds[AGAIN], strict=True))
        pairs = "each in its own fresh processes" if args.fresh else "in the same processes"
        print(f"A/A spread (|{AGAIN} / ddp - 1|, two DDPs {pairs}, the same rotation): step time {aa:.1%}, CPU time "
              f"{aa_cpu:.1%}; {AGAIN} / ddp - 1 round by round: {each}")  # fmt: skip
    else:
        print(f"A/A spread: - (name ddp in --only: {AGAIN} is added beside it)")


def report(plain: Run, tuned: Run | None, precision: str, psi: int, args: argparse.Namespace) -> None:
    """The step-time tables of one precision: the default rows, then (`--tuned`) the `-tuned` rows, then (with
    `--first-steps`) the first steps of both.

    Args:
      plain: the default rows' figures (no `fzero.hostmem` call).
      tuned: the `-tuned` rows' figures (a second pair of processes), or None without `--tuned`.
      precision: "fp32" or "bf16".
      psi: the model's parameter count.
      args: the parsed command line.
    """
    times = plain["times"]
    median, cpu = times["median"], times["cpu"]
    memory = {name: alone.get("peak") for name, alone in plain["alone"].items()} if args.memory else {}
    base, cpu_base = median.get("ddp"), cpu.get("ddp")
    aa, aa_cpu = spread(median), spread(cpu)
    floor = sum(median[n] for n in FLOOR) if all(n in median for n in FLOOR) else None
    header(plain, precision, psi, args)
    if floor is not None:
        print(f"floor (forward + backward alone, plus ZeRO's 1/{args.nproc} share of the update alone): {floor:.3f} s")
    print(f"| trainer | step s | vs DDP | within A/A | per-round vs DDP | CPU s | CPU vs DDP | CPU within A/A |"
          f"{' vs floor |' if floor else ''}{' peak RSS MiB/rank |' if memory else ''}")  # fmt: skip
    print(f"|---|---|---|---|---|---|---|---|{'---|' if floor else ''}{'---|' if memory else ''}")
    for name, t in median.items():
        cell, ratio = ratio_cell(t, base)
        paired = per_round(times.get("all", {}), name)
        cpu_cell, cpu_ratio = ratio_cell(cpu[name], cpu_base)
        over = f" {t / floor:.2f}x |" if floor else ""
        mem = f" {memory[name]:.0f} |" if memory.get(name) else (" - |" if memory else "")
        print(f"| {name} | {t:.3f} | {cell} | {within(name, ratio, aa)} | {paired} | {cpu[name]:.3f} | {cpu_cell} | "
              f"{within(name, cpu_ratio, aa_cpu)} |{over}{mem}")  # fmt: skip
    for name, why in times["skipped"].items():
        print(f"| {name} | {why} | | | | | | |{' |' if floor else ''}{' |' if memory else ''}")
    if "ddp" + COMPILED in median:
        report_compiled(median, cpu, times.get("all", {}))
    if tuned is not None:
        report_tuned(plain, tuned, precision, psi, args)
    if args.first_steps:
        report_first(plain, tuned, args.first_steps)
    if times.get("comm"):
        report_comm(times["comm"], args.nproc)


def report_compiled(median: dict[str, float], cpu: dict[str, float], rounds: dict[str, list[float]]) -> None:
    """`--compile`'s rows against DDP compiled: each compiled row's step and CPU time over `ddp-compiled`'s, beside the
    compiled A/A spread (`ddp-again-compiled`), round by round (`per_round`), and against its eager twin (the
    median step's ratio, then round by round: "no slower than eager" reads there)."""
    compiled = {name.removesuffix(COMPILED): t for name, t in median.items() if name.endswith(COMPILED)}
    compiled_cpu = {name.removesuffix(COMPILED): t for name, t in cpu.items() if name.endswith(COMPILED)}
    aa, aa_cpu = spread(compiled), spread(compiled_cpu)
    print(f"\ncompiled rows against DDP compiled; A/A spread (|{AGAIN}{COMPILED} / ddp{COMPILED} - 1|): step time "
          f"{'-' if aa is None else f'{aa:.1%}'}, CPU time {'-' if aa_cpu is None else f'{aa_cpu:.1%}'}")  # fmt: skip
    print(
        "| trainer | step s | vs DDP compiled | within A/A | per-round vs DDP compiled | CPU vs DDP compiled | "
        "eager twin vs DDP | vs its eager twin | per-round vs its eager twin |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t in compiled.items():
        cell, ratio = ratio_cell(t, compiled["ddp"])
        eager = ratio_cell(median.get(name), median.get("ddp"))[0]
        paired = per_round(rounds, name + COMPILED, "ddp" + COMPILED)
        own, own_paired = ratio_cell(t, median.get(name))[0], per_round(rounds, name + COMPILED, name)
        cpu_cell = ratio_cell(compiled_cpu[name], compiled_cpu["ddp"])[0]
        print(f"| {name}{COMPILED} | {t:.3f} | {cell} | {within(name, ratio, aa)} | {paired} | {cpu_cell} | {eager} | "
              f"{own} | {own_paired} |")  # fmt: skip


def report_tuned(plain: Run, tuned: Run, precision: str, psi: int, args: argparse.Namespace) -> None:
    """The `-tuned` rows: each one's ratio to the tuned DDP (same processes: the tuned A/A spread applies) and to
    the plain DDP (another pair of processes: the ratio also carries the difference between two process pairs, which
    no A/A row of a single pair measures), and the tuning's gain on the trainer itself (its plain row over this)."""
    median, cpu = tuned["times"]["median"], tuned["times"]["cpu"]
    plain_median = plain["times"]["median"]
    base, plain_base, cpu_base = median.get("ddp"), plain_median.get("ddp"), cpu.get("ddp")
    aa = spread(median)
    memory = {name: alone.get("peak") for name, alone in tuned["alone"].items()} if args.memory else {}
    header(tuned, precision, psi, args)
    print(f"| trainer | step s | vs tuned DDP | within tuned A/A | vs plain DDP | plain row / this | CPU s | "
          f"CPU vs tuned DDP |{' peak RSS MiB/rank |' if memory else ''}")  # fmt: skip
    print(f"|---|---|---|---|---|---|---|---|{'---|' if memory else ''}")
    for name, t in median.items():
        cell, ratio = ratio_cell(t, base)
        gain, _ = ratio_cell(plain_median.get(name), t)
        mem = f" {memory[name]:.0f} |" if memory.get(name) else (" - |" if memory else "")
        print(f"| {name}-tuned | {t:.3f} | {cell} | {within(name, ratio, aa)} | {ratio_cell(t, plain_base)[0]} | "
              f"{gain} | {cpu[name]:.3f} | {ratio_cell(cpu[name], cpu_base)[0]} |{mem}")  # fmt: skip


def report_first(plain: Run, tuned: Run | None, n: int) -> None:
    """The first steps: per trainer alone in fresh processes, the wall time from the trainer built to the end of
    step `n`, its ratio to DDP's (and the A/A spread of the two DDPs' fresh runs), beside `n` times the steady
    median of the timed rotation, and rank 0's time of each of the `n` steps (`--fresh`: the same runs; the time to
    step `n` rank 0's, the round with the median one)."""
    print(f"\ntime to step {n}: each trainer alone in a fresh pair of processes, from the trainer built to the end of "
          f"step {n} (both ranks), beside {n} x its steady median step (the rotation's)")  # fmt: skip
    print(f"| trainer | build s | to step {n} s | vs DDP | within A/A | {n} x steady s | to step {n} / ({n} x steady) "
          f"| steps 1..{n} s (rank 0) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for run, suffix in ((plain, ""), (tuned, "-tuned")):
        if run is None:
            continue
        alone, median = run["alone"], run["times"]["median"]
        firsts = {name: a["to_last_s"] for name, a in alone.items()}
        base, aa = firsts.get("ddp"), spread(firsts)
        if aa is not None:
            print(f"| A/A spread{suffix} (fresh {AGAIN} / fresh ddp) | | {aa:.1%} | | | | | |")
        for name, a in alone.items():
            first = a["to_last_s"]
            if first is None:
                print(f"| {name}{suffix} | skipped | | | | | | |")
                continue
            cell, ratio = ratio_cell(first, base)
            steady = n * median[name] if name in median else None
            slow = f"{first / steady:.2f}x" if steady else "-"
            each = " ".join(f"{s:.2f}" for s in a["steps_s"])
            print(f"| {name}{suffix} | {a['build_s']:.2f} | {first:.2f} | {cell} | {within(name, ratio, aa)} | "
                  f"{'-' if steady is None else f'{steady:.2f}'} | {slow} | {each} |")  # fmt: skip


def report_comm(comm: dict[str, dict], world: int) -> None:
    """The bytes table: per fzero row, one step's payload per axis and the bytes received from other shard groups."""
    shape = grid(world)
    slow = {name: fzero.mesh.Ledger(world, entries).crossing(shape, "shard") for name, entries in comm.items()}
    print(f"\nbytes per step per rank (rank 0's ledger of one step on DistMesh(shape={shape}); payload: elements x "
          f"element size; cross-node: received from outside the rank's shard group of {shape['shard']})")  # fmt: skip
    print("| trainer | world | shard | replicate | cross-node | fzero-zero3 / this |")
    print("|---|---|---|---|---|---|")
    for name, entries in comm.items():
        axes: dict[str, int] = {}
        for key, entry in entries.items():
            axis = key.partition(":")[2] or "world"
            axes[axis] = axes.get(axis, 0) + entry.get("bytes", 0)
        cells = " | ".join(f"{axes[a]:,}" if a in axes else "-" for a in ("world", "shard", "replicate"))
        base = slow.get("fzero-zero3")
        ratio = f"{base / slow[name]:.2f}x" if base and slow[name] else "-"
        print(f"| {name} | {cells} | {slow[name]:,} | {ratio} |")


def trend(first: float, last: float, tolerance: float = 0.05) -> str:
    """How a ratio to DDP moved from the smallest to the largest model: flat within `tolerance` (relative), else
    falling or rising."""
    change = last / first - 1
    word = "flat" if abs(change) <= tolerance else ("falling" if change < 0 else "rising")
    return f"{word} ({first:.2f}x -> {last:.2f}x, {change:+.0%})"


def report_sweep(runs: dict[int, tuple[dict, dict]], precision: str, args: argparse.Namespace) -> None:
    """`--sweep`'s tables: step time as a ratio to DDP and (`--memory`) peak RSS per rank, a column per layer count.

    Args:
      runs: by layer count, `measure`'s `(times, memory)`.
      precision: "fp32" or "bf16".
      args: the parsed command line.
    """
    sizes = list(runs)
    head = " | ".join(f"{n} layers, {n_params(n) / 1e6:.1f}M" for n in sizes)
    rows = list(dict.fromkeys(name for times, _ in runs.values() for name in times["median"]))
    print(f"\n{precision} sweep: {args.nproc} gloo ranks x {args.threads} thread(s), micro-batch {MICRO} x "
          f"{CFG.seq_len}, median of {args.rounds} rounds of {args.steps} steps, "
          "each size in its own processes")  # fmt: skip
    print("step time: ratio to DDP in the same run (median step s)")
    print(f"| trainer | {head} | ratio to DDP, {sizes[0]} -> {sizes[-1]} layers |")
    print(f"|---|{'---|' * len(sizes)}---|")
    for name in rows:
        cells, ratios = [], []
        for times, _ in runs.values():
            t, base = times["median"].get(name), times["median"].get("ddp")
            ratios.append(t / base if t and base else None)
            cells.append("-" if t is None else f"{ratios[-1]:.2f}x ({t:.3f} s)" if base else f"- ({t:.3f} s)")
        ok = name != "ddp" and len(sizes) > 1 and ratios[0] is not None and ratios[-1] is not None
        print(f"| {name} | {' | '.join(cells)} | {trend(ratios[0], ratios[-1]) if ok else '-'} |")
    for n, (times, _) in runs.items():
        for name, why in times["skipped"].items():
            print(f"{n} layers: {name} {why}")
    if any(memory for _, memory in runs.values()):
        print("peak RSS MiB per rank, each trainer alone (-: skipped or its worker died)")
        print(f"| trainer | {head} | at most {' and '.join(PEERS3)} at every size |")
        print(f"|---|{'---|' * len(sizes)}---|")
        for name in rows:
            peaks = [memory.get(name) for _, memory in runs.values()]
            cells = " | ".join("-" if p is None else f"{p:.0f}" for p in peaks)
            print(f"| {name} | {cells} | {within_peers(name, runs) if name.startswith('fzero') else '-'} |")
    for n, (times, _) in runs.items():
        if times.get("comm"):
            print(f"\n{n} layers:", end="")
            report_comm(times["comm"], args.nproc)


def within_peers(name: str, runs: dict[int, tuple[dict, dict]]) -> str:
    """Whether row `name`'s peak RSS is at most every `PEERS3` row's at every size: "yes"/"no", with its largest
    ratio to the smaller peer and the size where it was, or "-" where a size lacks a figure."""
    worst = None
    for n, (_, memory) in runs.items():
        peers = [memory.get(p) for p in PEERS3]
        if memory.get(name) is None or None in peers:
            return "-"
        ratio = memory[name] / min(peers)
        worst = max(worst or (ratio, n), (ratio, n))
    return f"{'yes' if worst[0] <= 1 else 'no'} (highest: {worst[0]:.2f}x the smaller, at {worst[1]} layers)"

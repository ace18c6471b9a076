"""A user's own training script, fzero against DDP, measured the way users measure: their loop, their config, each
trainer in its own fresh processes, no tuning.

    .venv/bin/python benchmarks/user_script.py [--stages 2 3] [--precision fp32 bf16] [--rounds 3]

The script a user writes is `train()` below, run by 2 processes of 1 thread each on gloo, launched as `torchrun
--nproc_per_node 2` launches them (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `OMP_NUM_THREADS=1`; the
same `train()` runs under torchrun itself: `torchrun --nproc_per_node 2 benchmarks/user_script.py --trainer
fzero-s2 --precision bf16`). It makes no `fzero.hostmem` call and sets no allocator variable: what a user gets.

- `fzero-sN`: `fzero.initialize(model=..., model_parameters=..., config="ds_config.json")` with a DeepSpeed JSON
  config (ZeRO stage N, AdamW lr 1e-4 weight decay 0.01, `WarmupLR` linear over 100 steps, `gradient_clipping` 1.0,
  micro-batch 4; bf16: `"bf16": {"enabled": true}`), then `engine(x)`, `engine.backward(loss)`, `engine.step()`;
- `ddp`: `DistributedDataParallel` written as a user writes it: `torch.optim.AdamW` (torch's default kernel), a
  `LambdaLR` with the same linear warm-up, `clip_grad_norm_(..., 1.0)`, and for bf16 the forward under
  `torch.autocast("cpu", torch.bfloat16)` (fp32 parameters); `ddp-again`: the same, launched again (the A/A row).

The model and data are `benchmarks/compare.py`'s (`make_model`: the 27.3M-parameter 6-layer GPT; `batches`: each
rank its own micro-batch of 4 x 64 tokens). Each launch runs 11 steps on rank 0's clock: 3 warm-up steps, then 8
timed ones, the launch's figure their median; and the time to the 10th step (the wall time from the trainer built
to the end of step 10, steps 1..10; free: they are the same steps). The launches are interleaved over `--rounds`
rounds, `ddp, fzero-s2, fzero-s3, ddp-again` in the first and the order rotated by one in each next round, so the
machine's noise hits every trainer alike. Prints, per precision, each trainer's median over the rounds, its ratio
to DDP's, whether it is within the run's A/A spread (`|ddp-again / ddp - 1|`, the two DDPs' medians over the
rounds), the median of its per-round ratios to the same round's DDP, and the per-round figures; then the same for
the time to the 10th step.

Costs one launch per trainer per round: the start and imports (~5 s), the build (2-3 s for fzero's, 3-10 s for
DDP's) and 11 steps; about 45 s a launch in fp32 on a shared 2-core AVX2 machine (1.2-4.5 s a step under the other
jobs' load), so `--rounds 3 --precision fp32` with 2 stages (12 launches) took 10 minutes there. bf16 is several
times slower on a CPU without native bf16 arithmetic (AVX2 only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from compare import LR, MICRO, WD, batches, lm_loss, make_model, rotated  # (benchmarks/): the model, the data
from compare_report import within

import fzero
from fzero.host import process_group

WARMUP_STEPS, CLIP = 100, 1.0
WARM, TIMED, TO_STEP = 3, 8, 10  # warm-up steps, timed steps, the step whose arrival time is reported
NPROC = 2
AGAIN = "ddp-again"


def ds_config(stage: int, precision: str) -> dict:
    """The user's DeepSpeed JSON config for `fzero-s{stage}`."""
    config: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": WARMUP_STEPS,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train(trainer: str, precision: str, config_path: str | None) -> dict | None:
    """The user's script: builds `trainer` ("ddp", "ddp-again" or "fzero-sN" with the JSON config at `config_path`)
    and runs `WARM + TIMED` steps, timing each on this rank's clock.

    The process group stays up (the caller shuts it down after saving the figures).

    Returns:
      On rank 0, `{"build_s", "steps_s", "median_s", "to_step_s"}`: the time to build the trainer, each step's time,
      the median of the timed steps, and the time from the trainer built to the end of step `TO_STEP`; None on the
      other ranks.
    """
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: from the launcher
    rank = dist.get_rank()
    data = batches(rank, WARM + TIMED)
    t0 = time.perf_counter()
    model = make_model()
    if trainer.startswith("fzero"):
        engine, _, _, _ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config_path)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    else:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / WARMUP_STEPS))  # WarmupLR, linear

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                loss = lm_loss(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    build_s = time.perf_counter() - t0
    steps_s = []
    for batch in data:
        t = time.perf_counter()
        step(batch["x"], batch["y"])
        steps_s.append(time.perf_counter() - t)
    if rank:
        return None
    return {"build_s": build_s, "steps_s": steps_s, "median_s": statistics.median(steps_s[WARM:]),
            "to_step_s": sum(steps_s[:TO_STEP])}  # fmt: skip


def free_port() -> int:
    """A TCP port free on this machine now, for a launch's rendezvous (as torchrun's `--standalone` picks one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(trainer: str, precision: str, folder: str) -> dict:
    """Runs `train(trainer, precision)` in `NPROC` fresh processes, as torchrun would start them, and returns rank
    0's figures.

    Raises:
      RuntimeError: a process failed; names the trainer and shows the end of its output.
    """
    stage = int(trainer.removeprefix("fzero-s")) if trainer.startswith("fzero") else None
    config = os.path.join(folder, f"ds_config_s{stage}_{precision}.json")
    if stage is not None and not os.path.exists(config):
        with open(config, "w") as f:
            json.dump(ds_config(stage, precision), f, indent=2)
    out = os.path.join(folder, f"out-{trainer}-{precision}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FZERO_BENCH_")}  # compare.py's --tuned: not here
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(NPROC), OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--trainer", trainer, "--precision", precision,
               "--config", config, "--out", out]  # fmt: skip
    logs = [open(os.path.join(folder, f"log-{trainer}-{precision}-{r}.txt"), "w+") for r in range(NPROC)]
    procs = [
        subprocess.Popen(command, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=log)
        for r, log in enumerate(logs)
    ]
    codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    if any(codes):
        rank = next(r for r, c in enumerate(codes) if c)
        with open(logs[rank].name) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{trainer} ({precision}): rank {rank} exited with {codes[rank]}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def table(title: str, figures: dict[str, list[float]], unit_note: str) -> None:
    """One table: per trainer, the median over the rounds, its ratio to DDP's, whether it is within the A/A spread,
    the median of its per-round ratios to the same round's DDP (launches of one round are minutes apart, not
    hours: a slow stretch of the machine then moves both), and the per-round figures."""
    med = {name: statistics.median(v) for name, v in figures.items()}
    aa = abs(med[AGAIN] / med["ddp"] - 1)
    print(f"\n{title}; A/A spread |{AGAIN} / ddp - 1| = {aa:.1%}")
    print(f"| trainer | {unit_note} | vs DDP | within A/A | median of per-round ratios | per round |")
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        ratio = m / med["ddp"]
        paired = statistics.median(v / d for v, d in zip(figures[name], figures["ddp"], strict=True))
        rounds = " ".join(f"{v:.3f}" for v in figures[name])
        print(f"| {name} | {m:.3f} | {ratio:.2f}x | {within(name, ratio, aa)} | {paired:.2f}x | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    # one launched process (the user's script): what the driver passes it
    parser.add_argument("--trainer", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        if args.trainer.startswith("fzero") and not args.config:  # under torchrun: the config written here
            name = f"user_script_{args.trainer}_{args.precision[0]}_rank{os.environ.get('RANK', '0')}.json"
            args.config = os.path.join(tempfile.gettempdir(), name)  # (a file per rank: none read half-written)
            with open(args.config, "w") as f:
                json.dump(ds_config(int(args.trainer.removeprefix("fzero-s")), args.precision[0]), f)
        result = train(args.trainer, args.precision[0], args.config)
        if result is not None:
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f)
        # (not dist.destroy_process_group(): it can leave gloo's threads to the interpreter's exit, which now and
        # then aborts; see fzero.host.process_group. After the timed steps either way.)
        process_group.shutdown()
        return
    if args.rounds < 1:
        parser.error(f"--rounds takes a positive count, got {args.rounds}")
    chosen = [k for k in os.environ if k == "THP_MEM_ALLOC_ENABLE" or k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]
    order = ["ddp", *(f"fzero-s{s}" for s in args.stages), AGAIN]
    print(f"{sum(p.numel() for p in make_model().parameters()) / 1e6:.1f}M parameters, {NPROC} gloo ranks x 1 thread, "
          f"micro-batch {MICRO}, each launch {WARM} warm-up + {TIMED} timed steps (their median), {args.rounds} "
          f"rounds interleaved; process settings: "
          f"{'from the environment: ' + ', '.join(chosen) if chosen else 'none (no fzero.hostmem call)'}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for precision in args.precision:
            medians: dict[str, list[float]] = {name: [] for name in order}
            to_step: dict[str, list[float]] = {name: [] for name in order}
            for r in range(args.rounds):
                for name in rotated(order, r):
                    result = launch(name, precision, folder)
                    medians[name].append(result["median_s"])
                    to_step[name].append(result["to_step_s"])
                    print(
                        f"{precision} round {r + 1}: {name}: median step {result['median_s']:.3f} s, to step "
                        f"{TO_STEP} {result['to_step_s']:.2f} s, built in {result['build_s']:.2f} s",
                        flush=True,
                    )
            table(f"{precision}: median step time, median over {args.rounds} rounds", medians, "step s")
            table(f"{precision}: time to step {TO_STEP} from the trainer built (steps 1..{TO_STEP}), median over "
                  f"{args.rounds} rounds", to_step, f"to step {TO_STEP} s")  # fmt: skip


if __name__ == "__main__":
    main()

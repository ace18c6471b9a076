"""fzero against DDP, FSDP2 and DeepSpeed: step time and peak memory, side by side, on 2 gloo processes (or
`--nproc`).

    .venv/bin/python benchmarks/compare.py [--precision fp32 bf16] [--rounds 5] [--steps 4] [--only NAME ...]
                                            [--memory] [--threads 1] [--profile] [--floor] [--nproc 2] [--comm]

The same model (a 27.3M-parameter 6-layer pre-LN transformer: `fzero.examples.gpt` with vocabulary 8192, width 512,
8 heads, an untied head), the same data (each rank its own micro-batch of 4 x 64 tokens) and the same optimizer
(AdamW, lr 1e-4, weight decay 0.01), under:

- `ddp`: `DistributedDataParallel` with torch's fused AdamW (bf16: `autocast`, fp32 parameters);
- `fsdp2-zeroN`: `fully_shard` on every block and the root (`reshard_after_forward=False` for ZeRO-2-like, True for
  ZeRO-3-like; bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), torch's AdamW;
- `deepspeed-zeroN`: DeepSpeed's engine with the same JSON config, when DeepSpeed is installed (`pip install
  ".[bench]"`; it runs on the CPU with `DS_ACCELERATOR=cpu`);
- `fzero-zeroN` (the functional core, `train_step(donate=True)`), `fzero-zeroN-overlap` (the same, each unit's
  reduction overlapped with the backward: `GatherPolicy(overlap_reduce=True)`) and `fzero-shell-zeroN`
  (`fzero.initialize`, the config's defaults: overlap at stage 3 only, as DeepSpeed);
- ZeRO++ and hybrid sharding at stage 3, on `DistMesh(shape={"replicate": nproc // 2, "shard": 2})` (a shard group
  of 2 consecutive ranks standing for a node): `fzero-hybrid3` (`zero3(hybrid=True)`: sharded over `shard`,
  averaged over `replicate`), and sharded over all ranks `fzero-hpz3` (`hpz=True`), `fzero-qwz3` (`qwz=True`),
  `fzero-qgz3` (`qgz=True`), `fzero-zero++3` (all three). They run only when named in `--only` (an even `--nproc`),
  e.g. `--nproc 4 --only ddp fzero-zero3 fzero-hybrid3 fzero-hpz3 fzero-qwz3 fzero-qgz3 fzero-zero++3`.

Every trainer lives in the same processes and runs in rotating order, round after round (machine noise hits
them alike); each round times `--steps` steps after two warm-up steps. Prints the median step time per trainer, its
ratio to DDP's, with `--floor` its ratio to the floor (the same model's forward + backward alone, without
communication or optimizer, plus the update alone over a 1/W share of the parameters: the physical limit of a ZeRO
step on this machine; `floor-fwdbwd` and `floor-update` are timed in the same rotation), and with `--memory` the
peak resident memory per rank of each trainer run alone in a fresh pair of
processes. `--profile` prints instead rank 0's per-phase split of a step (compute, waiting on communication,
optimizer, copies; the profiler's self CPU time, the rest of the wall time unaccounted), and for fzero's steps the
time inside each of its `record_function` phases (`fzero.gather`, `fzero.forward_backward`, `fzero.reduce`,
`fzero.update`, `fzero.agree`; the shell's `fzero.forward`, `fzero.backward`).

`--nproc N` runs N processes instead of 2 (`--rounds` and `--steps` then default to 3 and 2: on this 2-core machine
4 processes share the cores). With `--comm`, or whenever a 2-D trainer above runs, every `fzero-zeroN*` and 2-D row
also gets the bytes per step per rank of one step (rank 0's ledger, the step after one warm-up step, every trainer
on the same 2-D `DistMesh`: a 1-D `DistMesh` records no bytes, and the 1-D trainers' collectives over all ranks are
the same on it): the payload per axis (`world`: over all ranks) and the bytes received from outside the rank's
shard group (`fzero.mesh.Ledger.crossing(shape, "shard")`: the slow, cross-node share when a shard group is a node),
with `fzero-zero3`'s cross-node bytes over the row's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import process_group
from fzero.examples.gpt import GPT, GPTConfig

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike

CFG = GPTConfig(vocab_size=8192, seq_len=64, n_layer=6, n_head=8, d_model=512)
MICRO, LR, WD = 4, 1e-4, 0.01
Step = Callable[[dict[str, torch.Tensor]], None]


def make_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    model.head.weight = nn.Parameter(torch.randn(CFG.vocab_size, CFG.d_model) * 0.02)  # untied: 27.3M
    return model


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def ddp(model: nn.Module, precision: str) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(net(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fsdp2(stage: int) -> Callable[[nn.Module, str], Step]:
    def build(model: nn.Module, precision: str) -> Step:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp_policy = MixedPrecisionPolicy()
        if precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

        def step(batch: dict[str, torch.Tensor]) -> None:
            lm_loss(model(batch["x"]), batch["y"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


def ds_config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def deepspeed_engine(stage: int) -> Callable[[nn.Module, str], Step]:
    def build(model: nn.Module, precision: str) -> Step:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, precision))  # fmt: skip

        def step(batch: dict[str, torch.Tensor]) -> None:
            engine.backward(lm_loss(engine(batch["x"]), batch["y"]))
            engine.step()

        return step

    return build


def grid(world: int) -> dict[str, int]:
    """The 2-D trainers' mesh shape for `world` processes: shard groups of 2 consecutive ranks (a node of 2)."""
    if world % 2:
        raise ValueError(f"the 2-D trainers need an even number of processes (shard groups of 2), got --nproc {world}")
    return {"replicate": world // 2, "shard": 2}


@functools.cache
def grid_mesh() -> fzero.DistMesh:
    """This process's 2-D `DistMesh`, made once and shared by the trainers (its sub-groups are collectives to make)."""
    return fzero.DistMesh(shape=grid(dist.get_world_size()))


def fzero_core(stage: int, overlap: bool = False, two_d: bool = False, **options: bool) -> Callable[..., Step]:
    """fzero's functional step under `fzero.zero{stage}(..., **options)`.

    Args:
      stage: the ZeRO stage.
      overlap: overlap each unit's reduction with the backward (`GatherPolicy(overlap_reduce=True)`).
      two_d: on `grid_mesh()` instead of the 1-D `DistMesh()`.
      options: the preset's ZeRO++ and hybrid flags (`hybrid`, `hpz`, `qwz`, `qgz`).

    Returns:
      `build(model, precision, mesh=None)`; `mesh` overrides the trainer's own (the `--comm` ledger's).
    """

    def build(model: nn.Module, precision: str, mesh: fzero.DistMesh | None = None) -> Step:
        if mesh is None:
            mesh = grid_mesh() if two_d else fzero.DistMesh()
        preset = getattr(fzero, f"zero{stage}")
        tx = preset(fzero.adamw(LR, weight_decay=WD, fused=True), precision=None if precision == "fp32" else precision,
                    **options)  # fmt: skip

        def loss_fn(params: dict, batch: dict) -> torch.Tensor:
            return lm_loss(torch.func.functional_call(model, params, (batch["x"],)), batch["y"])

        policy = fzero.GatherPolicy(overlap_reduce=True) if overlap else None
        train = fzero.train_step(model, loss_fn, tx, mesh, donate=True, gather=policy)
        box = [fzero.init(model, tx, mesh)]

        def step(batch: dict[str, torch.Tensor]) -> None:
            box[0], _ = train(box[0], batch)

        return step

    return build


def fzero_shell(stage: int) -> Callable[[nn.Module, str], Step]:
    def build(model: nn.Module, precision: str) -> Step:
        engine, *_ = fzero.initialize(model=model, config=ds_config(stage, precision), mesh=fzero.DistMesh(),
                                      printer=lambda line: None)  # fmt: skip

        def step(batch: dict[str, torch.Tensor]) -> None:
            engine.backward(lm_loss(engine(batch["x"]), batch["y"]))
            engine.step()

        return step

    return build


def floor_forward_backward(model: nn.Module, precision: str) -> Step:
    """The model's forward and backward on this rank's micro-batch alone: no communication, no optimizer (bf16:
    under autocast, as `ddp`)."""

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(model(batch["x"]), batch["y"])
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def floor_update(model: nn.Module, precision: str) -> Step:
    """The update alone, as ZeRO shares it: torch's fused AdamW over a 1/W share of the parameters (fp32 master)."""
    share = -(-sum(p.numel() for p in model.parameters()) // dist.get_world_size())
    flat = torch.zeros(share, requires_grad=True)
    flat.grad = torch.full((share,), 1e-3)
    opt = torch.optim.AdamW([flat], lr=LR, weight_decay=WD, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        opt.step()

    return step


FLOOR = ("floor-fwdbwd", "floor-update")
ZEROPP3 = {  # on the 2-D mesh; named in --only to run
    "fzero-hybrid3": {"hybrid": True},
    "fzero-hpz3": {"hpz": True},
    "fzero-qwz3": {"qwz": True},
    "fzero-qgz3": {"qgz": True},
    "fzero-zero++3": {"hpz": True, "qwz": True, "qgz": True},
}


def trainers() -> dict[str, Callable[[nn.Module, str], Step]]:
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp": ddp}
    for stage in (2, 3):
        out[f"fsdp2-zero{stage}"] = fsdp2(stage)
    for stage in (1, 2, 3):
        out[f"deepspeed-zero{stage}"] = deepspeed_engine(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}"] = fzero_core(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}-overlap"] = fzero_core(stage, overlap=True)
    for stage in (0, 1, 2, 3):
        out[f"fzero-shell-zero{stage}"] = fzero_shell(stage)
    out.update(zip(FLOOR, (floor_forward_backward, floor_update), strict=True))
    for name, options in ZEROPP3.items():
        out[name] = fzero_core(3, two_d=True, **options)
    return out


def has_ledger(name: str) -> bool:
    """Whether the `--comm` table measures trainer `name` (fzero's functional core: its builder takes `mesh=`)."""
    return name in ZEROPP3 or (name.startswith("fzero-zero") and not name.startswith("fzero-shell"))


def step_ledger(name: str, precision: str, data: list[dict[str, torch.Tensor]]) -> dict[str, dict[str, int]]:
    """One step's ledger (after one warm-up step) of a fresh `name` trainer on `grid_mesh()`, this rank's."""
    mesh = grid_mesh()
    step = trainers()[name](copy.deepcopy(make_model()), precision, mesh=mesh)
    step(data[0])
    with mesh.record() as ledger:
        step(data[1 % len(data)])
    return ledger.as_dict()


def batches(rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    toks = [torch.randint(0, CFG.vocab_size, (MICRO, CFG.seq_len + 1), generator=g) for _ in range(n)]
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]


def build_all(names: list[str], precision: str) -> tuple[dict[str, Step], dict[str, str]]:
    steps, skipped = {}, {}
    for name in names:
        try:
            steps[name] = trainers()[name](copy.deepcopy(make_model()), precision)
        except ImportError as e:  # DeepSpeed not installed
            skipped[name] = f"not installed ({e.name})"
    return steps, skipped


def init(rank: int, world: int, store: str, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what launchers set
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def time_worker(rank: int, world: int, store: str, args: argparse.Namespace, precision: str) -> None:
    init(rank, world, store, args.threads)
    try:
        steps, skipped = build_all(args.only, precision)
        data = batches(rank, args.steps)
        for step in steps.values():  # warm-up: two steps each
            step(data[0])
            step(data[1 % len(data)])
        times: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                dist.barrier()
                t0 = time.perf_counter()
                for batch in data:
                    steps[name](batch)
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / len(data))
        comm = {name: step_ledger(name, precision, data) for name in steps if args.comm and has_ledger(name)}
        if rank == 0:
            result = {name: statistics.median(t) for name, t in times.items()}
            with open(os.path.join(os.path.dirname(store), f"times-{precision}.json"), "w") as f:
                json.dump({"median": result, "all": times, "skipped": skipped, "comm": comm}, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.process_group


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
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.process_group


def memory_worker(rank: int, world: int, store: str, name: str, precision: str) -> None:
    init(rank, world, store, 1)
    try:
        steps, _ = build_all([name], precision)
        if name in steps:
            for batch in batches(rank, 3):
                steps[name](batch)
        peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
        dist.all_reduce(peak, dist.ReduceOp.MAX)
        if rank == 0:
            with open(os.path.join(os.path.dirname(store), f"mem-{name}-{precision}.json"), "w") as f:
                json.dump(float(peak) if name in steps else None, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --nproc above 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 4 (2 with --nproc above 2)")
    parser.add_argument("--threads", type=int, default=1)
    default = [n for n in trainers() if n not in FLOOR and n not in ZEROPP3]
    parser.add_argument("--only", nargs="+", default=default, choices=list(trainers()))
    parser.add_argument("--floor", action="store_true",
                        help="also time the floor (forward + backward alone, ZeRO's share of the update alone) and "
                        "print every row's ratio to their sum")  # fmt: skip
    parser.add_argument("--memory", action="store_true", help="also peak RSS per rank, each trainer alone")
    parser.add_argument("--profile", action="store_true", help="instead of timing: rank 0's per-phase profile")
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (the 2-D trainers: an even number)")
    comm_help = "also the fzero rows' bytes per step, per axis and cross-node (on with a 2-D row)"
    parser.add_argument("--comm", action="store_true", help=comm_help)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.nproc <= 2 else 3
    if args.steps is None:
        args.steps = 4 if args.nproc <= 2 else 2
    args.comm = args.comm or any(n in ZEROPP3 for n in args.only)
    if args.comm:
        grid(args.nproc)  # an odd count fails here, naming --nproc, not in the workers
    if args.floor:
        args.only = [*args.only, *(n for n in FLOOR if n not in args.only)]
    psi = sum(p.numel() for p in make_model().parameters())
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            if args.profile:
                print(f"\n{precision}: rank 0's self CPU time per step by phase (torch.profiler), {args.steps} steps")
                store = os.path.join(tmp, f"store-prof-{precision}")
                mp.start_processes(profile_worker, args=(args.nproc, store, args, precision), nprocs=args.nproc,
                                   start_method="spawn")  # fmt: skip
                continue
            store = os.path.join(tmp, f"store-{precision}")
            mp.start_processes(time_worker, args=(args.nproc, store, args, precision), nprocs=args.nproc,
                               start_method="spawn")  # fmt: skip
            with open(os.path.join(tmp, f"times-{precision}.json")) as f:
                times = json.load(f)
            memory = {}
            if args.memory:
                for name in times["median"]:
                    print(f"peak memory: {name} ({precision})", flush=True)  # a worker that dies is named
                    store = os.path.join(tmp, f"store-mem-{name}-{precision}")
                    mp.start_processes(memory_worker, args=(args.nproc, store, name, precision), nprocs=args.nproc,
                                       start_method="spawn")  # fmt: skip
                    with open(os.path.join(tmp, f"mem-{name}-{precision}.json")) as f:
                        memory[name] = json.load(f)
            report(times, memory, precision, psi, args)


def report(times: dict, memory: dict, precision: str, psi: int, args: argparse.Namespace) -> None:
    median = times["median"]
    base = median.get("ddp")
    floor = sum(median[n] for n in FLOOR) if all(n in median for n in FLOOR) else None
    print(f"\n{precision}: {psi / 1e6:.1f}M parameters, {args.nproc} gloo ranks x {args.threads} thread(s), "
          f"micro-batch {MICRO} x {CFG.seq_len}, median of {args.rounds} rounds of {args.steps} steps")  # fmt: skip
    if floor is not None:
        print(f"floor (forward + backward alone, plus ZeRO's 1/{args.nproc} share of the update alone): {floor:.3f} s")
    print(f"| trainer | step s | vs DDP |{' vs floor |' if floor else ''}{' peak RSS MiB/rank |' if memory else ''}")
    print(f"|---|---|---|{'---|' if floor else ''}{'---|' if memory else ''}")
    for name, t in median.items():
        ratio = f"{t / base:.2f}x" if base else "-"
        over = f" {t / floor:.2f}x |" if floor else ""
        mem = f" {memory[name]:.0f} |" if memory and memory.get(name) else (" - |" if memory else "")
        print(f"| {name} | {t:.3f} | {ratio} |{over}{mem}")
    for name, why in times["skipped"].items():
        print(f"| {name} | {why} | | {'|' if memory else ''}")
    if times.get("comm"):
        report_comm(times["comm"], args.nproc)


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


if __name__ == "__main__":
    main()

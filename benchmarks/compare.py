"""fzero against DDP, FSDP2 and DeepSpeed: step time and peak memory, side by side, on 2 gloo processes (or
`--nproc`).

    .venv/bin/python benchmarks/compare.py [--precision fp32 bf16] [--rounds 5] [--steps 4] [--only NAME ...]
                                            [--memory] [--threads 1] [--profile] [--floor] [--nproc 2] [--comm]
                                            [--sweep 6,12,24] [--default-malloc]

The same model (a 27.3M-parameter 6-layer pre-LN transformer: `fzero.examples.gpt` with vocabulary 8192, width 512,
8 heads, an untied head), the same data (each rank its own micro-batch of 4 x 64 tokens) and the same optimizer
(AdamW, lr 1e-4, weight decay 0.01), under:

- `ddp`: `DistributedDataParallel` with torch's fused AdamW (bf16: `autocast`, fp32 parameters);
- `fsdp2-zeroN`: `fully_shard` on every block and the root (`reshard_after_forward=False` for ZeRO-2-like, True for
  ZeRO-3-like; bf16: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), torch's AdamW;
- `deepspeed-zeroN`: DeepSpeed's engine with the same JSON config, when DeepSpeed is installed (`pip install
  ".[bench]"`; it runs on the CPU with `DS_ACCELERATOR=cpu`);
- `fzero-zeroN` (the functional core, `train_step(donate=True)`, the loss through `fzero.call`, its defaults: each
  unit's reduction overlapped with the backward on a mesh of several processes; the model moved to `meta` after
  `fzero.init`, which copies its parameters into the state), `fzero-zeroN-serial` (the same, each reduction waited for:
  `GatherPolicy(overlap_reduce=False)`), `fzero-zeroN-fresh` (stages 0-2: the same, every step-sized buffer fresh:
  `fzero.scratch.disabled()`) and `fzero-engine-zeroN` (`fzero.initialize`, the config's defaults; its module's
  parameters then views of the state's at stages 0-2, empty at stage 3: no fzero trainer keeps the model's copy);
- ZeRO++ and hybrid sharding at stage 3, on `DistMesh(shape={"replicate": nproc // 2, "shard": 2})` (a shard group
  of 2 consecutive ranks standing for a node): `fzero-hybrid3` (`zero3(hybrid=True)`: sharded over `shard`,
  averaged over `replicate`), and sharded over all ranks `fzero-hpz3` (`hpz=True`), `fzero-qwz3` (`qwz=True`),
  `fzero-qgz3` (`qgz=True`), `fzero-zero++3` (all three). They run only when named in `--only` (an even `--nproc`),
  e.g. `--nproc 4 --only ddp fzero-zero3 fzero-hybrid3 fzero-hpz3 fzero-qwz3 fzero-qgz3 fzero-zero++3`.

Every process asks for huge pages and keeps the memory its steps free for their next step (`fzero.hostmem`:
`enable_huge_pages()`, and `retain_freed_memory()` unless `--default-malloc`), whichever trainer it runs.
Every trainer lives in the same processes and runs in rotating order, round after round (machine noise hits
them alike); each round times `--steps` steps after two warm-up steps. Prints the median step time per trainer, its
ratio to DDP's, rank 0's process CPU time per step (`time.process_time`: its threads', gloo's included; on a
machine whose cores the ranks fill, a step costs what its CPU time costs) and its ratio to DDP's, with `--floor` its
ratio to the floor (the same model's forward + backward alone, without communication or optimizer, plus the update
alone over a 1/W share of the parameters: the physical limit of a ZeRO step on this machine; `floor-fwdbwd` and
`floor-update` are timed in the same rotation), and with `--memory` the peak resident memory per rank of each trainer
run alone in a fresh pair of processes (the table: over the process's life; a line per trainer also splits it into
building the model and the trainer, `fzero.init` for fzero's, and its steps). `--profile` prints instead rank 0's
per-phase split of a step (compute, waiting on communication, optimizer, copies; the profiler's self CPU time, the
rest of the wall time unaccounted), and for fzero's steps the time inside each of its `record_function` phases
(`fzero.gather`, `fzero.forward_backward`, `fzero.reduce`, `fzero.update`, `fzero.agree`; the engine's
`fzero.forward`, `fzero.backward`), its ten costliest aten ops (self time and calls a step), and the count and total
size of one step's allocations of 2 MiB or more (`torch.profiler`'s `profile_memory`, in a step of their own). On a
machine the ranks' threads fill, an op's self time includes the time its thread waited for a core (gloo's threads
run on the same cores): a small op can show tens of milliseconds.

`--nproc N` runs N processes instead of 2 (`--rounds` and `--steps` then default to 3 and 2: on this 2-core machine
4 processes share the cores). With `--comm`, or whenever a 2-D trainer above runs, every `fzero-zeroN*` and 2-D row
also gets the bytes per step per rank of one step (rank 0's ledger, the step after one warm-up step, every trainer
on the same 2-D `DistMesh`: a 1-D `DistMesh` records no bytes, and the 1-D trainers' collectives over all ranks are
the same on it): the payload per axis (`world`: over all ranks) and the bytes received from outside the rank's
shard group (`fzero.mesh.Ledger.crossing(shape, "shard")`: the slow, cross-node share when a shard group is a node),
with `fzero-zero3`'s cross-node bytes over the row's.

`--sweep 6,12,24` repeats the run for each layer count (the model otherwise the same; `--only` then defaults to
`ddp fsdp2-zero3 deepspeed-zero3 fzero-zero3 fzero-engine-zero3`): each size is timed in its own processes, every
row as a ratio to DDP's in the same run, and with `--memory` each trainer alone per size. It prints one table per
metric, a row per trainer and a column per size, with each row's ratio-to-DDP trend from the smallest to the largest
size (flat: within 5%) and, for the fzero rows, whether their peak RSS is at most FSDP2's and DeepSpeed's at stage 3
at every size. A memory worker that dies is named and its cell left empty rather than ending the sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.examples.gpt import GPT, GPTConfig
from fzero.host import process_group

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike
if os.environ.get("FZERO_BENCH_MALLOC") != "default":  # (`--default-malloc`; the workers inherit the environment)
    fzero.hostmem.retain_freed_memory()  # every trainer's freed memory kept for its next step

CFG = GPTConfig(vocab_size=8192, seq_len=64, n_layer=6, n_head=8, d_model=512)
MICRO, LR, WD = 4, 1e-4, 0.01
COLLECTIVE_TIMEOUT_S = 600  # longer than any one trainer's steps between two barriers here (24 layers: ~20 s)
Step = Callable[[dict[str, torch.Tensor]], None]


def make_model(n_layer: int = CFG.n_layer) -> GPT:
    """The benchmark's model, `CFG` with `n_layer` blocks (seed 0, an untied head); equal at every call: no copies."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, n_layer=n_layer))
    model.head.weight = nn.Parameter(torch.randn(CFG.vocab_size, CFG.d_model) * 0.02)  # untied: 27.3M at 6 layers
    return model


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def device_type(model: nn.Module) -> str:
    """Where `model`'s parameters are: "cpu" here, "cuda" for `benchmarks/gpu.py`, which runs these trainers."""
    return next(model.parameters()).device.type


def ddp(model: nn.Module, precision: str) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    where = device_type(model)
    net = DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast(where, torch.bfloat16, enabled=precision == "bf16"):
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


def ds_config(stage: int, precision: str, micro: int = MICRO) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
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


def fzero_core(stage: int, overlap: bool | None = None, two_d: bool = False, **options: bool) -> Callable[..., Step]:
    """fzero's functional step under `fzero.zero{stage}(..., **options)`.

    Args:
      stage: the ZeRO stage.
      overlap: overlap each unit's reduction with the backward (`GatherPolicy(overlap_reduce=...)`; None: the
        default, decided by the mesh).
      two_d: on `grid_mesh()` instead of the 1-D `DistMesh()`.
      options: the preset's ZeRO++ and hybrid flags (`hybrid`, `hpz`, `qwz`, `qgz`).

    Returns:
      `build(model, precision, mesh=None)`; `mesh` overrides the trainer's own (the `--comm` ledger's).
    """

    def build(model: nn.Module, precision: str, mesh: fzero.DistMesh | None = None) -> Step:
        if mesh is None:
            mesh = grid_mesh() if two_d else fzero.DistMesh()
        preset = getattr(fzero, f"zero{stage}")
        # fused: the C kernel where the master weights are on the CPU, torch's fused kernel (DDP's) on a GPU
        tx = preset(fzero.adamw(LR, weight_decay=WD, fused=True), precision=None if precision == "fp32" else precision,
                    **options)  # fmt: skip

        def loss_fn(params: dict, batch: dict) -> torch.Tensor:
            return lm_loss(fzero.call(model, params, batch["x"]), batch["y"])

        policy = None if overlap is None else fzero.GatherPolicy(overlap_reduce=overlap)
        train = fzero.train_step(model, loss_fn, tx, mesh, donate=True, gather=policy)
        box = [fzero.init(model, tx, mesh)]
        model.to("meta")  # the state holds the parameters: free the template's own (as `fully_shard` replaces them)

        def step(batch: dict[str, torch.Tensor]) -> None:
            box[0], _ = train(box[0], batch)

        return step

    return build


def fresh_buffers(build: Callable[..., Step]) -> Callable[..., Step]:
    """`build`'s trainer with every step-sized buffer fresh (`fzero.scratch.disabled()`), as before fzero reused
    them: the paired comparison in one rotation."""

    def wrapped(model: nn.Module, precision: str, **kw: Any) -> Step:
        with fzero.scratch.disabled():
            step = build(model, precision, **kw)

        def run(batch: dict[str, torch.Tensor]) -> None:
            with fzero.scratch.disabled():
                step(batch)

        return run

    return wrapped


def fzero_engine(stage: int, micro: int = MICRO) -> Callable[[nn.Module, str], Step]:
    def build(model: nn.Module, precision: str) -> Step:
        engine, *_ = fzero.initialize(model=model, config=ds_config(stage, precision, micro), mesh=fzero.DistMesh(),
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
SWEEP = ("ddp", "fsdp2-zero3", "deepspeed-zero3", "fzero-zero3", "fzero-engine-zero3")  # --sweep's default --only
PEERS3 = ("fsdp2-zero3", "deepspeed-zero3")  # --sweep: the stage-3 peak RSS that fzero's rows should stay within
ZEROPP3 = {  # on the 2-D mesh; named in --only to run
    "fzero-hybrid3": {"hybrid": True},
    "fzero-hpz3": {"hpz": True},
    "fzero-qwz3": {"qwz": True},
    "fzero-qgz3": {"qgz": True},
    "fzero-zero++3": {"hpz": True, "qwz": True, "qgz": True},
}


def ddp_core_engine(micro: int = MICRO) -> dict[str, Callable[[nn.Module, str], Step]]:
    """DDP, the core and the engine at stages 0-3 (what `benchmarks/gpu.py` and `host_overhead.py` time), the engine
    with `micro` sequences per micro-batch."""
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp": ddp}
    out.update({f"fzero-zero{s}": fzero_core(s) for s in range(4)})
    out.update({f"fzero-engine-zero{s}": fzero_engine(s, micro) for s in range(4)})
    return out


def trainers() -> dict[str, Callable[[nn.Module, str], Step]]:
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp": ddp}
    for stage in (2, 3):
        out[f"fsdp2-zero{stage}"] = fsdp2(stage)
    for stage in (1, 2, 3):
        out[f"deepspeed-zero{stage}"] = deepspeed_engine(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}"] = fzero_core(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}-serial"] = fzero_core(stage, overlap=False)
    for stage in (0, 1, 2):
        out[f"fzero-zero{stage}-fresh"] = fresh_buffers(fzero_core(stage))
    for stage in (0, 1, 2, 3):
        out[f"fzero-engine-zero{stage}"] = fzero_engine(stage)
    out.update(zip(FLOOR, (floor_forward_backward, floor_update), strict=True))
    for name, options in ZEROPP3.items():
        out[name] = fzero_core(3, two_d=True, **options)
    return out


def has_ledger(name: str) -> bool:
    """Whether the `--comm` table measures trainer `name` (fzero's functional core: its builder takes `mesh=`)."""
    return name in ZEROPP3 or (name.startswith("fzero-zero") and not name.startswith("fzero-engine"))


def step_ledger(
    name: str, precision: str, data: list[dict[str, torch.Tensor]], n_layer: int = CFG.n_layer
) -> dict[str, dict[str, int]]:
    """One step's ledger (after one warm-up step) of a fresh `name` trainer on `grid_mesh()`, this rank's."""
    mesh = grid_mesh()
    step = trainers()[name](make_model(n_layer), precision, mesh=mesh)
    step(data[0])
    with mesh.record() as ledger:
        step(data[1 % len(data)])
    return ledger.as_dict()


def batches(rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    toks = [torch.randint(0, CFG.vocab_size, (MICRO, CFG.seq_len + 1), generator=g) for _ in range(n)]
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]


def build_all(names: list[str], precision: str, n_layer: int = CFG.n_layer) -> tuple[dict[str, Step], dict[str, str]]:
    steps, skipped = {}, {}
    for name in names:
        try:
            steps[name] = trainers()[name](make_model(n_layer), precision)
        except ImportError as e:  # DeepSpeed not installed
            skipped[name] = f"not installed ({e.name})"
    return steps, skipped


def init(rank: int, world: int, store: str, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what launchers set
    # a rank whose peer is gone fails within minutes rather than gloo's default half hour: the run ends, naming it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip


def time_worker(
    rank: int, world: int, store: str, args: argparse.Namespace, precision: str, n_layer: int = CFG.n_layer
) -> None:
    init(rank, world, store, args.threads)
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
            for name in order[r % len(order) :] + order[: r % len(order)]:
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
                json.dump({"median": result, "all": times, "cpu": cpu_median, "skipped": skipped, "comm": comm}, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


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
        process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


def high_water_mib(reset: bool = False) -> float:
    """This process's peak resident set (`VmHWM`) in MiB since the last reset; with `reset`, a new one starts after
    it is read (Linux's `clear_refs`)."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return hwm


def memory_worker(rank: int, world: int, store: str, name: str, precision: str, n_layer: int = CFG.n_layer) -> None:
    init(rank, world, store, 1)
    try:
        high_water_mib(reset=True)
        steps, _ = build_all([name], precision, n_layer)
        phases = [high_water_mib(reset=True)]  # the model built and the trainer set up (fzero.init: the state)
        if name in steps:
            for batch in batches(rank, 3):
                steps[name](batch)
        phases.append(high_water_mib())  # the steps
        life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, the process's whole life
        figures = torch.tensor([life, *phases])
        dist.all_reduce(figures, dist.ReduceOp.MAX)
        peak, built, stepped = figures.tolist()
        if rank == 0:
            print(f"peak memory: {name}: {peak:.0f} MiB; building the model and the trainer {built:.0f}, the steps "
                  f"{stepped:.0f} (the larger rank's)", flush=True)  # fmt: skip
            with open(os.path.join(os.path.dirname(store), f"mem-{name}-{precision}.json"), "w") as f:
                json.dump(peak if name in steps else None, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


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


def measure(tmp: str, precision: str, args: argparse.Namespace, n_layer: int = CFG.n_layer) -> tuple[dict, dict]:
    """Times `args.only` together in one set of processes and, with `--memory`, each alone in fresh ones.

    Args:
      tmp: an empty folder for the process-group stores and the workers' result files.
      precision: "fp32" or "bf16".
      args: the parsed command line.
      n_layer: the model's layer count.

    Returns:
      `(times, memory)`: the time workers' results (`median`, `all`, `cpu`, `skipped`, `comm`) and the peak RSS per
      rank in MiB by trainer (`None` for one skipped, or, under `--sweep`, one whose memory worker died).
    """
    store = os.path.join(tmp, f"store-{precision}")
    mp.start_processes(time_worker, args=(args.nproc, store, args, precision, n_layer), nprocs=args.nproc,
                       start_method="spawn")  # fmt: skip
    with open(os.path.join(tmp, f"times-{precision}.json")) as f:
        times = json.load(f)
    memory = {}
    for name in times["median"] if args.memory else ():
        sized = f", {n_layer} layers" if args.sweep else ""
        print(f"peak memory: {name} ({precision}{sized})", flush=True)  # a worker that dies is named
        store = os.path.join(tmp, f"store-mem-{name}-{precision}")
        try:
            mp.start_processes(memory_worker, args=(args.nproc, store, name, precision, n_layer), nprocs=args.nproc,
                               start_method="spawn")  # fmt: skip
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if not args.sweep:
                raise
            print(f"peak memory: {name} ({precision}{sized}): the worker died: {e}", flush=True)  # keep the sweep
            memory[name] = None
            continue
        with open(os.path.join(tmp, f"mem-{name}-{precision}.json")) as f:
            memory[name] = json.load(f)
    return times, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --nproc above 2)")
    parser.add_argument("--steps", type=int, default=None, help="default 4 (2 with --nproc above 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="+", default=None, choices=list(trainers()),
                        help="default: every 1-D trainer (with --sweep: " + " ".join(SWEEP) + ")")  # fmt: skip
    parser.add_argument("--floor", action="store_true",
                        help="also time the floor (forward + backward alone, ZeRO's share of the update alone) and "
                        "print every row's ratio to their sum")  # fmt: skip
    parser.add_argument("--memory", action="store_true", help="also peak RSS per rank, each trainer alone")
    parser.add_argument("--profile", action="store_true", help="instead of timing: rank 0's per-phase profile")
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (the 2-D trainers: an even number)")
    comm_help = "also the fzero rows' bytes per step, per axis and cross-node (on with a 2-D row)"
    parser.add_argument("--comm", action="store_true", help=comm_help)
    parser.add_argument("--sweep", type=layer_counts, default=None, metavar="L1,L2,...",
                        help="repeat for each layer count; one table per metric, a column per size")  # fmt: skip
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc be (default: fzero.hostmem.retain_freed_memory())")  # fmt: skip
    args = parser.parse_args()
    if args.default_malloc:
        os.environ["FZERO_BENCH_MALLOC"] = "default"
    if args.sweep and args.profile:
        parser.error("--sweep times and measures memory; --profile profiles one size: give one of them")
    if args.only is None:
        args.only = list(SWEEP) if args.sweep else [n for n in trainers() if n not in FLOOR and n not in ZEROPP3]
    if args.rounds is None:
        args.rounds = 5 if args.nproc <= 2 else 3
    if args.steps is None:
        args.steps = 4 if args.nproc <= 2 else 2
    args.comm = args.comm or any(n in ZEROPP3 for n in args.only)
    if args.comm:
        grid(args.nproc)  # an odd count fails here, naming --nproc, not in the workers
    if args.floor:
        args.only = [*args.only, *(n for n in FLOOR if n not in args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            if args.sweep:
                runs = {}
                for n in args.sweep:
                    print(f"sweep: {n} layers ({precision})", flush=True)
                    os.mkdir(folder := os.path.join(tmp, f"layers-{n}-{precision}"))
                    runs[n] = measure(folder, precision, args, n)
                report_sweep(runs, precision, args)
                continue
            if args.profile:
                print(f"\n{precision}: rank 0's self CPU time per step by phase (torch.profiler), {args.steps} steps")
                store = os.path.join(tmp, f"store-prof-{precision}")
                mp.start_processes(profile_worker, args=(args.nproc, store, args, precision), nprocs=args.nproc,
                                   start_method="spawn")  # fmt: skip
                continue
            times, memory = measure(tmp, precision, args)
            report(times, memory, precision, n_params(CFG.n_layer), args)


def n_params(n_layer: int) -> int:
    """The parameter count of `make_model(n_layer)`."""
    return sum(p.numel() for p in make_model(n_layer).parameters())


def report(times: dict, memory: dict, precision: str, psi: int, args: argparse.Namespace) -> None:
    median = times["median"]
    base = median.get("ddp")
    floor = sum(median[n] for n in FLOOR) if all(n in median for n in FLOOR) else None
    print(f"\n{precision}: {psi / 1e6:.1f}M parameters, {args.nproc} gloo ranks x {args.threads} thread(s), "
          f"micro-batch {MICRO} x {CFG.seq_len}, median of {args.rounds} rounds of {args.steps} steps")  # fmt: skip
    if floor is not None:
        print(f"floor (forward + backward alone, plus ZeRO's 1/{args.nproc} share of the update alone): {floor:.3f} s")
    cpu, cpu_base = times["cpu"], times["cpu"].get("ddp")
    print(f"| trainer | step s | vs DDP | CPU s | CPU vs DDP |{' vs floor |' if floor else ''}"
          f"{' peak RSS MiB/rank |' if memory else ''}")  # fmt: skip
    print(f"|---|---|---|---|---|{'---|' if floor else ''}{'---|' if memory else ''}")
    for name, t in median.items():
        ratio = f"{t / base:.2f}x" if base else "-"
        cpu_ratio = f"{cpu[name] / cpu_base:.2f}x" if cpu_base else "-"
        over = f" {t / floor:.2f}x |" if floor else ""
        mem = f" {memory[name]:.0f} |" if memory and memory.get(name) else (" - |" if memory else "")
        print(f"| {name} | {t:.3f} | {ratio} | {cpu[name]:.3f} | {cpu_ratio} |{over}{mem}")
    for name, why in times["skipped"].items():
        print(f"| {name} | {why} | | | | {'|' if memory else ''}")
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


if __name__ == "__main__":
    main()

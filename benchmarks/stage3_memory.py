"""Stage 3's memory as a new user meets it: a plain `nn.Sequential` handed to `fzero.initialize` with a DeepSpeed
config, against fzero's stage 2 and DeepSpeed's own stage 3; then ZeRO-Infinity's NVMe tiers against memory.

    .venv/bin/python benchmarks/stage3_memory.py [--layers 24] [--steps 5] [--micro 8]
        [--stages fzero2 fzero3 deepspeed3] [--sizes 25,100] [--nvme-path DIR] [--no-stages] [--no-tiers]
        [--threads 1] [--timeout 900] [--interval 0.005]

Part 1 (`--stages`), 2 gloo processes (`torch.multiprocessing` spawn, a file store; RANK, WORLD_SIZE, LOCAL_RANK set
as a launcher sets them), 1 torch thread each: `nn.Sequential` of `--layers` blocks of `nn.Linear(1024, 1024,
bias=False)` + `nn.ReLU()` (no `nn.ModuleList`), built in memory on every rank (seed 0), handed to
`fzero.initialize(model=..., model_parameters=model.parameters(), config=...)` (`fzero2`, `fzero3`) or to DeepSpeed
0.19's `deepspeed.initialize` (`deepspeed2`, `deepspeed3`; `DS_ACCELERATOR=cpu`) with the same config: AdamW (lr
1e-4, weight decay 0.01), fp32, `train_micro_batch_size_per_gpu` `--micro` rows of 1024 features per rank, MSE
against random targets; `--steps` steps of `loss = F.mse_loss(engine(x), y); engine.backward(loss); engine.step()`
(DeepSpeed's AdamW op, `FusedAdamBuilder`, is JIT-built on its first use, minutes on 2 cores, and loaded before the
start is measured). Part 2 (`--sizes`, in millions of parameters), 1 process (`fzero.initialize` without a launcher:
a one-rank mesh), `--threads` torch threads: 24 bias-free square `nn.Linear` + ReLU, the width the multiple of 64
nearest to sqrt(size / 24), stage 3 with `offload_optimizer` and `offload_param` on `nvme` (`nvme_path`:
`--nvme-path`, default a fresh directory under the system's temporary directory, removed at the end), against the
same in memory (device `none`), the same config otherwise.

Every configuration runs in fresh processes of its own (a freed heap is not given back at once: a second
configuration in the same process would start from the first's high-water mark), with the allocator as a user has
it: no `fzero.hostmem` call, no `MALLOC_*` variable. The numbers, per rank, in MiB:

- start: the process's resident set (VmRSS) once torch and the library are imported (and, in part 1, the process
  group made), before the model is built; every other figure is over it. The resident high-water mark is reset there
  (`/proc/self/clear_refs`).
- peak RSS: VmHWM (the whole resident set's peak, file-backed pages of mapped libraries included) minus start.
- peak RssAnon (anonymous resident memory: the heap, where tensors live) minus start's RssAnon, per phase:
  construction (the model built), initialize, the steps. RssAnon has no high-water mark: a thread samples it every
  `--interval` seconds, and it is read at every phase change and after every step (a shorter spike can be missed).
- after: VmRSS and RssAnon after the last step, minus start's; and the live tensors then, the bytes of the CPU
  tensors the garbage collector reaches (and their `.grad`s), each storage once: what the program holds (allocated:
  pages never touched count too), against what the allocator keeps resident.
- gathered: fzero's `engine.step_metrics["gathered_peak"]` (the most parameter elements gathered at once on a rank
  during a step's forward and backward; the largest over the steps) over the model's elements: at stage 3, the share
  of the model that existed whole at once; 100% means one unit held the whole model. units: how many units fzero cut
  the model into (`engine.state.layout.units`).
- part 2: the training state, 16 bytes a parameter (fp32 master 4 + Adam's two moments 8 + the compute copy 4),
  `fzero.state_bytes` (resident, offloaded), the bytes the swap files take on disk (allocated blocks, both slots),
  the median step time and whether the last loss equals the in-memory run's (it should, bitwise).

A configuration that fails prints its traceback, and its row says why; one that runs past `--timeout` seconds prints
its threads' stacks (`faulthandler`, 10 s before) and is stopped, and its row says so. The report opens with the
CPU's model, its AVX2 / AVX-512 flags, the cores, the memory, the versions and the command line.

Measured 2026-11-28 at e4be34b (`.venv/bin/python benchmarks/stage3_memory.py`, 153 s; AMD EPYC family 25 model 1,
Zen 3: AVX2, no AVX-512; 2 cores shared with other jobs, 23.5 GiB; the swap files on ext4). Part 1, MiB over the
start (229; DeepSpeed's 247), rank 0 / rank 1; "one unit": the same at ebdd146, before `fzero.layout.Auto` (57fa15f),
when the engine made this model one unit and warned so:

| configuration | units | peak RSS | peak RssAnon, steps | after: RssAnon (live tensors) | gathered | step s |
|---|---|---|---|---|---|---|
| fzero stage 2 | 24 | 380 / 403 | 367 / 391 | 325 / 391 (288) | - | 0.50 |
| fzero stage 3 | 24 | 439 / 425 | 427 / 413 | 383 / 365 (192) | 8% (2 units) | 0.67 |
| fzero stage 3, one unit | 1 | 460 / 456 | 447 / 443 | 303 / 295 (192) | 100% | 1.7 (busier) |
| DeepSpeed stage 3 | - | 874 / 964 | 856 / 945 | 660 / 685 (2148) | - | 1.23 |

The live tensors are the state (stage 3: 144 MiB, master 48 + Adam 96, plus the gradient shard 48); the rest of the
resident heap is glibc's (freed, kept), and moves by ~100 MiB between ranks and runs: at this size stage 3 gathering
8% instead of 100% of the model does not show in the peak. DeepSpeed's live figure includes its stage-3 reduce
bucket, `torch.empty(reduce_bucket_size)` (5e8 fp32, 1907 MiB), mostly never touched. Part 2 (1 thread, 5 steps):

| params | state, 16 B/param | peak RssAnon: memory (init) | nvme (init) | nvme after (live) | disk | step s |
|---|---|---|---|---|---|---|
| 25.2M (d 1024) | 384 | 727 (430) | 410 (281) | 410 (160) | 768 | 0.54 / 1.95 |
| 100.7M (d 2048) | 1536 | 2865 (1692) | 1588 (977) | 1588 (449) | 3072 | 2.11 / 9.98 |

Last losses bitwise equal. The NVMe run's resident state is 64 MiB (staging) and its live tensors after a step 449
MiB (the 384 MiB gradient and the staging), yet its peak is the size of the whole state it offloads: on one rank
each step's reduce-scatter copies the full gradient twice (`torch.stack` in `fzero.mesh.lockstep`, `torch.cat` in
`fzero.layout.flat.to_rank_major`: 0.7 s of a 2 s step in memory at 100M), and glibc keeps what is freed (at ebdd146,
one unit: 2006 MiB).

Measured 2026-11-28 (`--no-stages --sizes 25,100`, same machine, busy), after the NVMe tier hands back what a step
passed through (staging sets mapped per update, unit reads in mappings of their own, spares and heap pages handed
back before the update: docs/offload.md, Memory), peak RssAnon over the start, construction / initialize / steps:
25.2M nvme 96 / 284 / 163 (before 96 / 292 / 417), 100.7M nvme 384 / 861 / 567; last losses bitwise equal. The
steps are under half the training state (192 / 768 MiB); initialize is not: it still builds the whole fp32 shard in
memory beside the model before writing it to disk.

Measured 2026-11-28 (`--no-stages --sizes 25,100`, same machine, busy), after `fzero.init` builds the NVMe tier's
shard in a file under `nvme_path` (`fzero.storage.Spill`, each unit's pages dropped once written; docs/offload.md,
Memory): 25.2M nvme 96 / 188 / 163, 100.7M nvme 384 / 473 / 551; last losses bitwise equal. All three phases are under
half the training state. Initialize's peak is the model (built before it, emptied by the engine only after `init`)
plus the staging sets (64 MiB) and a unit or two; the nvme peak RSS (VmHWM: 290 / 862) counts the spill's clean file
pages while the store reads them back.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (read by DeepSpeed at import, in the workers)

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from procmem import PeakRss, proc_status  # (this directory)
from torch import nn

MiB = 2**20
WIDTH = 1024  # part 1's features
TIER_LAYERS = 24  # part 2's depth
ROWS = {"fzero2": ("fzero", 2), "fzero3": ("fzero", 3), "deepspeed2": ("deepspeed", 2), "deepspeed3": ("deepspeed", 3)}


# ---------------------------------------------------------------------------------------------------- the machine
def machine() -> str:
    """One line: the CPU's model and family/model numbers, its AVX flags, cores, memory, versions, commit."""
    info: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    avx = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["no avx2"]
    with open("/proc/meminfo") as f:
        mem = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) * 1024
    spec = importlib.util.find_spec("fzero")  # (located, not imported: the workers import it)
    where = os.path.dirname(spec.origin) if spec and spec.origin else None
    versions = [f"torch {torch.__version__}", f"fzero from {where or '?'}"]
    try:
        from importlib.metadata import version

        versions.append(f"deepspeed {version('deepspeed')}")
    except Exception:  # not installed: part 1's DeepSpeed rows will say so
        versions.append("deepspeed not installed")
    commit = ""
    try:  # the commit of the repository fzero is imported from, if it is one
        git = ["git", "-C", where or ".", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
        diff = ["git", "-C", where or ".", "diff", "--quiet", "HEAD", "--", "."]
        if commit and subprocess.run(diff, capture_output=True, timeout=30).returncode == 1:
            commit += " + uncommitted changes under fzero/"
    except (OSError, subprocess.SubprocessError):
        pass
    return (
        f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')}, model "
        f"{info.get('model', '?')}; {', '.join(avx)}), {len(os.sched_getaffinity(0))} cores, "
        f"{mem / 2**30:.1f} GiB memory; {', '.join(versions)}{f'; fzero at {commit}' if commit else ''}"
    )


def live_tensor_bytes() -> int:
    """Bytes of the CPU tensors the garbage collector reaches (and their `.grad`s), each storage once: what the
    program holds, as against what the allocator keeps resident."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on some modules' deprecated attributes warns)
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor):
                    continue
                for t in (obj, obj.grad if obj.is_leaf else None):
                    if t is not None and t.device.type == "cpu" and t.layout == torch.strided:
                        storage = t.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # (tensor subclasses without storage, tensors being torn down)
                continue
    return sum(seen.values())


def reset_peak() -> None:
    """Reset this process's resident high-water mark (VmHWM) to its resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Sampler(PeakRss):
    """RssAnon's peak per phase: `PeakRss`'s thread, each sample counted in the current phase, which `phase()`
    ends and reads."""

    def __init__(self, interval: float) -> None:
        self.name, self.peaks, self.at_end = "start", {}, {}
        super().__init__(interval)

    def sample(self) -> int:
        now, name = super().sample(), self.name
        self.peaks[name] = max(self.peaks.get(name, 0), now)
        return now

    def phase(self, name: str) -> None:
        """End the current phase (its last value kept) and start `name`."""
        self.at_end[self.name] = self.sample()
        self.name = name
        self.sample()

    def stop(self) -> int:
        if not self._stop.is_set():
            super().stop()
            self.phase("end")
        return self.peak


def build_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width, bias=False), nn.ReLU())))


def ds_config(stage: int, micro: int, offload: dict[str, Any] | None = None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload is not None:
        zero.update(offload_optimizer=offload, offload_param=offload)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def train(args: Any, lib: str, layers: int, width: int, config: dict, rank: int, result: dict) -> Any:
    """Build, initialize and train, filling `result` as it goes (a failure leaves what was measured): the engine."""
    if lib == "deepspeed":
        import deepspeed
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()  # the AdamW op, JIT-built on first use (minutes, once): before the start
        initialize = deepspeed.initialize
    else:
        import fzero

        initialize = fzero.initialize
    start_rss, start_anon = proc_status("VmRSS"), proc_status("RssAnon")
    reset_peak()
    result.update(start=start_rss, start_anon=start_anon)
    sampler = Sampler(args.interval)
    try:
        sampler.phase("construction")
        model = build_model(layers, width)
        numel = sum(p.numel() for p in model.parameters())
        result["numel"] = numel
        sampler.phase("initialize")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
        for w in caught:  # (shown as they would have been; those about units kept for the report)
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        result["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught if "unit" in str(w.message)})
        del model  # (the user's name for it: the engine keeps what it needs)
        if lib == "fzero":
            result["units"] = len(engine.state.layout.units)
            result["state"] = fzero.state_bytes(engine.state)
        sampler.phase("steps")
        gen = torch.Generator().manual_seed(1000 + rank)
        data = [
            (torch.randn(args.micro, width, generator=gen), torch.randn(args.micro, width, generator=gen))
            for _ in range(args.steps)
        ]
        times, gathered = [], []
        for x, y in data:
            t0 = time.perf_counter()
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            sampler.sample()
            metrics = getattr(engine, "step_metrics", None) or {}
            if metrics.get("gathered_peak") is not None:
                gathered.append(int(metrics["gathered_peak"]))
            result.update(times=times, loss=loss.item(), gathered=max(gathered) if gathered else None)
        sampler.stop()
        result["live"] = live_tensor_bytes()
        return engine
    finally:
        sampler.stop()
        hwm, rss, anon = (proc_status(key) for key in ("VmHWM", "VmRSS", "RssAnon"))
        result.update(hwm=hwm, rss=rss, anon=anon, peaks=sampler.peaks, at_end=sampler.at_end)


def _write(out: str, name: str, result: dict[str, Any]) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------------------------- part 1: the stages
def stage_worker(rank: int, world: int, store: str, out: str, row: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 10))  # a hung rank says where, before it is stopped
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    lib, stage = ROWS[row]
    result: dict[str, Any] = {"rank": rank}
    try:
        engine = train(args, lib, args.layers, WIDTH, ds_config(stage, args.micro), rank, result)
        del engine
    except BaseException as e:  # (a failed DeepSpeed op build can raise SystemExit): say it, then fail the run
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        print(f"{row}, rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        _write(out, f"{row}-{rank}.json", result)
        try:
            from fzero.host import process_group

            process_group.shutdown()  # (not destroy_process_group: see fzero.host.process_group)
        except ImportError:
            dist.destroy_process_group()


def run(fn: Any, fn_args: tuple[Any, ...], nprocs: int, timeout: float) -> str | None:
    """`fn` on `nprocs` fresh spawned processes; None when all finished, else why not (a failure, the timeout)."""
    ctx = mp.start_processes(fn, args=fn_args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                return f"stopped after {timeout:.0f} s (--timeout)"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"
    return None


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f}"


def part1(args: argparse.Namespace, tmp: str) -> None:
    numel = args.layers * WIDTH * WIDTH
    print(
        f"\n## 1. {args.layers} x (Linear({WIDTH}, {WIDTH}, bias=False), ReLU) in an nn.Sequential: "
        f"{numel / 1e6:.2f}M parameters, {numel * 4 / MiB:.0f} MiB fp32; 2 gloo processes x 1 thread, micro-batch "
        f"{args.micro} x {WIDTH}, AdamW fp32, {args.steps} steps; each configuration in fresh processes\n",
        flush=True,
    )
    rows: dict[str, tuple[list[dict[str, Any]], str | None]] = {}
    for row in args.stages:
        print(f"running {row} ...", flush=True)
        os.makedirs(out := os.path.join(tmp, row))
        t0 = time.perf_counter()
        why = run(stage_worker, (2, os.path.join(out, "store"), out, row, args), 2, args.timeout)
        results = []
        for rank in range(2):
            path = os.path.join(out, f"{row}-{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        rows[row] = (results, why)
        print(f"{row}: {time.perf_counter() - t0:.0f} s{f' ({why})' if why else ''}", flush=True)
    print(
        "\n| configuration | rank | units | start RSS | peak RSS | peak RssAnon: construction / initialize / steps "
        "| after last step: RSS / RssAnon / live tensors | gathered / model | step s (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    notes = []
    for row, (results, why) in rows.items():
        for r in results:
            start, anon0, peaks = r.get("start", 0), r.get("start_anon", 0), r.get("peaks", {})
            phases = " / ".join(
                mib(peaks[p] - anon0) if p in peaks else "-" for p in ("construction", "initialize", "steps")
            )
            g = r.get("gathered") if ROWS[row][1] == 3 else None  # (stages 0-2 keep the whole model gathered)
            gathered = f"{g / r['numel']:.0%} ({g / 1e6:.2f}M)" if g is not None and r.get("numel") else "-"
            step = f"{statistics.median(r['times']):.3f}" if r.get("times") else "-"
            after = f"{mib(r['rss'] - start)} / {mib(r['anon'] - anon0)} / {mib(r.get('live'))}" if "rss" in r else "-"
            print(
                f"| {row} | {r['rank']} | {r.get('units', '-')} | {mib(start)} | "
                f"{mib(r['hwm'] - start) if 'hwm' in r else '-'} | {phases} | {after} | {gathered} | {step} |"
            )
            if r.get("error"):
                notes.append(f"{row}, rank {r['rank']}: {r['error']}")
            for w in r.get("warnings", []) if r["rank"] == 0 else []:
                notes.append(f"{row}: warned: {w}")
            if r.get("state") and r["rank"] == 0:
                s = r["state"]
                notes.append(
                    f"{row}: fzero.state_bytes per rank: total {mib(s['total'])} MiB (master "
                    f"{mib(s['master'])}, compute {mib(s['compute'])}, optimizer {mib(s['optimizer'])})"
                )
        if why and not any(r.get("error") for r in results):  # (a rank's own message says more)
            notes.append(f"{row}: {why}")
            if not results:
                print(f"| {row} | - | {why} | | | | | | |")
    if notes:
        print("\n" + "\n".join(f"- {n}" for n in notes))
    print(
        f"\nMiB per rank; start: VmRSS after the imports and the process group, before the model; peak RSS: VmHWM "
        f"- start; RssAnon over start's RssAnon, sampled every {args.interval * 1e3:g} ms and at each phase and "
        f"step; live tensors: the CPU tensors the garbage collector reaches and their .grad, each storage once (what "
        f"the program holds; RssAnon beyond it is the allocator's). One fp32 copy of the model is "
        f"{numel * 4 / MiB:.0f} MiB; 1/2 of it {numel * 2 / MiB:.0f}."
    )


# --------------------------------------------------------------------------------------------- part 2: the tiers
def tier_width(size_m: float) -> int:
    """The width (a multiple of 64) whose `TIER_LAYERS` square bias-free layers come nearest `size_m` million."""
    return max(64, 64 * round(math.sqrt(size_m * 1e6 / TIER_LAYERS) / 64))


def filesystem(path: str) -> str:
    """The filesystem type of `path` and its mount point (/proc/mounts' longest mount point containing it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as f:
        for fields in (line.split() for line in f):
            mount = fields[1].replace("\\040", " ") if len(fields) > 2 else ""
            if mount and (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return f"{kind} at {best}"


def disk_bytes(root: str) -> int:
    """Bytes allocated on disk (st_blocks) by the files under `root`."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def tier_worker(_: int, out: str, size_m: float, mode: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 10))
    offload = {"device": "nvme", "nvme_path": args.nvme_path} if mode == "nvme" else {"device": "none"}
    result: dict[str, Any] = {}
    try:
        engine = train(args, "fzero", TIER_LAYERS, tier_width(size_m), ds_config(3, args.micro, offload), 0, result)
        result["disk"] = disk_bytes(args.nvme_path) if mode == "nvme" else 0
        if hasattr(engine, "close"):
            engine.close()
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        print(f"{size_m}M {mode} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        _write(out, f"tier-{size_m}-{mode}.json", result)


def part2(args: argparse.Namespace, tmp: str) -> None:
    threads = args.threads or len(os.sched_getaffinity(0))
    print(
        f"\n## 2. ZeRO-Infinity tiers, 1 process ({threads} torch thread(s)): {TIER_LAYERS} x "
        f"(Linear(d, d, bias=False), ReLU), stage 3 fp32 AdamW, micro-batch {args.micro}, {args.steps} steps; "
        f"offload_optimizer + offload_param nvme (nvme_path {args.nvme_path}, {filesystem(args.nvme_path)}) against "
        "in memory\n",
        flush=True,
    )
    results: dict[float, dict[str, dict[str, Any]]] = {}
    for size_m in args.sizes:
        for mode in ("memory", "nvme"):
            print(f"running {size_m:g}M {mode} ...", flush=True)
            t0 = time.perf_counter()
            why = run(tier_worker, (tmp, size_m, mode, args), 1, args.timeout)
            path = os.path.join(tmp, f"tier-{size_m}-{mode}.json")
            r: dict[str, Any] = {}
            if os.path.exists(path):
                with open(path) as f:
                    r = json.load(f)
            if why:
                r["why"] = why
            results.setdefault(size_m, {})[mode] = r
            print(f"{size_m:g}M {mode}: {time.perf_counter() - t0:.0f} s{f' ({why})' if why else ''}", flush=True)
    print(
        "\n| params | d | state 16 B/param | start RSS | in memory: peak RssAnon construction / initialize / steps | "
        "nvme: peak RssAnon construction / initialize / steps | nvme: peak RSS | after last step, RssAnon / live "
        "tensors: in memory; nvme | resident state: in memory / nvme | offloaded | on disk | step s: in memory / nvme "
        "| last loss equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for size_m, by in results.items():
        d = tier_width(size_m)
        numel = TIER_LAYERS * d * d
        cells = [f"{numel / 1e6:.1f}M", str(d), mib(16 * numel), mib(by["memory"].get("start"))]
        for mode in ("memory", "nvme"):
            r = by[mode]
            peaks, anon0 = r.get("peaks", {}), r.get("start_anon", 0)
            cells.append(
                " / ".join(
                    mib(peaks[p] - anon0) if p in peaks else "-" for p in ("construction", "initialize", "steps")
                )
            )
            if r.get("error") or r.get("why"):  # (the worker's own message, else how the run ended)
                notes.append(f"{size_m:g}M {mode}: {r.get('error') or r['why']}")
        nv, mem = by["nvme"], by["memory"]
        cells.append(mib(nv["hwm"] - nv["start"]) if "hwm" in nv else "-")
        cells.append(
            "; ".join(
                f"{mib(r['anon'] - r['start_anon'])} / {mib(r.get('live'))}" if "anon" in r else "-" for r in (mem, nv)
            )
        )
        cells.append(" / ".join(mib(r["state"]["total"]) if r.get("state") else "-" for r in (mem, nv)))
        cells.append(mib(nv["state"]["offloaded"]) if nv.get("state") else "-")
        cells.append(mib(nv.get("disk")))
        cells.append(" / ".join(f"{statistics.median(r['times']):.2f}" if r.get("times") else "-" for r in (mem, nv)))
        same = "loss" in mem and "loss" in nv and len(mem["times"]) == len(nv["times"])
        cells.append(str(mem["loss"] == nv["loss"]) if same else "-")
        print("| " + " | ".join(cells) + " |")
    if notes:
        print("\n" + "\n".join(f"- {n}" for n in notes))
    print(
        f"\nMiB; peak RssAnon over the start's RssAnon (sampled every {args.interval * 1e3:g} ms and at each phase and "
        "step); state 16 B/param: fp32 master 4 + Adam 8 + compute copy 4; resident state: fzero.state_bytes total "
        "(the NVMe tier's staging buffers included); offloaded: one version of the swapped leaves; on disk: the swap "
        "files' allocated blocks (two slots each); live tensors: the CPU tensors the garbage collector reaches, each "
        "storage once (what the program holds; RssAnon beyond it is the allocator's)."
    )


# --------------------------------------------------------------------------------------------------------- main
def sizes(text: str) -> list[float]:
    try:
        out = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes takes millions of parameters separated by commas, got {text!r}"
        ) from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"--sizes takes positive sizes, got {text!r}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24, help="part 1's Linear(1024, 1024) blocks")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch (train_micro_batch_size_per_gpu)")
    p.add_argument(
        "--stages",
        nargs="+",
        default=["fzero2", "fzero3", "deepspeed3"],
        choices=list(ROWS),
        help="part 1's configurations",
    )
    p.add_argument("--sizes", type=sizes, default=[25.0, 100.0], help="part 2's model sizes, millions of parameters")
    p.add_argument("--nvme-path", help="part 2's swap directory (default: a fresh one under the system temp dir)")
    p.add_argument("--no-stages", action="store_true", help="skip part 1")
    p.add_argument("--no-tiers", action="store_true", help="skip part 2")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="part 2's torch threads (0: every core; more than 1 on a busy shared machine can be far slower)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds a configuration may run before it is stopped")
    p.add_argument("--interval", type=float, default=0.005, help="RssAnon's sampling period, seconds")
    args = p.parse_args()
    print(f"# stage 3 memory on {machine()}")
    print(f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}", flush=True)
    start = time.perf_counter()
    made = None
    try:
        with tempfile.TemporaryDirectory(prefix="stage3-memory-") as tmp:
            if not args.no_stages:
                part1(args, tmp)
            if not args.no_tiers:
                if args.nvme_path is None:
                    made = args.nvme_path = tempfile.mkdtemp(prefix="fzero-nvme-")
                args.nvme_path = os.path.abspath(args.nvme_path)
                part2(args, tmp)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

"""ZeRO-Infinity's NVMe tier on this machine: the disk's own bandwidth, training with the tier, its memory.

    .venv/bin/python benchmarks/offload.py [--dir DIR] [--disk-mib 512] [--rounds 3] [--io-threads 1 4]
        [--layers 6] [--d-model 256] [--seq-len 128] [--steps 6] [--nproc 1 [2]] [--memory] [--memory-engine]
        [--sweep 6,12,24]
        [--deepspeed] [--speculate] [--quick]

Everything goes through fzero's own I/O layer (`fzero.storage`), in `--dir` (default: a temporary directory under
the repository's `runs/`, i.e. on the repository's filesystem, not on a tmpfs /tmp), removed at the end:

1. The disk: a sequential write, then a sequential read, of one `SwapFile` of `--disk-mib` MiB through an `IOPool`
   of 1 and 4 threads, from and into `aligned_empty` buffers: two transfers of `threads x block_size` bytes in flight
   (one block per thread running, one queued), crc32 per block as the `Store` computes them (writes) and verifies
   them (reads); O_DIRECT on (`SwapFile(direct=True)`; "n/a" where the filesystem refuses it) and off. A write is
   timed until `os.fsync` returns; before a read the file's page cache is dropped (`fsync`, then
   `posix_fadvise(POSIX_FADV_DONTNEED)`), so buffered reads too come from the disk. Median GB/s of `--rounds`.
2. Training: the GPT of `fzero.examples.gpt` (vocabulary 256, batch 8 x `--seq-len` per rank) at stage 3, bf16, with
   `cpu_adamw`, for `offload=None` (in memory), `"cpu"` and `Offload("nvme", direct=True/False, threads=1/4)`, all
   in the same process(es), their steps interleaved (noise hits them alike): on 1 process (`SimMesh(1)`) and with
   `--nproc 2` on 2 gloo processes (`DistMesh`). Per configuration: the median step time of `--steps` steps after 2
   warm-up steps; the bytes the step's `metrics["io"]` reports read and written per rank; the same process's
   `/proc/self/io` deltas around the measured steps; the wall time inside `Store.stream` (the update's pipeline:
   read-ahead, AdamW on each chunk, write-behind; timed by wrapping the method in this benchmark's processes); the
   achieved bandwidth (bytes moved / time in the pipeline); its fraction of part 1's disk bandwidth (the time the
   disk alone would take for these reads and writes, at part 1's rates for the same O_DIRECT mode and threads,
   over the time in the pipeline); and the exposed I/O, (step nvme - step cpu) / step nvme.
3. `--memory`: for each layer count of `--sweep`, stage 3 in memory against the NVMe tier, each in a fresh process
   (`SimMesh(1)`, 3 steps): the peak `RssAnon` (anonymous resident memory: the heap, where tensors live; `VmHWM`
   would add the file-backed pages of torch's mapped libraries, some 100s of MiB that are not state), sampled every
   5 ms by a thread and after each step, and `fzero.state_bytes` (resident total, offloaded, staging).
   `--speculate` adds `Offload(..., speculate=True)` twins of the cpu and nvme configurations (SuperOffload), and
   one whose every step is clipped (`clip=1e-9`: every speculation misses and is redone), with their hit counts.
   `--memory-engine`: the same sweep through the engine (`fzero.initialize` on one process) with `offload_param` and
   `offload_optimizer` on `nvme` against in memory, peak `RssAnon` and whether the last loss is equal.
4. `--deepspeed`: DeepSpeed's ZeRO-Infinity (`offload_optimizer: nvme`) on the same model, config and directory,
   with `DS_ACCELERATOR=cpu`, in a process of its own; it needs DeepSpeed's `async_io` op (libaio) built at run
   time: where that fails, one line says why.

Prints markdown tables, under a header naming the CPU, whether it has avx512f, the filesystem of `--dir` and the
command line. `--quick` is a smoke test (disk 128 MiB, 1 round, 2 layers, 2 steps after 1 warm-up, sweep 2).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from procmem import PeakRss, rss_anon  # (this directory)

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch
from fzero.host import process_group
from fzero.storage import IOPool, Region, StorageError, Store, SwapFile, aligned_empty

fzero.hostmem.enable_huge_pages()  # before the first tensor, as the other benchmarks

REPO = pathlib.Path(__file__).resolve().parent.parent
MIB, GB = 1 << 20, 1e9
LR = 1e-3
BATCH = 8  # per rank
DEPTH = 2  # transfers in flight in the disk benchmark


# ------------------------------------------------------------------------------------------------------ the machine
def cpu_info() -> tuple[str, bool]:
    """The CPU's model name and whether it has avx512f (from /proc/cpuinfo)."""
    name, avx512 = "unknown", False
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags":
                avx512 = avx512 or "avx512f" in value.split()
    return name, avx512


def filesystem(path: str) -> str:
    """The filesystem type of `path`: /proc/mounts' entry with the longest mount point that contains it."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return f"{kind} (mounted at {best})"


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (all its threads)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def crc32_speed() -> float:
    """zlib.crc32's GB/s on one thread (the storage layer checksums every block on its I/O threads)."""
    buf = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8).numpy().tobytes()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        zlib.crc32(buf)
        best = min(best, time.perf_counter() - t0)
    return len(buf) / best / GB


# ---------------------------------------------------------------------------------------------------- 1. the disk
def disk_bandwidth(root: str, args: argparse.Namespace) -> dict[tuple[bool, int], Any]:
    """{(direct, threads): {"write": [GB/s per round], "read": [...]}, or the reason O_DIRECT is refused}."""
    nbytes = args.disk_mib * MIB
    files: dict[bool, SwapFile | str] = {}
    out: dict[tuple[bool, int], Any] = {}
    try:
        for direct in (True, False):
            try:
                files[direct] = SwapFile(os.path.join(root, f"disk-{direct}.swap"), [Region("data", torch.uint8,
                                         nbytes)], direct=direct)  # fmt: skip
            except StorageError as e:
                files[direct] = str(e)
        for direct, f in files.items():
            for t in args.io_threads:
                out[direct, t] = f if isinstance(f, str) else {"write": [], "read": []}
        for _ in range(args.rounds):  # rounds outermost: machine noise hits every mode alike
            for (direct, t), res in out.items():
                if isinstance(res, str):
                    continue
                f = files[direct]
                assert isinstance(f, SwapFile)
                w, r = _disk_round(f, nbytes, t, args.block_size)
                res["write"].append(nbytes / w / GB)
                res["read"].append(nbytes / r / GB)
    finally:
        for f in files.values():
            if isinstance(f, SwapFile):
                f.close()
                os.unlink(f.path)
    return out


def _disk_round(f: SwapFile, nbytes: int, threads: int, block: int) -> tuple[float, float]:
    """Seconds to write `nbytes` sequentially (until fsync returns), then to read them back from a cold cache."""
    per = threads * block
    bufs = [aligned_empty(per) for _ in range(DEPTH)]
    for b in bufs:
        b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8))
    base = f.offset("data")
    spans = [(pos, min(per, nbytes - pos)) for pos in range(0, nbytes, per)]
    fd = os.open(f.path, os.O_RDONLY)
    try:
        with IOPool(threads, block) as pool:
            os.fsync(fd)
            t0 = time.perf_counter()
            futs: list[Any] = []
            for k, (pos, n) in enumerate(spans):
                if k >= DEPTH:  # buffer k % DEPTH is free once the transfer before on it is done
                    futs[k - DEPTH].result()
                futs.append(pool.write(f, base + pos, bufs[k % DEPTH], n))
            crcs = [fut.result() for fut in futs]
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages after the fsync: all of them go
            t0 = time.perf_counter()
            futs = []
            for k, (pos, n) in enumerate(spans):
                if k >= DEPTH:
                    futs[k - DEPTH].result()
                futs.append(pool.read(f, base + pos, bufs[k % DEPTH], n, crcs[k]))
            for fut in futs:
                fut.result()
            read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    return write_s, read_s


def print_disk(disk: dict[tuple[bool, int], Any], args: argparse.Namespace) -> None:
    print(f"\n## 1. Disk: sequential {args.disk_mib} MiB through IOPool + SwapFile, block {args.block_size // 1024} "
          f"KiB, {DEPTH} transfers of threads x block in flight, crc32 per block, median of {args.rounds} "
          "round(s)")  # fmt: skip
    print("\nWrite: until fsync returns. Read: after fsync + POSIX_FADV_DONTNEED of the file (cold page cache).\n")
    print("| O_DIRECT | I/O threads | write GB/s | read GB/s |")
    print("|---|---|---|---|")
    for (direct, t), res in disk.items():
        if isinstance(res, str):
            print(f"| {'on' if direct else 'off'} | {t} | n/a | n/a ({res}) |")
        else:
            w, r = statistics.median(res["write"]), statistics.median(res["read"])
            print(f"| {'on' if direct else 'off'} | {t} | {w:.2f} | {r:.2f} |")


def disk_rates(disk: dict[tuple[bool, int], Any]) -> dict[str, dict[str, float]]:
    """Median write and read GB/s by "direct,threads" (JSON keys), for the modes that ran."""
    return {f"{int(d)},{t}": {k: statistics.median(v) for k, v in res.items()}
            for (d, t), res in disk.items() if not isinstance(res, str)}  # fmt: skip


# ------------------------------------------------------------------------------------------------- 2. training
def configurations(args: argparse.Namespace, direct_ok: bool) -> dict[str, tuple[Any, float | None]]:
    """Label -> the `offload` argument and the clipping bound (`--speculate`'s forced misses clip every step)."""
    out: dict[str, tuple[Any, float | None]] = {"in memory": (None, None), "cpu": ("cpu", None)}
    if args.speculate:
        out["cpu speculate"] = (fzero.Offload("cpu", speculate=True), None)
    for direct in (True, False) if direct_ok else (False,):
        for t in args.io_threads:
            name = f"nvme direct={'on' if direct else 'off'} threads={t}"
            kw = dict(path=args.dir, direct=direct, threads=t, block_size=args.block_size)
            out[name] = (fzero.Offload("nvme", **kw), None)
            if args.speculate:
                out[f"{name} speculate"] = (fzero.Offload("nvme", speculate=True, **kw), None)
                if direct == direct_ok and t == args.io_threads[0]:  # every step clipped: every speculation misses
                    out[f"{name} speculate, all miss"] = (fzero.Offload("nvme", speculate=True, **kw), MISS_CLIP)
    return out


MISS_CLIP = 1e-9


def build_model(args: argparse.Namespace, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, d_model=args.d_model, n_head=args.n_head, seq_len=args.seq_len))


def make_batches(rank: int, n: int, seq_len: int, simulated: bool) -> list[dict[str, torch.Tensor]]:
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(rank)
    out = [sample_batch(tokens, BATCH, seq_len, gen) for _ in range(n)]
    return [{k: v[None] for k, v in b.items()} for b in out] if simulated else out


STREAM_S = [0.0]  # seconds inside Store.stream in this process


def time_store_stream() -> None:
    """Wrap `Store.stream` and `Store.stream_units` (a speculative update's, on its worker thread; this process
    only) to add their wall time to STREAM_S."""
    for method in ("stream", "stream_units"):
        inner = getattr(Store, method)

        def timed(self: Store, *a: Any, _inner: Any = inner, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(self, *a, **k)
            finally:
                STREAM_S[0] += time.perf_counter() - t0

        setattr(Store, method, timed)


def mesh_for(rank: int, world: int, store: str) -> fzero.Mesh:
    if world == 1:
        return fzero.SimMesh(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return fzero.DistMesh()


def train_worker(rank: int, world: int, store: str, out: str, args: argparse.Namespace, direct_ok: bool) -> None:
    torch.set_num_threads(args.torch_threads or max(1, len(os.sched_getaffinity(0)) // world))
    time_store_stream()
    try:
        mesh = mesh_for(rank, world, store)
        model = build_model(args, args.layers)
        loss_fn = gpt_loss(model)
        data = make_batches(rank, args.warmup + args.steps, args.seq_len, world == 1)
        runs: dict[str, dict[str, Any]] = {}
        for name, (offload, clip) in configurations(args, direct_ok).items():
            tx = fzero.zero3(fzero.cpu_adamw(LR), precision="bf16", offload=offload, clip=clip)
            runs[name] = {"state": fzero.init(model, tx, mesh), "step": fzero.train_step(model, loss_fn, tx, mesh,
                          donate=True), "time": [], "stream": [], "io": [], "proc": [], "hits": []}  # fmt: skip
        for run in runs.values():
            for b in data[: args.warmup]:
                run["state"], _ = run["step"](run["state"], b)
        names = list(runs)
        for i, b in enumerate(data[args.warmup :]):
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotating order
                run = runs[name]
                if world > 1:
                    dist.barrier()
                io0, s0 = proc_io(), STREAM_S[0]
                t0 = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], b)
                t = time.perf_counter() - t0
                io1 = proc_io()
                run["time"].append(t)
                run["stream"].append(STREAM_S[0] - s0)
                run["io"].append(metrics.get("io", {}).get("nvme", {"read": 0, "written": 0}))
                run["proc"].append({k: io1[k] - io0[k] for k in ("read_bytes", "write_bytes")})
                if "speculation" in metrics:
                    run["hits"].append(metrics["speculation"]["hit"])
        result = {
            name: {k: run[k] for k in ("time", "stream", "io", "proc", "hits")}
            | {"bytes": fzero.state_bytes(run["state"])}
            for name, run in runs.items()
        }
        result["_params"] = sum(p.numel() for p in model.parameters())  # type: ignore[assignment]
        with open(os.path.join(out, f"train-{world}-{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


def print_training(res: dict[str, Any], other: dict[str, Any] | None, world: int, rates: dict[str, dict[str, float]],
                   args: argparse.Namespace) -> None:  # fmt: skip
    params = res.pop("_params")
    if other is not None:
        other.pop("_params")
    where = "1 process (SimMesh(1))" if world == 1 else f"{world} gloo processes (DistMesh), rank 0's numbers"
    print(f"\n## 2. Training, {where}: GPT {params / 1e6:.2f}M params ({args.layers} blocks, d_model {args.d_model}, "
          f"seq {args.seq_len}, batch {BATCH}/rank), stage 3 bf16, cpu_adamw; median of {args.steps} steps after "
          f"{args.warmup} warm-up, configurations interleaved\n")  # fmt: skip
    print(
        "| offload | step ms | vs in memory | in Store.stream ms | metrics read MiB/step | metrics written "
        "MiB/step | /proc read_bytes MiB/step | /proc write_bytes MiB/step | achieved GB/s | of disk | exposed I/O |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(res["in memory"]["time"])
    cpu = statistics.median(res["cpu"]["time"])
    mismatch = []
    for name, r in res.items():
        t = statistics.median(r["time"])
        hits = f" ({sum(r['hits'])}/{len(r['hits'])} hits)" if r["hits"] else ""
        cells = [name + hits, f"{t * 1e3:.0f}", f"{t / base:.2f}x"]
        if not name.startswith("nvme"):
            print("| " + " | ".join(cells + ["-"] * 8) + " |")
            continue
        stream = statistics.median(r["stream"])
        rd = statistics.median(x["read"] for x in r["io"])
        wr = statistics.median(x["written"] for x in r["io"])
        prd = sum(x["read_bytes"] for x in r["proc"]) / len(r["proc"])
        pwr = sum(x["write_bytes"] for x in r["proc"]) / len(r["proc"])
        direct = "direct=on" in name
        threads = int(name.split("threads=")[1].split()[0].rstrip(","))
        rate = rates.get(f"{int(direct)},{threads}")
        frac = f"{(rd / (rate['read'] * GB) + wr / (rate['write'] * GB)) / stream:.0%}" if rate else "-"
        cells += [f"{stream * 1e3:.0f}", f"{rd / MIB:.1f}", f"{wr / MIB:.1f}", f"{prd / MIB:.1f}", f"{pwr / MIB:.1f}",
                  f"{(rd + wr) / stream / GB:.2f}", frac, f"{(t - cpu) / t:.0%}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
        if other is not None and other[name]["io"] != r["io"]:
            mismatch.append(name)
    print("\nmetrics: `metrics['io']['nvme']`, the bytes the tier asked to move (per rank). /proc/self/io (the whole "
          "process, I/O threads included): `read_bytes` counts bytes fetched from the storage device (page-cache hits "
          "count 0); `write_bytes` counts bytes when pages are dirtied, i.e. when the write is issued, not when it "
          "reaches the disk (proc(5)), and a page dirtied again before its writeback is not counted twice; O_DIRECT "
          "transfers count in full. achieved = (read + written) / time in Store.stream (which includes AdamW on the "
          "chunks: a lower bound on the I/O rate); of disk = the time part 1's rates (same O_DIRECT mode and threads) "
          "need for these bytes / time in Store.stream (above 100%: the page cache served buffered transfers, or the "
          "pipeline's overlapped reads and writes and its deeper queue beat part 1's one-direction, 2-deep stream); "
          "exposed I/O = (step - step with offload='cpu') / step. `speculate`: Offload(speculate=True) (SuperOffload: "
          "each unit's update during the backward; `all miss` clips every step, so every speculation is redone after "
          "the backward); its Store.stream time is the worker thread's, overlapping the backward.")  # fmt: skip
    if world > 1:
        print("rank 1's metrics['io'] " + (f"differ from rank 0's for: {mismatch}" if mismatch else "equal rank 0's."))
    for name in ("in memory", "nvme direct=on threads=1"):
        if name in res:
            b = res[name]["bytes"]
            print(f"state_bytes ({name}): resident total {b['total'] / MIB:.1f} MiB (master {b['master'] / MIB:.1f}, "
                  f"compute {b['compute'] / MIB:.1f}, optimizer {b['optimizer'] / MIB:.1f}, staging "
                  f"{b['staging'] / MIB:.1f}), offloaded {b['offloaded'] / MIB:.1f} MiB")  # fmt: skip


# -------------------------------------------------------------------------------------------------- 3. memory
def memory_worker(rank: int, out: str, args: argparse.Namespace, layers: int, mode: str) -> None:
    torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
    if mode.startswith("engine"):
        return engine_memory_worker(out, args, layers, mode)
    peak = PeakRss()
    model = build_model(args, layers)
    baseline = rss_anon()
    offload = fzero.Offload("nvme", path=args.dir, block_size=args.block_size) if mode == "nvme" else None
    tx = fzero.zero3(fzero.cpu_adamw(LR), precision="bf16", offload=offload)
    mesh = fzero.SimMesh(1)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, gpt_loss(model), tx, mesh, donate=True)
    init_peak = peak.stop()
    peak = PeakRss()  # from here: the steps' peak (init's transients, e.g. the full master it writes out, apart)
    for b in make_batches(rank, 3, args.seq_len, True):
        state, _ = step(state, b)
        peak.sample()
    result = {"baseline": baseline, "init": init_peak, "peak": peak.stop(), "bytes": fzero.state_bytes(state),
              "params": sum(p.numel() for p in model.parameters())}  # fmt: skip
    with open(os.path.join(out, f"mem-{layers}-{mode}.json"), "w") as f:
        json.dump(result, f)


def engine_memory_worker(out: str, args: argparse.Namespace, layers: int, mode: str) -> None:
    """`--memory-engine`: the DeepSpeed-style engine on one process (`fzero.initialize`: a one-rank SimMesh), stage 3
    bf16, in memory or with `offload_optimizer` and `offload_param` on `nvme` (the compute copy read unit by unit)."""
    off = {"device": "nvme", "nvme_path": args.dir} if mode == "engine-nvme" else {"device": "none"}
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "bf16": {"enabled": True}, "aio": {"block_size": args.block_size},
              "zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": off}}  # fmt: skip
    peak = PeakRss()
    model = build_model(args, layers)
    params = sum(p.numel() for p in model.parameters())
    baseline = rss_anon()
    engine, *_ = fzero.initialize(model=model, config=config, model_parameters=model.parameters())
    del model
    init_peak = peak.stop()
    peak = PeakRss()
    for b in make_batches(0, 3, args.seq_len, False):
        loss = F.cross_entropy(engine(b["x"]).float().flatten(0, 1), b["y"].flatten())
        engine.backward(loss)
        engine.step()
        peak.sample()
    result = {"baseline": baseline, "init": init_peak, "peak": peak.stop(), "bytes": fzero.state_bytes(engine.state),
              "params": params, "loss": loss.item()}  # fmt: skip
    engine.close()
    with open(os.path.join(out, f"mem-{layers}-{mode}.json"), "w") as f:
        json.dump(result, f)


def print_engine_memory(results: dict[int, dict[str, Any]]) -> None:
    print("\n## 3b. Memory, the engine on 1 process (fzero.initialize, a one-rank SimMesh), stage 3 bf16, "
          "offload_param and offload_optimizer none or nvme, each run in a fresh process, 3 steps\n")  # fmt: skip
    print("| layers | params | peak RssAnon in memory MiB (init) | peak RssAnon nvme MiB (init) | last loss equal |")
    print("|---|---|---|---|---|")
    for layers, r in results.items():
        mem, nvme = r["engine-memory"], r["engine-nvme"]
        print(f"| {layers} | {mem['params'] / 1e6:.2f}M | {mem['peak'] / MIB:.0f} ({mem['init'] / MIB:.0f}) | "
              f"{nvme['peak'] / MIB:.0f} ({nvme['init'] / MIB:.0f}) | {mem['loss'] == nvme['loss']} |")  # fmt: skip


def print_memory(results: dict[int, dict[str, Any]]) -> None:
    print("\n## 3. Memory per rank, 1 process (SimMesh(1)), stage 3 bf16 cpu_adamw, each run in a fresh process, 3 "
          "steps\n")  # fmt: skip
    print(
        "| layers | params | state 16 B/param MiB | RssAnon model built MiB | peak RssAnon in memory MiB (init) | "
        "peak RssAnon nvme MiB (init) | resident state in memory MiB | resident state nvme MiB | offloaded MiB | "
        "staging MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layers, r in results.items():
        mem, nvme = r["memory"], r["nvme"]
        print(f"| {layers} | {mem['params'] / 1e6:.2f}M | {16 * mem['params'] / MIB:.0f} | {mem['baseline'] / MIB:.0f} "
              f"| {mem['peak'] / MIB:.0f} ({mem['init'] / MIB:.0f}) | {nvme['peak'] / MIB:.0f} "
              f"({nvme['init'] / MIB:.0f}) | {mem['bytes']['total'] / MIB:.0f} | "
              f"{nvme['bytes']['total'] / MIB:.0f} | {nvme['bytes']['offloaded'] / MIB:.0f} | "
              f"{nvme['bytes']['staging'] / MIB:.0f} |")  # fmt: skip
    print("\nRssAnon (anonymous resident memory, /proc/self/status) rather than VmHWM: VmHWM is the peak of the whole "
          "RSS, file-backed pages of the mapped libraries (torch's are 100s of MiB) included. RssAnon is a current "
          "value, so its peak is sampled (every 5 ms and after each step): a shorter spike can be missed. peak = "
          "during the 3 steps; (init) = during fzero.init and train_step, before the first step. RssAnon holds "
          "everything on the heap: the nn.Module's own fp32 parameters (4 B/param, which train_step keeps for the "
          "model's structure), activations, gradients, gathered units, the interpreter and torch's own (the 'model "
          "built' column, before fzero.init). resident state = fzero.state_bytes total (staging included); "
          "offloaded = the bytes of one version on disk (the files hold two).")  # fmt: skip


# ------------------------------------------------------------------------------------------------- 4. DeepSpeed
def deepspeed_worker(rank: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.torch_threads or len(os.sched_getaffinity(0)))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": args.dir}},
            "aio": {"block_size": args.block_size, "thread_count": 1},
            "steps_per_print": 10**9,
        }
        model = build_model(args, args.layers)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        times = []
        for i, b in enumerate(make_batches(0, args.warmup + args.steps, args.seq_len, False)):
            t0 = time.perf_counter()
            logits = engine(b["x"])
            engine.backward(F.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten()))
            engine.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        result = {"time": statistics.median(times)}
    except BaseException as e:  # a failed JIT build raises anything from ImportError to SystemExit
        result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
    finally:
        process_group.shutdown()
    with open(os.path.join(out, "deepspeed.json"), "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------------------------------------- main
def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the files go (default: a temporary directory under the repository's runs/)")
    p.add_argument("--disk-mib", type=int, default=512, help="the disk benchmark's file size")
    p.add_argument("--rounds", type=int, default=3, help="disk benchmark rounds (median)")
    p.add_argument("--io-threads", type=int, nargs="+", default=[1, 4], help="I/O thread counts to measure")
    p.add_argument("--block-size", type=int, default=1 << 20, help="bytes per I/O request (disk and Offload)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per configuration")
    p.add_argument("--nproc", type=int, nargs="+", default=[1], choices=[1, 2],
                   help="process counts for the training table: 1 (SimMesh(1)) and/or 2 (gloo)")  # fmt: skip
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument("--memory", action="store_true", help="also the peak-memory sweep")
    p.add_argument(
        "--memory-engine",
        action="store_true",
        help="also the sweep through the engine on 1 process, with offload_param nvme",
    )
    p.add_argument("--sweep", default="6,12,24", help="layer counts of the memory sweep")
    p.add_argument("--deepspeed", action="store_true", help="also try DeepSpeed's ZeRO-Infinity")
    p.add_argument("--no-disk", action="store_true", help="skip part 1 (training then reports no fraction of disk)")
    p.add_argument("--no-train", action="store_true", help="skip part 2")
    p.add_argument(
        "--speculate",
        action="store_true",
        help="also Offload(speculate=True) (SuperOffload) for cpu and each nvme configuration",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: disk 128 MiB, 1 round, 2 layers, 2 steps")
    args = p.parse_args()
    if args.quick:
        args.disk_mib, args.rounds, args.layers, args.steps, args.warmup, args.sweep = 128, 1, 2, 2, 1, "2"
    args.sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
    return args


def memory_sweep(out: str, args: argparse.Namespace, modes: tuple[str, ...]) -> dict[int, dict[str, Any]]:
    """Each layer count of `--sweep` in each mode, each run in a fresh process: their results by layers and mode."""
    results: dict[int, dict[str, Any]] = {}
    for layers in args.sweep:
        for mode in modes:
            spawn(memory_worker, (out, args, layers, mode), 1)
            with open(os.path.join(out, f"mem-{layers}-{mode}.json")) as f:
                results.setdefault(layers, {})[mode] = json.load(f)
    return results


def spawn(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")


def main() -> None:
    args = parse()
    made = args.dir is None
    if made:
        (REPO / "runs").mkdir(exist_ok=True)
        args.dir = tempfile.mkdtemp(prefix="offload-bench-", dir=REPO / "runs")
    args.dir = os.path.abspath(args.dir)
    name, avx512 = cpu_info()
    fs = filesystem(args.dir)
    print(f"# NVMe offload on {name} (avx512f: {'yes' if avx512 else 'no'}), {len(os.sched_getaffinity(0))} cores; "
          f"--dir {args.dir} on {fs}")  # fmt: skip
    print(f"command: {shlex.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"zlib.crc32 on one thread: {crc32_speed():.2f} GB/s (every block is checksummed on its I/O thread)")
    if fs.startswith(("tmpfs", "ramfs")):
        print("warning: --dir is on a memory filesystem: the 'disk' is RAM and O_DIRECT is refused")
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as out:
            rates: dict[str, dict[str, float]] = {}
            direct_ok = True
            if not args.no_disk:
                disk = disk_bandwidth(args.dir, args)
                print_disk(disk, args)
                rates = disk_rates(disk)
                direct_ok = any(d and not isinstance(r, str) for (d, _), r in disk.items())
            if not args.no_train:
                for world in args.nproc:
                    spawn(train_worker, (world, os.path.join(out, f"store-{world}"), out, args, direct_ok), world)
                    with open(os.path.join(out, f"train-{world}-0.json")) as f:
                        res = json.load(f)
                    other = None
                    if world > 1:
                        with open(os.path.join(out, f"train-{world}-1.json")) as f:
                            other = json.load(f)
                    print_training(res, other, world, rates, args)
            if args.memory:
                print_memory(memory_sweep(out, args, ("memory", "nvme")))
            if args.memory_engine:
                print_engine_memory(memory_sweep(out, args, ("engine-memory", "engine-nvme")))
            if args.deepspeed:
                spawn(deepspeed_worker, (os.path.join(out, "store-ds"), out, args), 1)
                with open(os.path.join(out, "deepspeed.json")) as f:
                    ds = json.load(f)
                print("\n## 4. DeepSpeed ZeRO-Infinity (offload_optimizer: nvme), 1 process\n")
                if "error" in ds:
                    aio = "" if os.path.exists("/usr/include/libaio.h") else " (/usr/include/libaio.h is missing)"
                    print(f"DeepSpeed could not run here{aio}: {ds['error']}")
                else:
                    print(f"| trainer | step ms |\n|---|---|\n| deepspeed stage 3 nvme | {ds['time'] * 1e3:.0f} |")
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

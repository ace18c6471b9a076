"""A model whose training state is more than twice the memory each process may use, trained through the NVMe tier,
checkpointed and resumed, against the same model trained in memory (issue 24).

    .venv/bin/python benchmarks/bigger_than_memory.py [--layers 20] [--d-model 1280] [--steps 4] [--ratio 2.2]
        [--dir DIR] [--engine]

Three runs of 2 gloo processes each, the GPT of `fzero.examples.gpt` built on the `meta` device and constructed
unit by unit (`fzero.init(..., initializer=...)`, DeepSpeed's `zero.Init`: the full model never exists in a
process), stage 3, bf16 (gradients reduced in bf16), `cpu_adamw`:

1. in memory, uncapped: `--steps` steps (the reference losses);
2. `Offload("nvme", params="nvme")`, each process capped: the first half of the steps, then a checkpoint;
3. the same, capped: loaded from that checkpoint, the second half.

With `--engine` the same three runs go through `fzero.initialize` with a DeepSpeed JSON config instead of the core:
`zero_optimization.stage` 3, `offload_optimizer` and `offload_param` on `nvme` (the reference: `none`), bf16 with
`communication_data_type` bf16 (gradients reduced in bf16, as the core runs), DeepSpeed's `AdamW`; the model built
under `fzero.deepspeed.zero.Init(config_dict_or_path=...)` with that config (DeepSpeed's `deepspeed.zero.Init`: each
parameter partitioned as its module's `__init__` returns, so the full model never exists in a process; with
`offload_param` on `nvme` each partition goes to a file under its `nvme_path`, so the partitions take no memory
either; the GPT's residual projections initialised through `apply`, which `zero.Init` gathers, rather than by a
parent writing to a partitioned child), `loss = cross_entropy(engine(x), y); engine.backward(loss); engine.step()`,
checkpointed with `engine.save_checkpoint` and resumed with `engine.load_checkpoint`. The losses are rank 0's own
(the engine's loss is the rank's); the reference is the same engine in memory.

The cap of each process is its share of the training state (`fzero.state_bytes`: resident plus offloaded bytes,
i.e. master, Adam's moments and the compute copy) divided by `--ratio`. It is enforced by a cgroup-v1 memory
controller where this machine lets us make one (`/sys/fs/cgroup/memory/...`, `memory.limit_in_bytes`: the kernel
kills a process that goes over), and always by the process itself: a thread samples its `RssAnon` every 5 ms and
exits with an error if it ever exceeds the cap (`benchmarks/procmem.py`'s `PeakRss`). The runs' losses must be the
same numbers, bit for bit.

Measured 2026-11-28 on a 2-core AMD EPYC (Zen 3, AVX2), a cgroup-v1 group per process:

- `--engine --layers 14 --d-model 1024 --steps 2 --ratio 2.0` (12 minutes; torch emulates bf16 on AVX2: a step takes
  minutes): GPT 176.7M, training state 1179 MiB per process, **cap 590 MiB**. Peak RssAnon per process (MiB, torch's
  ~150 included), construction / steps: in memory 1335 / 1728; NVMe, a step and `save_checkpoint` 300 / 497; resumed
  with `load_checkpoint`, a step 511 / 499; losses bitwise the in-memory run's (5.4688, 5.6562).
- `--engine --layers 8 --d-model 768 --steps 4 --ratio 1.0` (before `zero.Init` wrote its partitions to NVMe): GPT
  57.0M, state 380 MiB per process, cap 380: NVMe 345 / 336, resumed 346 / 323, losses bitwise.

A process's floor is torch plus what does not shrink with the model (the staging sets, 64 MiB; a unit or two
gathered; the gradient shard, 4 bytes a parameter / world), so the ratio a cap can reach grows with the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from procmem import PeakRss, rss_anon  # (this directory: benchmarks/procmem.py)

CGROUP = Path("/sys/fs/cgroup/memory")


def _model(args: argparse.Namespace):
    from fzero.examples.gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.d_model // 64, seq_len=args.seq_len)
    with torch.device("meta"):
        model = GPT(cfg)

    def initializer(m: torch.nn.Module) -> None:  # GPT's own initialisation, module by module
        GPT._init(m)
        if isinstance(m, torch.nn.LayerNorm):
            m.reset_parameters()
        if isinstance(m, Block):
            for lin in (m.proj, m.out):
                torch.nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    return model, initializer


def engine_config(args: argparse.Namespace, mode: str) -> dict:
    """`--engine`'s DeepSpeed config: stage 3, bf16 (reduced in bf16), AdamW, both offloads on `nvme` (or none)."""
    offload = {"device": "nvme", "nvme_path": args.swap} if mode == "nvme" else {"device": "none"}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload},
        "steps_per_print": 10**9,
    }


def _zero_init_model(args: argparse.Namespace, config: dict):
    """The GPT built under `zero.Init`: its residual projections' scaled initialisation runs through `apply` (which
    `zero.Init` gathers for) on the projections themselves, marked as they are made."""
    from fzero.deepspeed import zero
    from fzero.examples.gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.d_model // 64, seq_len=args.seq_len)

    class ZeroInitGPT(GPT):
        def __init__(self, cfg: GPTConfig) -> None:
            torch.nn.Module.__init__(self)  # (GPT's own writes to its blocks' partitioned projections)
            self.cfg = cfg
            self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = torch.nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = torch.nn.LayerNorm(cfg.d_model)
            self.head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.head.weight = self.wte.weight
            residual = {id(lin) for block in self.blocks for lin in (block.proj, block.out)}
            std = 0.02 / math.sqrt(2 * cfg.n_layer)

            def init(m: torch.nn.Module) -> None:
                GPT._init(m)
                if id(m) in residual:
                    torch.nn.init.normal_(m.weight, std=std)

            self.apply(init)

    # (the config's offload_param on nvme: the partitions are written under its nvme_path as they are made)
    with zero.Init(config_dict_or_path=config):
        return ZeroInitGPT(cfg)


def engine_worker(args: argparse.Namespace) -> None:
    """`--engine`: one rank of a run through `fzero.initialize` (see the module docstring)."""
    import torch.nn.functional as F

    import fzero

    watch = PeakRss(cap=args.cap)
    torch.set_num_threads(1)
    baseline = rss_anon()
    os.environ.update(RANK=str(args.rank), WORLD_SIZE="2", LOCAL_RANK=str(args.rank), LOCAL_WORLD_SIZE="2")
    fzero.host.process_group.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                                world_size=2, timeout=1800)  # fmt: skip
    config = engine_config(args, args.mode)
    torch.manual_seed(0)
    model = _zero_init_model(args, config)
    engine, *_ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model  # (the script's name for it: the engine keeps what it needs)
    first = 0
    if args.phase == "resume":
        engine.load_checkpoint(args.ckpt, tag="half")
        first = engine.global_steps
    sizes = fzero.state_bytes(engine.state)
    init_peak, watch.peak = watch.peak, rss_anon()  # the construction's peak, apart from the steps'
    losses, times = [], []
    for batch in _batches(args, first):
        t = time.perf_counter()
        logits = engine(batch["x"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    if args.phase == "first":
        engine.save_checkpoint(args.ckpt, tag="half")
    peak = watch.stop()
    if args.rank == 0:
        out = {"losses": losses, "times": times, "state": sizes, "peak": peak, "init_peak": init_peak,
               "baseline": baseline}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    engine.destroy()
    fzero.host.process_group.shutdown()


def _batches(args: argparse.Namespace, first: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batch of each step the phase runs, from step `first` on (the same data in every run)."""
    from fzero.examples.gpt import corpus_tokens, sample_batch

    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(1)
    batches = [sample_batch(tokens, 2 * args.batch, args.seq_len, gen) for _ in range(args.steps)]
    last = args.steps if args.phase != "first" else args.steps // 2
    for i in range(first, last):
        yield {k: v.view(2, args.batch, -1)[args.rank] for k, v in batches[i].items()}


def worker(args: argparse.Namespace) -> None:
    import fzero
    from fzero.examples.gpt import gpt_loss

    watch = PeakRss(cap=args.cap)
    torch.set_num_threads(1)
    baseline = rss_anon()  # the interpreter and torch, before anything of the run
    fzero.host.process_group.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                           world_size=2, timeout=1800)  # fmt: skip
    mesh = fzero.DistMesh()
    offload = None if args.mode == "memory" else fzero.Offload("nvme", params="nvme", path=args.swap)
    # gradients reduced in bf16 (DeepSpeed's bf16 default): the reduced shard is what stays resident in a step
    policy = dataclasses.replace(fzero.get_policy("bf16"), reduce_dtype=torch.bfloat16)
    tx = fzero.zero3(fzero.cpu_adamw(3e-4), precision=policy, offload=offload)
    torch.manual_seed(0)
    model, initializer = _model(args)
    state = fzero.init(model, tx, mesh, initializer=initializer)
    first = 0
    if args.phase == "resume":
        state, extra = fzero.checkpoint.load(args.ckpt, state, mesh=mesh)
        first = extra["step"]
    sizes = fzero.state_bytes(state)
    init_peak, watch.peak = watch.peak, rss_anon()  # the construction's peak, apart from the steps'
    step = fzero.train_step(model, gpt_loss(model), tx, mesh)
    losses, times = [], []
    for batch in _batches(args, first):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    if args.phase == "first":
        fzero.checkpoint.save(state, args.ckpt, mesh=mesh, fsync=False)
    peak = watch.stop()
    if args.rank == 0:
        out = {"losses": losses, "times": times, "state": sizes, "peak": peak, "init_peak": init_peak,
               "baseline": baseline}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    fzero.host.process_group.shutdown()


def _cgroup(name: str, cap: int) -> Path | None:
    """A cgroup-v1 memory group capped at `cap` bytes, or None where this machine does not let us make one."""
    path = CGROUP / name
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(cap))
        return path
    except OSError:
        return None


def launch(args: argparse.Namespace, mode: str, phase: str, cap: int | None, work: Path) -> dict:
    """One run of 2 processes; rank 0's report."""
    store, out = work / f"store-{mode}-{phase}", work / f"out-{mode}-{phase}.json"
    groups: list[Path | None] = []
    procs = []
    for rank in (0, 1):
        group = _cgroup(f"fzero-bigger-{os.getpid()}-{mode}-{phase}-{rank}", cap) if cap else None
        groups.append(group)
        argv = [sys.executable, __file__, "--worker", "--rank", str(rank), "--store", str(store), "--mode", mode,
                "--phase", phase, "--out", str(out), "--swap", str(work / "swap"), "--ckpt", str(work / "ckpt"),
                "--layers", str(args.layers), "--d-model", str(args.d_model), "--steps", str(args.steps),
                "--seq-len", str(args.seq_len), "--batch", str(args.batch)]  # fmt: skip
        if args.engine:
            argv.append("--engine")
        if cap:
            argv += ["--cap", str(cap)]
        if group is not None:  # join the group before anything is allocated: all of the process is charged to it
            argv = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *argv]
        # glibc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold in the heap, where they count as
        # resident until reused: a fixed 1 MiB threshold returns every large block at `free`, so RssAnon measures
        # what is live (the price: fresh pages to fault in each step)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
        procs.append(subprocess.Popen(argv, env=env))
    codes = [p.wait() for p in procs]
    for group in groups:
        if group is not None:
            group.rmdir()
    if any(codes):
        why = {3: "went over its cap (its own RssAnon)", -9: "killed (the cgroup's OOM killer?)"}
        raise SystemExit(f"{mode} {phase}: exit codes {codes}: " + ", ".join(why.get(c, str(c)) for c in codes))
    report = json.loads(out.read_text())
    report["cgroup"] = all(g is not None for g in groups) if cap else None
    return report


def sweep(args: argparse.Namespace) -> None:
    """The NVMe run's peak RssAnon per process as the model grows (uncapped: measured, not enforced)."""
    root = Path(args.dir) if args.dir else Path(__file__).resolve().parent.parent / "runs"
    root.mkdir(parents=True, exist_ok=True)
    mib, rows = 2**20, []
    for layers in (int(x) for x in args.sweep.split(",")):
        work = Path(tempfile.mkdtemp(prefix="bigger-", dir=root))
        (work / "swap").mkdir()
        try:
            r = launch(argparse.Namespace(**{**vars(args), "layers": layers}), "nvme", "first", None, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        params = sum(p.numel() for p in _model(argparse.Namespace(**{**vars(args), "layers": layers}))[0].parameters())
        grads = params // 2 * 2  # this rank's gradient shard, bf16 (2 ranks)
        rows.append((layers, params, r, grads))
    print(f"GPT, d_model {args.d_model}, stage 3, bf16 (bf16 reduce), Offload('nvme', params='nvme'), 2 gloo "
          "processes, model built on the meta device; MiB per process (rank 0)\n")  # fmt: skip
    print("| blocks | params | state on disk | before the run | peak: construction | peak: steps + checkpoint | "
          "gradient shard | steps' peak - gradient shard - before |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for layers, params, r, grads in rows:
        st = r["state"]
        print(f"| {layers} | {params / 1e6:.1f}M | {st['offloaded'] / mib:.0f} | {r['baseline'] / mib:.0f} | "
              f"{r['init_peak'] / mib:.0f} | {r['peak'] / mib:.0f} | {grads / mib:.0f} | "
              f"{(r['peak'] - grads - r['baseline']) / mib:.0f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1280)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ratio", type=float, default=2.2,
                   help="training state per process / the process's cap (0: no cap, to measure)")  # fmt: skip
    p.add_argument("--dir", default=None, help="where the swap files and the checkpoint go (default: under runs/)")
    p.add_argument("--engine", action="store_true", help="through fzero.initialize, the model built under zero.Init")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--cap"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--store", "--mode", "--phase", "--out", "--swap", "--ckpt"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--sweep", default=None, help="layer counts, e.g. 5,10,20: only the NVMe run's peaks, uncapped")
    args = p.parse_args()
    if args.worker:
        engine_worker(args) if args.engine else worker(args)
        return
    if args.sweep:
        sweep(args)
        return
    root = Path(args.dir) if args.dir else Path(__file__).resolve().parent.parent / "runs"
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bigger-", dir=root))
    (work / "swap").mkdir()
    try:
        ref = launch(args, "memory", "all", None, work)
        per_rank_state = ref["state"]["total"] - ref["state"]["staging"]  # resident in memory: all of it
        cap = int(per_rank_state / args.ratio) if args.ratio > 0 else None  # (0: measure, uncapped)
        first = launch(args, "nvme", "first", cap, work)
        second = launch(args, "nvme", "resume", cap, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = 2**20
    params = sum(p.numel() for p in _model(args)[0].parameters())
    how = ("cgroup memory.limit_in_bytes and " if first["cgroup"] else "") + "each process's own RssAnon check"
    through = ("fzero.initialize (DeepSpeed config, zero.Init), engine.save_checkpoint / load_checkpoint"
               if args.engine else "fzero.init (meta model, initializer), fzero.checkpoint")  # fmt: skip
    print(f"GPT {params / 1e6:.1f}M parameters ({args.layers} blocks, d_model {args.d_model}), stage 3 bf16, "
          f"2 gloo processes, cap {(cap or math.inf) / mib:.0f} MiB per process ({how}); "
          f"through {through}\n")  # fmt: skip
    nv = first["state"]
    print("| run | training state per process MiB (resident + on disk) | peak RssAnon MiB: construction / steps "
          "| losses |")  # fmt: skip
    print("|---|---|---|---|")
    print(f"| in memory | {per_rank_state / mib:.0f} + 0 | {ref['init_peak'] / mib:.0f} / {ref['peak'] / mib:.0f} | "
          f"{', '.join(f'{x:.4f}' for x in ref['losses'])} |")  # fmt: skip
    for name, r in (("NVMe, first half, then a checkpoint", first), ("NVMe, resumed from it", second)):
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(f"| {name} | {(nv['total'] - nv['staging']) / mib:.0f} + {nv['offloaded'] / mib:.0f} | "
              f"{r['init_peak'] / mib:.0f} / {r['peak'] / mib:.0f} | {losses} |")  # fmt: skip
    same = first["losses"] + second["losses"] == ref["losses"]
    print(f"\nstate / cap = {(nv['offloaded'] + nv['total'] - nv['staging']) / (cap or math.inf):.2f}; "
          f"losses bitwise the in-memory run's: {same}")  # fmt: skip
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

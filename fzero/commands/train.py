"""`fzero train`: the main job. A small GPT on the bundled corpus, trained through the DeepSpeed-style engine.

    fzero train --nproc 2 --stage 3 --steps 50                  # launches torchrun itself (gloo on CPU)
    fzero train --config ds_config.json --precision bf16        # a DeepSpeed JSON config; flags override it
    fzero train --tensorboard runs/tb --wandb                   # DeepSpeed's monitors (pip install "fzero[monitor]")
    fzero train --nproc 4 --hpz 2 --qwz --qgz                   # ZeRO++ (stage 3): hpZ groups of 2, int8 comms
    fzero train --nproc 4 --hybrid 2                            # MiCS (stage 3): shard within groups of 2 ranks

Without `--config` the run's DeepSpeed config is built from the flags; with it, the file is the base and only the
flags given explicitly override it. Each rank draws its own batches (seeded by rank). Rank 0 shows a progress bar,
prints a metrics line every `--print-every` steps, writes `OUT/metrics.jsonl` (one line per optimizer step) and
`OUT/loss.png`, and ends with a summary.

Every flag is checked before anything runs (`check_arguments`): a bad value ends the command with an argparse-style
usage error naming the flag. A collective that waits longer than `--timeout` seconds for another rank (one that
hung, stopped or crashed) ends the rank with `fzero.CollectiveError` naming the rank that stopped answering.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {
    "stage": 3, "precision": "fp32", "nproc": 1, "steps": 300, "offload": False, "batch": 8, "accumulate": 1,
    "lr": 1e-2, "warmup": 30, "layers": 4, "d_model": 128, "heads": 4, "seq_len": 128, "seed": 0, "threads": 0,
    "out": "runs/train", "print_every": 10, "timeout": 300.0,
}  # fmt: skip


def _int(low: int) -> Any:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags. Defaults are applied in `run`, so that with `--config` an absent flag leaves the file's
    value alone."""
    d = DEFAULTS
    a = parser.add_argument
    a("--stage", type=int, choices=(0, 1, 2, 3), help=f"ZeRO stage (default {d['stage']})")
    a("--precision", choices=("fp32", "bf16", "fp16"), help=f"training precision (default {d['precision']})")
    a("--nproc", type=_int(1), help="processes; > 1 launches torchrun (default 1)")
    a("--steps", type=_int(1), help=f"optimizer steps (default {d['steps']})")
    a("--offload", action="store_true", default=None, help="optimizer state and step on the CPU (ZeRO-Offload)")
    a("--offload-optimizer", choices=("none", "cpu", "nvme"),
      help="where the master weights and optimizer state live: host memory ('cpu', as --offload) or swap files "
      "under --nvme-path ('nvme', ZeRO-Infinity's optimizer tier)")  # fmt: skip
    a("--offload-param", choices=("none", "cpu", "nvme"),
      help="stage 3: where the compute parameters live between uses ('nvme': swap files under --nvme-path, read one "
      "unit ahead; 'cpu': host memory, where a CPU run keeps them anyway)")  # fmt: skip
    a("--nvme-path", metavar="DIR", help="an existing directory for the swap files of the NVMe tiers")
    a("--config", metavar="DS_CONFIG_JSON", help="a DeepSpeed JSON config: the base the flags override")
    a("--batch", type=_int(1), help=f"sequences per rank per micro-step (default {d['batch']})")
    a("--accumulate", type=_int(1), help="micro-steps per optimizer step (default 1)")
    a("--lr", type=_positive_float, help=f"peak learning rate (AdamW, default {d['lr']})")
    a("--warmup", type=_int(0), help=f"linear warm-up steps (default {d['warmup']})")
    a("--layers", type=_int(1), help=f"transformer blocks (default {d['layers']})")
    a("--d-model", type=_int(1), help=f"hidden size, a multiple of --heads (default {d['d_model']})")
    a("--heads", type=_int(1), help=f"attention heads (default {d['heads']})")
    a("--seq-len", type=_int(1), help=f"tokens per sequence (default {d['seq_len']})")
    a("--seed", type=_int(0), help="seed of the model and the data (default 0)")
    a("--threads", type=_int(0), help="torch threads per rank; 0: cores / ranks (the default)")
    a("--out", help=f"directory for metrics.jsonl and loss.png (default {d['out']})")
    a("--print-every", type=_int(1), help=f"a metrics line every N steps (default {d['print_every']})")
    a("--timeout", type=_positive_float, metavar="SECONDS",
      help=f"a collective waiting longer for another rank fails (default {d['timeout']:g}; config key "
           "comms_config.timeout)")  # fmt: skip
    a("--hybrid", type=_int(1), metavar="S",
      help="MiCS (stage 3): shard the model states within groups of S consecutive ranks, replicated across the "
      "groups; S divides the ranks (config key zero_optimization.mics_shard_size)")  # fmt: skip
    a("--hpz", type=_int(1), metavar="N",
      help="ZeRO++ hpZ (stage 3): the backward gathers the parameters within groups of N consecutive ranks, from a "
      "secondary copy kept after the forward; min(N, ranks) divides the ranks (zero_hpz_partition_size)")  # fmt: skip
    a("--qwz", action="store_true", default=None,
      help="ZeRO++ qwZ (stage 3): gather the parameters in int8, lossy (zero_quantized_weights)")  # fmt: skip
    a("--qgz", action="store_true", default=None,
      help="ZeRO++ qgZ (stage 3): reduce the gradients in int8 across nodes, lossy; nothing on one node "
           "(zero_quantized_gradients)")  # fmt: skip
    a("--no-progress", action="store_true", help="no progress bar")
    a("--tensorboard", metavar="DIR",
      help="TensorBoard events in DIR/<job_name> (config block tensorboard; needs fzero[monitor])")  # fmt: skip
    a("--wandb", action="store_true", default=None,
      help="log to Weights & Biases (config block wandb; WANDB_MODE=offline works; needs fzero[monitor])")  # fmt: skip


_SEED_LIMIT = 2**53  # the data generator is seeded with seed * 1000 + rank, which must stay a valid 64-bit seed


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The checks that involve more than one flag, or the file system; each failure is `parser.error` (usage, the
    message, exit status 2)."""
    d_model, heads = _opt(args, "d_model"), _opt(args, "heads")
    if d_model % heads:
        parser.error(f"--d-model {d_model} is not a multiple of --heads {heads}: each head gets d_model / heads")
    if _opt(args, "seed") >= _SEED_LIMIT:
        parser.error(f"--seed must be below 2**53, got {args.seed}")
    if args.config is not None and not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    out = Path(_opt(args, "out"))
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: exists and is not a directory")
    from ..examples.gpt import corpus_tokens

    seq_len, corpus = _opt(args, "seq_len"), corpus_tokens().numel()
    if seq_len + 1 >= corpus:
        parser.error(f"--seq-len {seq_len} does not fit the bundled corpus ({corpus} bytes)")
    _check_zeropp(args, parser)
    _check_device(args, parser)


def _check_device(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`DS_ACCELERATOR`'s value, and, on GPUs, a process for each (NCCL refuses two ranks on one device)."""
    import torch

    from ..host import accelerator

    try:
        where = accelerator.name()
    except ValueError as e:
        parser.error(str(e))
    if where != "cuda" or "WORLD_SIZE" in os.environ:  # (a torchrun worker: its launcher counted)
        return
    nproc, gpus = _opt(args, "nproc"), torch.cuda.device_count()
    if nproc > gpus:
        why = "each process trains on its own (NCCL refuses two ranks on one GPU)"
        parser.error(f"--nproc {nproc}: CUDA sees {gpus} GPU(s) and {why}: set --nproc to at most {gpus}, or "
                     "DS_ACCELERATOR=cpu to train on the CPU")  # fmt: skip


_ZEROPP_FLAGS = {"hybrid": "--hybrid", "hpz": "--hpz", "qwz": "--qwz", "qgz": "--qgz"}


def _check_zeropp(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`--hybrid`, `--hpz`, `--qwz`, `--qgz`: stage 3 only, MiCS without the others, group sizes that divide the
    ranks (DeepSpeed's rules, which would otherwise ignore the flags or fail later)."""
    given = [flag for name, flag in _ZEROPP_FLAGS.items() if _given(args, name)]
    if not given:
        return
    stage, where = _stage(args)
    if stage is not None and stage != 3:
        parser.error(f"{given[0]} needs ZeRO stage 3, got stage {stage}{where}: DeepSpeed applies ZeRO++ and MiCS "
                     "at stage 3 only")  # fmt: skip
    if _given(args, "hybrid"):
        others = [flag for flag in given if flag != "--hybrid"]
        if others:
            parser.error(f"--hybrid (MiCS) does not combine with {others[0]}: DeepSpeed's MiCS neither keeps hpZ's "
                         "secondary copy nor quantizes")  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", 0)) or _opt(args, "nproc")
    for name, size in (("hybrid", args.hybrid), ("hpz", None if args.hpz is None else min(args.hpz, world))):
        if size is not None and world % size:
            parser.error(f"{_ZEROPP_FLAGS[name]} {getattr(args, name)} does not divide the {world} rank(s): its "
                         "groups are consecutive ranks (set --nproc to a multiple)")  # fmt: skip


def _stage(args: argparse.Namespace) -> tuple[int | None, str]:
    """The run's ZeRO stage and where it comes from: `--stage`, else `--config`'s file (None if it cannot tell: the
    file's own errors are reported when it is read), else the default."""
    if _given(args, "stage"):
        return args.stage, ""
    if args.config is None:
        return DEFAULTS["stage"], " (the default)"
    try:
        zero = json.loads(Path(args.config).read_text()).get("zero_optimization", {})
    except (OSError, ValueError, AttributeError):
        return None, ""
    stage = {"stage": 1 if zero else 0} if isinstance(zero, bool) else zero
    if not isinstance(stage, dict) or not isinstance(stage.get("stage", 0), int):
        return None, ""
    return stage.get("stage", 0), f" from --config {args.config}"


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name, None) is not None


def _opt(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's DeepSpeed config: `--config`'s file (if any) with the explicitly given flags applied, or the flags
    and their defaults."""
    from ..config import load_json

    base = args.config is not None
    cfg: dict[str, Any] = copy.deepcopy(load_json(args.config)) if base else {}

    def want(name: str) -> bool:  # apply this flag: given, or no file to take the value from
        return _given(args, name) or not base

    if want("batch") or want("accumulate"):
        if base and ("train_batch_size" in cfg) and (_given(args, "batch") or _given(args, "accumulate")):
            del cfg["train_batch_size"]  # the flags redefine the triad
        if want("batch"):
            cfg["train_micro_batch_size_per_gpu"] = _opt(args, "batch")
        if want("accumulate"):
            cfg["gradient_accumulation_steps"] = _opt(args, "accumulate")

    def section(key: str) -> dict[str, Any]:
        value = cfg.get(key)
        if key == "zero_optimization" and isinstance(value, bool):  # DeepSpeed's legacy form
            value = {"stage": 1 if value else 0}
        cfg[key] = value if isinstance(value, dict) else {}
        return cfg[key]

    if want("stage"):
        section("zero_optimization")["stage"] = _opt(args, "stage")
    if _given(args, "offload"):
        section("zero_optimization")["offload_optimizer"] = {"device": "cpu"}
    for flag in ("offload_optimizer", "offload_param"):
        if getattr(args, flag, None) is not None:
            block = section("zero_optimization").setdefault(flag, {})
            block["device"] = getattr(args, flag)
            if args.nvme_path is not None:
                block["nvme_path"] = args.nvme_path
    zeropp = {"hybrid": "mics_shard_size", "hpz": "zero_hpz_partition_size", "qwz": "zero_quantized_weights",
              "qgz": "zero_quantized_gradients"}  # fmt: skip
    for flag, key in zeropp.items():
        if _given(args, flag):
            section("zero_optimization")[key] = getattr(args, flag)
    if want("precision"):
        precision = _opt(args, "precision")
        for key in ("fp16", "bf16", "bfloat16"):
            if isinstance(cfg.get(key), dict):
                cfg[key]["enabled"] = False
        if precision != "fp32":
            cfg.setdefault(precision, {})["enabled"] = True
    if want("lr") or "optimizer" not in cfg:
        opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.1}})
        opt.setdefault("params", {})["lr"] = _opt(args, "lr")
    if want("warmup"):
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_num_steps": max(1, _opt(args, "warmup")), "warmup_type": "linear"},
        }
    if not base:
        cfg["gradient_clipping"] = 1.0
    if want("print_every"):
        cfg["steps_per_print"] = _opt(args, "print_every")
    comms = cfg.setdefault("comms_config", {})
    if isinstance(comms, dict) and (_given(args, "timeout") or comms.get("timeout") is None):
        comms["timeout"] = _opt(args, "timeout")  # a file's own timeout stays unless the flag is given
    if _given(args, "tensorboard"):  # the file's job_name and other keys stay
        section("tensorboard").update(enabled=True, output_path=args.tensorboard)
    if _given(args, "wandb"):
        section("wandb")["enabled"] = True
    out = Path(_opt(args, "out"))
    metrics = cfg.setdefault("fzero_metrics", {})
    metrics.update(
        jsonl=str(out / "metrics.jsonl"),
        seq_length=_opt(args, "seq_len"),
        num_layers=_opt(args, "layers"),
        hidden_size=_opt(args, "d_model"),
    )
    return cfg


def _relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The command line for each torchrun worker: the same flags, without `--nproc`."""
    argv = []
    for action_name in ("stage", "precision", "steps", "config", "batch", "accumulate", "lr", "warmup", "layers",
                        "d_model", "heads", "seq_len", "seed", "threads", "out", "print_every", "timeout",
                        "tensorboard", "hybrid", "hpz"):  # fmt: skip
        value = getattr(args, action_name, None)
        if value is not None:
            argv += [f"--{action_name.replace('_', '-')}", str(value)]
    if args.offload:
        argv.append("--offload")
    for flag in ("offload_optimizer", "offload_param", "nvme_path"):
        if getattr(args, flag, None) is not None:
            argv += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    for flag in ("wandb", "qwz", "qgz"):
        if getattr(args, flag, None):
            argv.append(f"--{flag}")
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def _launch(args: argparse.Namespace, nproc: int) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "fzero.cli", "train", *_relaunch_argv(args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def run(args: argparse.Namespace) -> int:
    """Train (or launch torchrun to train); returns the exit code. The process group, if any, is shut down before
    this returns (`fzero.host.process_group.shutdown`), whatever happened."""
    from ..config import ConfigError
    from ..host import process_group
    from ..host.hostmem import enable_huge_pages, retain_freed_memory
    from ..mesh import CollectiveError

    enable_huge_pages()  # before the model's first tensor (and inherited by the ranks torchrun starts)
    retain_freed_memory()  # (this process's; each rank torchrun starts runs this function too)
    nproc = _opt(args, "nproc")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, nproc)
    try:
        summary = train(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"fzero train: error: {e}", file=sys.stderr)
        return 2
    except CollectiveError as e:
        print(f"fzero train: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        process_group.shutdown()
    return 0 if summary is not None else 1


def _zeropp_text(cfg: Any) -> str:
    """What the config's ZeRO++ and MiCS keys do in this run, for the summary line: `", MiCS shard groups of 2"`,
    `", hpZ groups of 2, qwZ, qgZ"`, ... (`""`: nothing)."""
    from ..config.zeropp import zero_mesh_shape, zeropp_arguments

    on, shape = zeropp_arguments(cfg), zero_mesh_shape(cfg)
    parts = [f"{'MiCS shard' if on.get('hybrid') else 'hpZ'} groups of {shape['shard']}"] if shape else []
    if on.get("qwz") or on.get("qwz_frozen"):
        parts.append("qwZ" if on.get("qwz") else "qwZ of frozen weights")
    if on.get("qgz"):
        parts.append("qgZ")
    return "".join(f", {p}" for p in parts)


def _timeout(mesh: Any) -> str:
    seconds = getattr(mesh, "timeout", None)
    return f" (collective timeout {seconds:g} s)" if seconds is not None else ""


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The training loop on this process's rank; returns the summary (rank 0's figures on every rank)."""
    import torch
    from tqdm import tqdm

    import fzero
    from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, sample_batch
    from fzero.metrics import plot_loss_curve

    config = build_config(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    torch.set_num_threads(_opt(args, "threads") or max(1, (os.cpu_count() or 1) // world))
    seed, steps, seq_len = _opt(args, "seed"), _opt(args, "steps"), _opt(args, "seq_len")
    torch.manual_seed(seed)  # the same initial model on every rank (rank 0's is broadcast anyway)
    model = GPT(GPTConfig(seq_len=seq_len, n_layer=_opt(args, "layers"), n_head=_opt(args, "heads"),
                          d_model=_opt(args, "d_model")))  # fmt: skip
    show = rank == 0 and not args.no_progress
    bar = tqdm(total=steps, disable=not show, unit="step", dynamic_ncols=True, file=sys.stderr)
    say = (lambda *a: tqdm.write(" ".join(map(str, a)), file=sys.stdout)) if rank == 0 else (lambda *a: None)
    start = time.perf_counter()
    engine, _, _, _ = fzero.initialize(model=model, config=config, printer=say)
    c = engine.config
    if c.precision == "fp16" and engine.device.type == "cpu":
        say("note: fp16 matrix multiplications are very slow on CPUs without native fp16; bf16 is the fast choice")
    offload = f", optimizer offload to {c['zero_optimization']['offload_optimizer']['device']}" if c.offload else ""
    offload += _zeropp_text(c)
    say(
        f"fzero train: GPT {engine.state.layout.real_numel / 1e6:.2f}M params, ZeRO-{c.stage}, {c.precision}"
        f"{offload}, {engine.world_size} rank(s) over {engine.mesh!r}"
        f"{_timeout(engine.mesh)}, "
        f"{c.micro_batch}x{seq_len} tokens/rank/micro-step, accumulate {c.gas}"
        + (f", config {args.config}" if args.config else "")
    )
    tokens = corpus_tokens()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        for _ in range(c.gas):
            batch = {k: v.to(engine.device) for k, v in sample_batch(tokens, c.micro_batch, seq_len, gen).items()}
            logits = engine(batch["x"])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())
            engine.backward(loss)
            engine.step()
        rec = engine.last_record
        assert rec is not None  # (a step was just taken)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.2e}", refresh=False)
        bar.update()
    bar.close()
    summary = engine.summary()
    engine.close()
    total = time.perf_counter() - start
    if rank == 0:
        out = Path(_opt(args, "out"))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        title = f"fzero train: ZeRO-{c.stage}, {c.precision}, {engine.world_size} rank(s)"
        png = plot_loss_curve(out / "metrics.jsonl", out / "loss.png", title=title)
        tflops = f", {summary['tflops']:.3f} TFLOPS/rank" if summary["tflops"] is not None else ""
        rate = f"{summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] is not None else "untimed"
        say(
            f"done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the last 5 steps), "
            f"{rate}{tflops} over {summary['timed_steps']} timed steps, {summary['skipped']} skipped, "
            f"{total:.1f}s in all\nmetrics: {out / 'metrics.jsonl'}  loss curve: {png}"
        )
    summary["total_s"] = total
    return summary

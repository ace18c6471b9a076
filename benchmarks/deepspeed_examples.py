"""Which of DeepSpeedExamples' JSON configs DeepSpeed 0.19.8 accepts, which of those fzero trains, and whether the
first losses agree (issue 52's acceptance item).

    .venv/bin/python benchmarks/deepspeed_examples.py [--only SUBSTRING ...] [--timeout 120] [--git-dir DIR]

Reads the DeepSpeedExamples mirror (a bare git repository, read with `git ls-tree` / `git show`; default
/work/.mirror/microsoft+DeepSpeedExamples/repo) and classifies every `.json` file: a DeepSpeed config (a JSON object
with one of DeepSpeed's top-level keys: batch sizes, `zero_optimization`, `optimizer`, `fp16`, `bf16`, ...), a
template (placeholders a shell script fills, not JSON as stored) or something else (datasets, hostfiles, Hugging
Face model configs). Each config then runs the same script twice, `import deepspeed` (DeepSpeed 0.19.8 on its CPU
accelerator, `DS_ACCELERATOR=cpu`, gloo) and `import fzero.deepspeed as deepspeed`: `deepspeed.initialize` on a tiny
model with the config, one whole training step (all its micro-batches: `engine(x)`, `backward`, `step`), then one more
forward. The table gives each side's outcome (a refusal's first line, with where it came: `initialize` or `step`)
and whether the first micro-batch's loss and the loss after the step are bitwise equal.

What "the same script" fills in, identically on both sides:

- `"auto"` values as Hugging Face's `HfTrainerDeepSpeedConfig.trainer_config_process` fills them from default
  `TrainingArguments` (micro-batch 8, accumulation 1, clipping 1.0, AdamW lr 5e-5, betas (0.9, 0.999), eps 1e-8,
  weight decay 0, fp16 / bf16 off); a config without an `optimizer` block gets the client optimizer those scripts
  pass (`torch.optim.AdamW(lr=5e-5)`, the Trainer's default) and `zero_allow_untested_optimizer`, as the Trainer
  sets it; NVMe paths point at a temporary folder.
- the world size: 1, or the one the batch triad implies (`train_batch_size / (micro * accumulation)`) up to 2 gloo
  processes; a config needing more is reported as such.
- the model: a Linear-LayerNorm-GELU-Linear MLP (16 -> 32 -> 4, MSE loss in fp32; the input cast to the first
  weight's dtype, as the examples cast theirs under fp16 / bf16; its `forward` takes and ignores DeepSpeed's
  progressive-layer-drop keywords). Random-LTD configs get a tiny GPT-2-like model (`total_layer_num` blocks of width
  16, sequences of min(max_value, 256) tokens) wrapped by each side's `convert_to_random_ltd`, as the examples do;
  DeepSpeed's random-LTD CUDA kernels cannot be built on its CPU accelerator, so `TorchLTDKernels` stands in for them
  (the kernels' semantics in torch: a sort and two gathers/scatters along the sequence).
- the global random generator seeded before each forward (dropout, random-LTD's token draws).

Configs whose example needs sequence, tensor or pipeline parallelism or mixture-of-experts are marked, and run all the
same where the config itself holds no such key (the parallelism lives in the example's model code). Each side runs in
a child forked per job from a process that imported its library once (`--no-fork`: a fresh interpreter per job);
each job has `--timeout` seconds. Parallelism 1: one job at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

MIRROR = "/work/.mirror/microsoft+DeepSpeedExamples/repo"
DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
           "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
           "zero_allow_untested_optimizer", "prescale_gradients", "amp", "torch_autocast"}  # fmt: skip
# Hugging Face TrainingArguments' defaults, what `trainer_config_process` puts in place of "auto"
HF = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
      "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0,
      "scheduler.params.warmup_max_lr": 5e-5, "scheduler.params.warmup_num_steps": 1,
      "scheduler.params.total_num_steps": 2, "fp16.enabled": False, "bf16.enabled": False}  # fmt: skip
FP16_REFUSAL = "Type fp16 is not supported on your device."  # DeepSpeed's CPU accelerator without AVX512-FP16
D_IN, D_HID, D_OUT, VOCAB, LTD_WIDTH, LTD_MAX_SEQ = 16, 32, 4, 64, 16, 256


# ---------------------------------------------------------------------------------------------------- the configs


def git(git_dir: str, *args: str) -> str:
    """The output of a read-only git command on the mirror."""
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def classify(path: str, text: str) -> tuple[str, Any, str]:
    """("config", the parsed config, "") / ("template", None, why) / ("other", None, why) for one JSON file."""
    try:
        data = json.loads(text)
    except ValueError as e:
        if re.search(r'"(train_batch_size|train_micro_batch_size_per_gpu|zero_optimization)"', text):
            return "template", None, f"placeholders filled by its shell script (not JSON as stored: {e})"
        return "other", None, f"not JSON ({e})"
    if not isinstance(data, dict):
        return "other", None, f"a JSON {type(data).__name__}"
    if DS_KEYS & set(data):
        return "config", data, ""
    return "other", None, "no DeepSpeed key (keys: " + ", ".join(sorted(data)[:4]) + ", ...)"


def needs(path: str, cfg: dict[str, Any]) -> str:
    """What the config's example needs beyond data parallelism ("" for nothing), from its keys and its folder."""
    found = []
    if cfg.get("sequence_parallel_size", 1) > 1 or "sequence_parallel" in cfg:
        found.append("sequence parallelism")
    if "tensor_parallel" in cfg or cfg.get("tensor_parallel_size", 1) > 1:
        found.append("tensor parallelism")
    if "pipeline" in cfg or "pipeline_parallelism" in path:
        found.append("pipeline parallelism (the example's `PipelineModule`)")
    if "moe" in cfg or "/moe" in path.lower():
        found.append("mixture-of-experts")
    return ", ".join(found)


def features(cfg: dict[str, Any]) -> list[str]:
    """Config blocks that act through the example's model or script, not through `initialize` alone."""
    notes = []
    if "compression_training" in cfg:
        notes.append("compression_training (DeepSpeed's removed compression library)")
    if "sparse_attention" in cfg:
        notes.append("sparse_attention acts through the model's `SparseSelfAttention`")
    if (cfg.get("progressive_layer_drop") or {}).get("enabled"):
        notes.append("progressive_layer_drop: the model takes (and here ignores) its keywords")
    if "autotuning" in cfg:
        notes.append("autotuning acts through the `deepspeed --autotuning` launcher")
    if "quantize_training" in cfg:
        notes.append("quantize_training (MoQ)")
    return notes


def random_ltd(cfg: dict[str, Any]) -> dict[str, Any] | None:
    block = (((cfg.get("data_efficiency") or {}).get("data_routing") or {}).get("random_ltd")) or {}
    return block if block.get("enabled") else None


def fill(node: dict[str, Any], dotted: str, value: Any) -> None:
    """HF's `fill_match` for one key: replace "auto" only."""
    *parents, key = dotted.split(".")
    for name in parents:
        node = node.get(name)  # type: ignore[assignment]
        if not isinstance(node, dict):
            return
    if node.get(key) == "auto":
        node[key] = value


def prepare(cfg: dict[str, Any], scratch: str) -> tuple[dict[str, Any], int, bool, str]:
    """The config as both sides get it, its world size, whether a client optimizer goes with it, and why it cannot
    run here ("" when it can)."""
    cfg = json.loads(json.dumps(cfg))
    for key, value in HF.items():
        fill(cfg, key, value)
    micro, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
    world = 1
    if isinstance(micro, int) and isinstance(gas, int):
        fill(cfg, "train_batch_size", micro * gas)  # world * micro * accumulation, world 1
        total = cfg.get("train_batch_size")
        if isinstance(total, int) and total != micro * gas:
            world = total // (micro * gas) if total % (micro * gas) == 0 else 0
            if world not in (1, 2):
                return cfg, world, False, f"the batch triad needs {total}/({micro}*{gas}) ranks (at most 2 here)"
    client = "optimizer" not in cfg
    if client:
        cfg["zero_allow_untested_optimizer"] = True  # what the Trainer sets with its own optimizer
    zero = cfg.get("zero_optimization") or {}
    for part in ("offload_param", "offload_optimizer"):
        if isinstance(zero.get(part), dict) and "nvme_path" in zero[part]:
            zero[part]["nvme_path"] = os.path.join(scratch, "nvme")
    if "aio" in cfg or any(isinstance(zero.get(p), dict) for p in ("offload_param", "offload_optimizer")):
        os.makedirs(os.path.join(scratch, "nvme"), exist_ok=True)
    return cfg, world, client, ""


# ------------------------------------------------------------------------------------------------------ the models


def build_models() -> Any:
    """The model classes (built here so that the parent process never imports torch)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        """A Linear-LayerNorm MLP whose forward returns its loss."""

        def __init__(self) -> None:
            super().__init__()
            self.inp, self.norm, self.out = nn.Linear(D_IN, D_HID), nn.LayerNorm(D_HID), nn.Linear(D_HID, D_OUT)

        def forward(self, x: torch.Tensor, y: torch.Tensor, **pld: Any) -> torch.Tensor:
            # (**pld: DeepSpeed passes progressive_layer_drop / pld_theta to the model when that block is on)
            h = F.gelu(self.norm(self.inp(x.to(self.inp.weight.dtype))))
            return F.mse_loss(self.out(h).float(), y)

    class Block(nn.Module):
        """A GPT-2-like block as transformers 4 called it (the mask a keyword, a tuple out): what
        `convert_to_random_ltd` wraps."""

        def __init__(self) -> None:
            super().__init__()
            d = LTD_WIDTH
            self.ln_1, self.attn, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln_2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
            q, k, v = self.attn(self.ln_1(hidden)).chunk(3, dim=-1)
            scores = q @ k.transpose(-1, -2) / LTD_WIDTH**0.5
            if attention_mask is not None:
                scores = scores + attention_mask[:, 0]
            hidden = hidden + self.proj(scores.softmax(-1) @ v)
            return (hidden + self.out(F.gelu(self.fc(self.ln_2(hidden)))),)

    class TinyGPT(nn.Module):
        def __init__(self, layers: int, seq: int, masked: bool) -> None:
            super().__init__()
            self.masked = masked
            self.wte, self.wpe = nn.Embedding(VOCAB, LTD_WIDTH), nn.Embedding(seq, LTD_WIDTH)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(LTD_WIDTH), nn.Linear(LTD_WIDTH, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            b, s = ids.shape
            x = self.wte(ids) + self.wpe(torch.arange(s))
            x = x.to(self.head.weight.dtype)
            mask = torch.full((s, s), -1e4).triu(1)[None, None].expand(b, 1, s, s).to(x.dtype)
            for block in self.h:
                x = (block(x, attention_mask=mask) if self.masked else block(x))[0]
            logits = self.head(self.ln_f(x)).float()
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    return Net, Block, TinyGPT


class TorchLTDKernels:
    """DeepSpeed's random-LTD CUDA kernels (`csrc/random_ltd`: `token_sort_`, `token_gather`, `token_scatter_`) in
    torch, standing in for the op its CPU accelerator cannot build."""

    @staticmethod
    def token_sort_(ids: Any, original_tokens: int) -> Any:
        return ids.copy_(ids.sort(dim=-1).values)

    @staticmethod
    def _index(idx: Any, width: int, batch_first: bool) -> Any:
        idx = idx.long() if batch_first else idx.long().t()
        return idx[..., None].expand(-1, -1, width)

    @staticmethod
    def token_gather(activations: Any, idx: Any, batch_first: bool) -> Any:
        dim = 1 if batch_first else 0
        return activations.gather(dim, TorchLTDKernels._index(idx, activations.shape[2], batch_first))

    @staticmethod
    def token_scatter_(everything: Any, part: Any, idx: Any, batch_first: bool) -> Any:
        dim = 1 if batch_first else 0
        return everything.scatter_(dim, TorchLTDKernels._index(idx, everything.shape[2], batch_first), part)


# ----------------------------------------------------------------------------------------------- one side's job


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`; an empty message gets the place it was raised."""
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text.splitlines()[0][:300]}"
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {os.path.basename(frame.filename)}:{frame.lineno} ({(frame.line or '').strip()})"


def train(trainer: str, job: dict[str, Any]) -> dict[str, Any]:
    """One side: initialize, one whole step, one forward more; the losses as float hex (rank-averaged)."""
    import torch
    import torch.distributed as dist

    if trainer == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

        if job.get("fp16_forced"):  # (a second run: the CPU accelerator's fp16 check answered yes)
            type(get_accelerator()).is_fp16_supported = lambda self: True
    else:
        import fzero.deepspeed as deepspeed  # type: ignore[no-redef]
        from fzero.deepspeed.runtime.data_pipeline.data_routing.helper import (  # type: ignore[no-redef]
            convert_to_random_ltd,
        )
    Net, Block, TinyGPT = build_models()
    cfg, rank, world, ltd = job["config"], int(os.environ["RANK"]), job["world"], job["ltd"]
    torch.manual_seed(0)
    seq = min(ltd["random_ltd_schedule"]["max_value"], LTD_MAX_SEQ) if ltd else 0
    model = TinyGPT(ltd["total_layer_num"], seq, ltd.get("model_mask_name") is not None) if ltd else Net()
    kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0)} if job["client"] else {}
    phase = "initialize"
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kwargs)
        if ltd:
            engine = convert_to_random_ltd(engine, Block)
        phase = "step"
        micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

        def batch(step: int, i: int) -> tuple[Any, ...]:
            g = torch.Generator().manual_seed(100003 * step + 101 * i + rank)
            torch.manual_seed(1000 * step + i)  # the forward's own draws: the same on both sides
            if ltd:
                return (torch.randint(0, VOCAB, (micro, seq), generator=g),)
            return torch.randn(micro, D_IN, generator=g), torch.randn(micro, D_OUT, generator=g)

        def mean(loss: Any) -> str:
            total = loss.detach().float().clone()
            if world > 1:
                dist.all_reduce(total)
            return float((total / world).item()).hex()

        losses = []
        for i in range(gas):
            loss = engine(*batch(0, i))
            engine.backward(loss)
            engine.step()
            losses.append(mean(loss))
        after = mean(engine(*batch(1, 0)))
        return {"ok": True, "first": losses[0], "after": after, "micro": micro, "gas": gas,
                "skipped": int(getattr(engine, "skipped_steps", 0))}  # fmt: skip
    except Exception as e:
        return {"ok": False, "phase": phase, "error": first_line(e)}


def child(trainer: str, job: dict[str, Any], rank: int) -> None:
    """A forked rank: its environment, the job, its result file; never returns."""
    code = 1
    try:
        log = os.open(os.path.join(job["out"], f"{trainer}.{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world"]),
                          LOCAL_WORLD_SIZE=str(job["world"]), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(job["port"]))  # fmt: skip
        result = train(trainer, job)
        with open(os.path.join(job["out"], f"{trainer}.{rank}.json"), "w") as f:
            json.dump(result, f)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def zygote(trainer: str) -> None:
    """Imports the trainer's library once, then forks the ranks of each job read from stdin (a JSON line each),
    kills them past the job's timeout, and answers one line per job."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    if trainer == "deepspeed":
        import deepspeed.ops
        from deepspeed.ops.random_ltd import dropping_utils

        deepspeed.ops.__compatible_ops__ = {}  # gloo's collectives, not a shared-memory C++ kernel built first
        dropping_utils.random_ltd_module = TorchLTDKernels  # (see its docstring)
    else:
        import fzero.deepspeed  # noqa: F401
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pids = []
        for rank in range(job["world"]):
            pid = os.fork()
            if pid == 0:
                child(trainer, job, rank)
            pids.append(pid)
        deadline, status = time.monotonic() + job["timeout"], "done"
        left = set(pids)
        while left:
            for pid in list(left):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    left.discard(pid)
            if left and time.monotonic() > deadline:
                status = "timeout"
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                for pid in left:
                    os.waitpid(pid, 0)
                left.clear()
            time.sleep(0.02)
        print(status, flush=True)


class Side:
    """A trainer's job runner: a forking zygote process, or (`fork=False`) a fresh interpreter per job."""

    def __init__(self, trainer: str, fork: bool) -> None:
        self.trainer, self.fork = trainer, fork
        self.proc: subprocess.Popen[str] | None = None
        self.env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, __file__, "--zygote", self.trainer], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"{self.trainer} did not start"
        return proc

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or not self.fork:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], job["timeout"] + 30)
        status = self.proc.stdout.readline().strip() if ready else "lost"
        if not self.fork or status != "done":
            self.close()
        if status == "timeout":
            return {"ok": False, "phase": "step", "error": f"timed out after {job['timeout']} s"}
        path = os.path.join(job["out"], f"{self.trainer}.0.json")
        if status == "done" and os.path.exists(path):
            with open(path) as f:
                return dict(json.load(f))
        log = os.path.join(job["out"], f"{self.trainer}.0.log")
        tail = [ln for ln in open(log).read().splitlines() if ln.strip()] if os.path.exists(log) else []
        return {"ok": False, "phase": "step", "error": "crashed: " + (tail[-1][:300] if tail else status)}

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc = None


# ----------------------------------------------------------------------------------------------------------- report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def outcome(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    forced = "fp16 check bypassed: " if r.get("cpu_fp16") else ""
    if r["ok"]:
        return f"ok{f' ({forced[:-2]})' if forced else ''}" + (" (step skipped: overflow)" if r.get("skipped") else "")
    return f"{forced}refused at {r['phase']}: {r['error']}".replace("|", "\\|")


def same(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> str:
    if not (a and b and a["ok"] and b["ok"]):
        return "-"
    x, y = float.fromhex(a[key]), float.fromhex(b[key])
    return "equal" if a[key] == b[key] else f"differ ({x:.6g} vs {y:.6g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-dir", default=MIRROR, help="the DeepSpeedExamples mirror (a bare git repository)")
    parser.add_argument("--only", nargs="*", default=[], help="run the configs whose path contains one of these")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per config and side")
    parser.add_argument("--no-fork", action="store_true", help="a fresh interpreter per job")
    parser.add_argument("--zygote", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zygote:
        return zygote(args.zygote)
    started = time.monotonic()
    paths = [p for p in git(args.git_dir, "ls-tree", "-r", "--name-only", "HEAD").splitlines() if p.endswith(".json")]
    kinds: dict[str, list[str]] = {"config": [], "template": [], "other": []}
    rows = []
    sides = {t: Side(t, not args.no_fork) for t in ("deepspeed", "fzero")}
    scratch = tempfile.mkdtemp(prefix="fzero-dsx-")
    try:
        for path in paths:
            kind, cfg, why = classify(path, git(args.git_dir, "show", f"HEAD:{path}"))
            kinds[kind].append(f"{path} ({why})" if why else path)
            if kind != "config" or (args.only and not any(s in path for s in args.only)):
                continue
            out = tempfile.mkdtemp(dir=scratch)
            cfg, world, client, skip = prepare(cfg, out)
            row: dict[str, Any] = {"path": path, "world": world, "needs": needs(path, cfg), "notes": features(cfg)}
            if random_ltd(cfg):
                row["notes"].append("random-LTD: a tiny GPT-2-like model, DeepSpeed's kernels in torch")
            if skip:
                row.update(skip=skip)
            else:
                job = {"config": cfg, "world": world, "client": client, "ltd": random_ltd(cfg), "out": out,
                       "timeout": args.timeout}  # fmt: skip
                t0 = time.monotonic()
                for trainer, side in sides.items():
                    row[trainer] = side.run(dict(job, port=free_port()))
                if row["deepspeed"].get("error") == f"ValueError: {FP16_REFUSAL}":
                    forced = sides["deepspeed"].run(dict(job, port=free_port(), fp16_forced=True))
                    row["deepspeed"] = dict(forced, cpu_fp16=True)
                half = [k for k in ("fp16", "bf16") if (cfg.get(k) or {}).get("enabled") is True]
                ds, fz = row["deepspeed"], row["fzero"]
                if half and ds["ok"] and fz["ok"] and (ds["first"], ds["after"]) != (fz["first"], fz["after"]):
                    # fzero's master starts from the exact fp32 weights, DeepSpeed's from their rounding (docs/
                    # engine.md): the same run with fzero's key for DeepSpeed's arithmetic says whether that is all
                    cfg2 = dict(cfg, fzero_precision={"round_initial_master": True})
                    row["rounded"] = sides["fzero"].run(dict(job, config=cfg2, port=free_port()))
                row["seconds"] = time.monotonic() - t0
            rows.append(row)
            print(f"[{time.monotonic() - started:6.0f} s] {path}: {outcome(row.get('deepspeed'))} | "
                  f"{outcome(row.get('fzero'))}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for side in sides.values():
            side.close()
        shutil.rmtree(scratch, ignore_errors=True)
    report(rows, kinds, time.monotonic() - started)


def report(rows: list[dict[str, Any]], kinds: dict[str, list[str]], seconds: float) -> None:
    print(
        f"JSON files: {sum(map(len, kinds.values()))}; DeepSpeed configs: {len(kinds['config'])}; templates (not "
        f"JSON until a script fills them): {len(kinds['template'])}; other JSON: {len(kinds['other'])}"
    )
    for kind in ("template", "other"):
        print("".join(f"\n- {kind}: {entry}" for entry in kinds[kind]))
    print()
    print("| config | ranks | DeepSpeed 0.19.8 | fzero | first loss | loss after 1 step | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        notes = "; ".join(([f"needs {r['needs']}"] if r["needs"] else []) + r["notes"]) or ""
        ds, fz = (r.get("skip"), r.get("skip")) if r.get("skip") else (outcome(r["deepspeed"]), outcome(r["fzero"]))
        first, after = (
            same(r.get("deepspeed"), r.get("fzero"), "first"),
            same(r.get("deepspeed"), r.get("fzero"), "after"),
        )
        if r.get("rounded"):
            again = same(r["deepspeed"], r["rounded"], "after")
            after += f"; with `round_initial_master`: {again}"
        print(f"| {r['path']} | {r['world']} | {ds} | {fz} | {first} | {after} | {notes} |")
    ran = [r for r in rows if not r.get("skip")]
    for label, group in (
        ("as is", [r for r in ran if not r["deepspeed"].get("cpu_fp16")]),
        ("with its CPU fp16 check bypassed", [r for r in ran if r["deepspeed"].get("cpu_fp16")]),
    ):
        ds_ok = [r for r in group if r["deepspeed"]["ok"]]
        fz_ok = [r for r in ds_ok if r["fzero"]["ok"]]
        equal = [r for r in fz_ok if (r["deepspeed"]["first"], r["deepspeed"]["after"])
                 == (r["fzero"]["first"], r["fzero"]["after"])]  # fmt: skip
        rounded = [r for r in fz_ok if r not in equal and r.get("rounded", {}).get("after") == r["deepspeed"]["after"]]
        extra = [r for r in group if r["fzero"]["ok"] and not r["deepspeed"]["ok"]]
        print(f"DeepSpeed {label}: {len(group)} configs, {len(ds_ok)} accepted; fzero trains {len(fz_ok)} of those "
              f"({len(equal)} with both losses bitwise DeepSpeed's, {len(rounded)} more with `round_initial_master`) "
              f"and refuses {len(ds_ok) - len(fz_ok)}; fzero trains {len(extra)} that DeepSpeed refuses")  # fmt: skip
    print(f"not run: {len(rows) - len(ran)}; {seconds:.0f} s")


if __name__ == "__main__":
    main()

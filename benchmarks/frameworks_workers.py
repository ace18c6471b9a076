"""`benchmarks/frameworks.py`'s worker processes: every framework's trainers, in one pair of gloo processes.

Each row is one framework run end to end (its own set-up, loader and loop) for `WARMUP + steps` optimizer steps;
rank 0 takes a timestamp (wall and process CPU time) at the end of every optimizer step in the framework's own
hook (Accelerate: our loop, after `optimizer.zero_grad()`; Trainer: `TrainerCallback.on_step_end`; Lightning:
`on_train_batch_end`) and a row's time for the round is the mean interval between the step ends after the warm-up
(each interval: fetching the micro-batch, forward, backward, the reduction, clipping and the update). Every row is
built fresh each round (Accelerate's process state reset first, as tests/accelerate_worker.py does), so the rows
can rotate: a framework owns its loop, and one loop cannot be interleaved with another.

The DeepSpeed rows run DeepSpeed itself (`DS_ACCELERATOR=cpu`, set here before anything imports it; its comm
wraps the gloo group already made) through each framework's own DeepSpeed path. On the CPU those paths need their
process set-up done for them, without fzero's alias, so `import deepspeed` stays DeepSpeed's:
`fzero.integrations.accelerate.prepare_cpu_state()` for Accelerate and for the Trainer (a `TrainingArguments`
whose device set-up calls it, as `FzeroTrainingArguments` does), and for Lightning, whose `DeepSpeedStrategy`
refuses every accelerator but CUDA, that strategy with DDP's environment set-up and its own process-group set-up
minus the CUDA index check, and its `deepspeed.initialize` call given the local rank as the device rank
(`CpuDeepSpeedStrategy`: three methods). Each DeepSpeed and
fzero row checks the engine it trained with (`deepspeed.runtime.engine.DeepSpeedEngine` or fzero's): a row that
fails, or trains on the other one's engine, is skipped with its reason, never timed as something else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported (its accelerator is chosen then)

import torch
import torch.distributed as dist

from fzero.host import process_group

FRAMEWORKS = ("accelerate", "trainer", "lightning")
WARMUP = 2  # untimed optimizer steps at the start of every row's run
MICRO, SEQ, LR, WD, CLIP = 4, 64, 1e-4, 0.01, 1.0
# GPT-2, tied head, no dropout
MODEL: dict[str, Any] = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=SEQ)
TIMEOUT_S = 300  # a collective waiting longer for the other rank fails (and the run with it) instead of hanging
Mark = tuple[float, float]  # (time.perf_counter(), time.process_time()) at the end of an optimizer step


def gpt2() -> torch.nn.Module:
    """The benchmark's GPT-2 (`MODEL`, fp32, dropout 0), equal at every call (seed 0)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**MODEL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).train()


def n_params() -> int:
    return sum(p.numel() for p in gpt2().parameters())


def tokens(n_steps: int, world: int) -> torch.Tensor:
    """Enough fixed sequences for `n_steps` micro-batches of `MICRO` on each of `world` ranks."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (n_steps * MICRO * world, SEQ), generator=g)


def ds_config(stage: int, accumulation: bool = True) -> dict[str, Any]:
    """The DeepSpeed JSON config of the fzero and DeepSpeed rows: the batch, accumulation and clipping given (the
    frameworks check them against their own arguments), the framework's optimizer (none in the config), DeepSpeed's
    defaults otherwise. `accumulation=False`: without `gradient_accumulation_steps` (Lightning's DeepSpeed strategy
    refuses it there and sets it from `accumulate_grad_batches`)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if not accumulation:
        del cfg["gradient_accumulation_steps"]
    return cfg


def mark() -> Mark:
    return time.perf_counter(), time.process_time()


def engine_check(engine: Any, kind: str) -> str:
    """The engine's class path, after checking it is the row's: DeepSpeed's for `deepspeed`, fzero's for `fzero`,
    torch's `DistributedDataParallel` for `ddp`.

    Raises:
      RuntimeError: the row trained on another engine (e.g. fzero's alias still held during a DeepSpeed row).
    """
    path = f"{type(engine).__module__}.{type(engine).__qualname__}"
    wanted = {"deepspeed": "deepspeed.", "fzero": "fzero.", "ddp": "torch.nn.parallel.distributed."}[kind]
    if not path.startswith(wanted):
        raise RuntimeError(f"the {kind} row trained on {path}, expected a {wanted}* engine")
    return path


# ---------------------------------------------------------------------------------------------- Accelerate
def run_accelerate(kind: str, stage: int, n_steps: int, world: int, out: str) -> tuple[list[Mark], str]:
    """Accelerate's ordinary loop: `accelerate.Accelerator(cpu=True)` (DDP), fzero's `Accelerator(fzero_config=)`,
    or `accelerate.Accelerator(deepspeed_plugin=...)` on DeepSpeed itself. Returns the step-end marks and the
    engine (or wrapper) class."""
    import accelerate
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from fzero.integrations import accelerate as fzero_accelerate

    AcceleratorState._reset_state(reset_partial_state=True)
    if kind == "ddp":
        acc = accelerate.Accelerator(cpu=True)
    elif kind == "fzero":
        acc = fzero_accelerate.Accelerator(fzero_config=ds_config(stage))
    else:
        fzero_accelerate.prepare_cpu_state(cpu=True)  # (no alias: Accelerate imports DeepSpeed's own `deepspeed`)
        acc = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage)))
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    loader: Any = torch.utils.data.DataLoader(tokens(n_steps, world), batch_size=MICRO)  # type: ignore[arg-type]
    model, opt, loader = acc.prepare(model, opt, loader)
    engine = engine_check(model, kind)
    marks: list[Mark] = []
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        marks.append(mark())
        if len(marks) == n_steps:
            break
    return marks, engine


# ---------------------------------------------------------------------------------------------- HF Trainer
def _cpu_deepspeed_arguments() -> type:
    """`TrainingArguments` whose device set-up prepares Accelerate's CPU processes for DeepSpeed's path (what
    `FzeroTrainingArguments` does, without fzero's alias: the Trainer then runs DeepSpeed itself)."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from fzero.integrations.accelerate import prepare_cpu_state

    @dataclasses.dataclass
    class CpuDeepSpeedArguments(TrainingArguments):
        @cached_property
        def _setup_devices(self) -> torch.device:
            AcceleratorState._reset_state(reset_partial_state=True)
            prepare_cpu_state(cpu=True, backend=self.ddp_backend, timeout=datetime.timedelta(seconds=self.ddp_timeout))
            self.accelerator_config.use_configured_state = True  # type: ignore[union-attr]  # (the state just prepared)
            return TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined]

    return CpuDeepSpeedArguments


def run_trainer(kind: str, stage: int, n_steps: int, world: int, out: str) -> tuple[list[Mark], str]:
    """Hugging Face's `Trainer`: `TrainingArguments(use_cpu=True)` (DDP), `FzeroTrainingArguments` + `FzeroTrainer`,
    or `TrainingArguments(deepspeed=config)` on DeepSpeed itself; its own AdamW (`optim`'s default), a constant
    learning rate. Returns the step-end marks (`on_step_end`) and the engine (or wrapper) class."""
    from accelerate.state import AcceleratorState
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from fzero.integrations.transformers import FzeroTrainer, FzeroTrainingArguments

    marks: list[Mark] = []

    class Marks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.append(mark())

    AcceleratorState._reset_state(reset_partial_state=True)
    common: dict[str, Any] = dict(
        output_dir=os.path.join(out, f"trainer-{kind}"), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=1, max_grad_norm=CLIP, max_steps=n_steps, learning_rate=LR, weight_decay=WD,
        lr_scheduler_type="constant", logging_steps=10**6, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        save_strategy="no", train_sampling_strategy="sequential", dataloader_num_workers=0,
    )  # fmt: skip
    trainer_class: type = Trainer
    if kind == "ddp":
        args = TrainingArguments(**common)
    elif kind == "fzero":
        args = FzeroTrainingArguments(**common, fzero_config=ds_config(stage))
        trainer_class = FzeroTrainer
    else:
        args = _cpu_deepspeed_arguments()(**common, deepspeed=ds_config(stage))
    data = [{"input_ids": x, "labels": x} for x in tokens(n_steps, world)]
    trainer = trainer_class(model=gpt2(), args=args, train_dataset=data, callbacks=[Marks()])
    trainer.remove_callback(PrinterCallback)  # (its end-of-training line on every run)
    trainer.train()
    return marks, engine_check(trainer.model_wrapped, kind)


# ---------------------------------------------------------------------------------------------- Lightning
def _lightning_parts() -> tuple[type, type]:
    """The LightningModule and the DeepSpeed strategy accepting the CPU (Lightning imported only when its rows run)."""
    import lightning
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class Module(lightning.LightningModule):
        def __init__(self, marks: list[Mark]) -> None:
            super().__init__()
            self.model = gpt2()
            self.marks = marks
            self.seen: list[Any] = []  # what the strategy trains (DDP's wrapper or the engine), seen while training

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.marks.append(mark())  # (accumulation 1: after every optimizer step)
            self.seen[:] = [self.trainer.strategy.model]  # (a list: a module attribute would register it)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)

    class CpuDeepSpeedStrategy(DeepSpeedStrategy):
        """Lightning's `DeepSpeedStrategy` (DeepSpeed itself) with the CPU accepted: DDP's environment set-up,
        DeepSpeed's process-group set-up without the CUDA device-index check (both as `FzeroStrategy` does), and
        `deepspeed.initialize` given the local rank as its device rank (Lightning passes the root device's index,
        None for the CPU, which DeepSpeed's engine compares with 0); otherwise Lightning's own code."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed

            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False,
            )  # fmt: skip
            return engine, deepspeed_optimizer

    return Module, CpuDeepSpeedStrategy


def run_lightning(kind: str, stage: int, n_steps: int, world: int, out: str) -> tuple[list[Mark], str]:
    """`lightning.Trainer` with `strategy="ddp"`, fzero's `FzeroStrategy(config=)` or Lightning's own DeepSpeed
    strategy on DeepSpeed itself (`CpuDeepSpeedStrategy`). Returns the step-end marks and the engine class."""
    import lightning
    from torch.utils.data import DataLoader, TensorDataset

    from fzero.integrations.lightning import FzeroStrategy

    module_class, cpu_deepspeed = _lightning_parts()
    strategy: Any = "ddp"
    if kind == "fzero":
        strategy = FzeroStrategy(config=ds_config(stage, accumulation=False))
    elif kind == "deepspeed":
        strategy = cpu_deepspeed(config=ds_config(stage, accumulation=False))
    marks: list[Mark] = []
    module = module_class(marks)
    trainer = lightning.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_steps=n_steps, accumulate_grad_batches=1,
        gradient_clip_val=CLIP, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=os.path.join(out, f"lightning-{kind}"),
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(tokens(n_steps, world)), batch_size=MICRO))
    return marks, engine_check(module.seen[0], kind)


RUNNERS: dict[str, Callable[[str, int, int, int, str], tuple[list[Mark], str]]] = {
    "accelerate": run_accelerate,
    "trainer": run_trainer,
    "lightning": run_lightning,
}


def parse_row(name: str) -> tuple[str, str, int]:
    """`"trainer-fzero-zero3"` -> `("trainer", "fzero", 3)`; the DDP rows (`-ddp`, `-ddp-again`) have stage 0."""
    framework, _, rest = name.partition("-")
    if rest in ("ddp", "ddp-again"):
        return framework, "ddp", 0
    kind, _, zero = rest.rpartition("-zero")
    return framework, kind, int(zero)


# ---------------------------------------------------------------------------------------------- the worker
def quiet() -> None:
    """The frameworks' per-run advice and logs off (each row is built every round)."""
    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "lightning", "lightning.pytorch", "lightning.fabric", "accelerate", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Within: one row's run. After it, what a row leaves process-wide is undone, so that no row runs in a process
    another row changed: its objects are collected (fzero's alias, held by its objects, is released then), Accelerate's
    process state is reset, the environment is restored (an `Accelerator` given a DeepSpeed plugin, fzero's too,
    sets `ACCELERATE_USE_DEEPSPEED=true`, which would turn every later `Trainer` into a DeepSpeed one) and so is
    `torch.nn.functional.linear` (DeepSpeed's ZeRO-3 replaces it process-wide with its memory-efficient linear,
    "until manually reset"; left there it would run in every later row, and it fails on fzero's stage-3 parameters,
    which carry DeepSpeed's `ds_id` attribute)."""
    environ, linear = dict(os.environ), torch.nn.functional.linear
    try:
        yield
    finally:
        with contextlib.suppress(ImportError):
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
        gc.collect()
        os.environ.clear()
        os.environ.update(environ)
        torch.nn.functional.linear = linear


def why(err: BaseException) -> str:
    """An exception in one line."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def time_worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    """The rows of `args.rows` in one pair of processes, in rotating order, built fresh each round: `WARMUP`
    untimed steps then `args.steps` timed ones. Rank 0 writes `times.json` beside `store`: per row its step time
    each round (wall and CPU) and their medians, the median time of its whole run (built, trained, collected), the
    engine it ran on, and why each skipped row was skipped."""
    # what launchers set (Accelerate's and Lightning's process set-up read them; the group exists already)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                      OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
    quiet()
    skipped: dict[str, str] = {}
    if any(parse_row(r)[1] == "deepspeed" for r in args.rows):
        try:  # imported once before any row, so every row runs in a process that has imported it
            import deepspeed  # noqa: F401

            quiet()
        except Exception as e:  # (ImportError, or its accelerator failing to load)
            skipped.update({r: f"DeepSpeed does not import: {why(e)}" for r in args.rows if "-deepspeed-" in r})
    rows = [r for r in args.rows if r not in skipped]
    wall: dict[str, list[float]] = {r: [] for r in rows}
    cpu: dict[str, list[float]] = {r: [] for r in rows}
    whole: dict[str, list[float]] = {r: [] for r in rows}  # the row's whole run: built, trained, collected
    engines: dict[str, str] = {}
    n_steps = WARMUP + args.steps
    try:
        with tempfile.TemporaryDirectory() as out:
            for r in range(args.rounds):
                for name in rows[r % len(rows) :] + rows[: r % len(rows)]:
                    if name in skipped:
                        continue
                    framework, kind, stage = parse_row(name)
                    dist.barrier()
                    error, timed, start = None, (0.0, 0.0), time.perf_counter()
                    with isolated():
                        try:
                            marks, engines[name] = RUNNERS[framework](kind, stage, n_steps, world, out)
                            if len(marks) != n_steps:
                                raise RuntimeError(f"{len(marks)} optimizer steps marked, expected {n_steps}")
                            timed = per_step(marks, WARMUP)
                        except Exception as e:
                            error = why(e)
                    errors: list[Any] = [None] * world
                    dist.all_gather_object(errors, error)  # (a row is skipped on both ranks, or on neither)
                    if any(errors):  # (its earlier rounds, if any, are dropped too: a row is whole or absent)
                        skipped[name] = next(e for e in errors if e)
                        wall[name], cpu[name], whole[name] = [], [], []
                        continue
                    wall[name].append(timed[0])
                    cpu[name].append(timed[1])
                    whole[name].append(time.perf_counter() - start)
                if rank == 0:
                    print(f"round {r + 1}/{args.rounds} done", flush=True)
        if rank == 0:
            result = {"all": {k: v for k, v in wall.items() if v}, "cpu": {k: v for k, v in cpu.items() if v},
                      "median": {k: statistics.median(v) for k, v in wall.items() if v},
                      "cpu_median": {k: statistics.median(v) for k, v in cpu.items() if v},
                      "whole_median": {k: statistics.median(v) for k, v in whole.items() if v},
                      "engines": engines, "skipped": skipped}  # fmt: skip
            with open(os.path.join(os.path.dirname(store), "times.json"), "w") as f:
                json.dump(result, f)
    finally:
        process_group.shutdown()  # not destroy_process_group: see fzero.host.process_group


def per_step(marks: list[Mark], warmup: int) -> tuple[float, float]:
    """The mean wall and CPU seconds per step over the steps after the first `warmup` (from the end of step
    `warmup` to the end of the last)."""
    (w0, c0), (w1, c1) = marks[warmup - 1], marks[-1]
    n = len(marks) - warmup
    return (w1 - w0) / n, (c1 - c0) / n


if __name__ == "__main__":  # (run by frameworks.py only)
    sys.exit("run benchmarks/frameworks.py")

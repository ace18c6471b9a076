"""Worker of tests/test_compile.py: per-unit compilation on 2 gloo processes, against eager, with dynamo's counters."""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fzero
from fzero.examples.gpt import GPT, GPTConfig
from fzero.host import process_group

from .spawn import init_worker, report

BACKEND = "aot_eager"  # the traced aten graph, run as traced: arithmetic identical to eager, so bitwise
STEPS = 4


def _model(checkpointed: bool = False) -> GPT:
    """The tiny GPT; `checkpointed`: each block's forward under activation checkpointing (recomputed in the
    backward, as `gradient_checkpointing_enable` does in Hugging Face's layers)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
    for block in model.blocks if checkpointed else ():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def _batches(rank: int, short: bool = False) -> list[torch.Tensor]:
    """`STEPS` batches of 2 sequences, and with `short` a last one of 1."""
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(0, 64, (2 if i < STEPS else 1, 17), generator=g) for i in range(STEPS + short)]


def _config(stage: int, precision: str, accumulate: int = 1, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulate,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


MIXED = {  # the habits a compiled unit must survive: (stage, precision, accumulation, checkpointed, ZeRO keys)
    "2-fp16-mixed": (2, "fp16", 2, True, {}),
    "3-fp32-mixed": (3, "fp32", 2, True, {"offload_optimizer": {"device": "cpu"}, "zero_quantized_weights": True}),
}


def _lm(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def engine_losses(
    rank: int, stage: int, precision: str, how: str, short: bool = False, mixed: str | None = None
) -> dict[str, Any]:
    """The engine's losses over the batches (`short`: and a last short one; `mixed`: a `MIXED` case's settings,
    a loss per micro-batch); `how`: eager, compile (`engine.compile`), wrapped (`torch.compile(model, backend=...)`
    handed to initialize; dynamo's caches are kept from the case before, as a process compiling a second engine
    keeps them)."""
    import torch._dynamo

    if how != "wrapped":
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stage, precision, accumulate, checkpointed, zero = MIXED[mixed] if mixed else (stage, precision, 1, False, {})
    model, lines = _model(checkpointed), []
    given = torch.compile(model, backend=BACKEND) if how == "wrapped" else model
    config = _config(stage, precision, accumulate, **zero)
    engine, *_ = fzero.initialize(model=given, config=config, printer=lines.append)
    out: dict[str, Any] = {}
    if how == "wrapped":
        out["unwrapped"] = engine.module is model and engine.is_compiled and "came compiled" in lines[-2]
    if how == "compile":
        engine.compile(backend=BACKEND)
        if not checkpointed:  # (a checkpointed block's forward is a function set on it, compiled as it is)
            twin = copy.deepcopy(engine.module)  # (an EMA copy: its blocks must run their own parameters)
            out["copy_bound"] = all(b.forward.__self__ is b for b in twin.blocks)
    losses, counts = [], []
    for x in [x for x in _batches(rank, short) for _ in range(accumulate)]:
        loss = _lm(engine(x[:, :-1]), x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        counts.append(_counts())
    out.update(losses=losses, counts=counts)
    return out


def core_losses(rank: int, compile: bool) -> list[float]:
    """The functional core at stage 3, `train_step(compile=...)`."""
    import torch._dynamo

    torch._dynamo.reset()
    model, mesh = _model(), fzero.DistMesh()
    tx = fzero.zero3(fzero.adamw(1e-2))

    def loss_fn(params: dict, x: torch.Tensor) -> torch.Tensor:
        return _lm(fzero.call(model, params, x[:, :-1]), x)

    step = fzero.train_step(model, loss_fn, tx, mesh, compile={"backend": BACKEND} if compile else False)
    state, losses = fzero.init(model, tx, mesh), []
    for x in _batches(rank):
        state, metrics = step(state, x)
        losses.append(float(metrics["loss"]))
    return losses


def run(rank: int, world: int, store: str, out_dir: str) -> None:
    init_worker(rank, world, store)
    try:
        results: dict[str, Any] = {}
        for stage, precision, short in ((1, "fp32", False), (3, "bf16", True)):
            for how in ("eager", "compile"):
                results[f"{stage}-{precision}-{how}"] = engine_losses(rank, stage, precision, how, short)
        results["3-bf16-wrapped"] = engine_losses(rank, 3, "bf16", "wrapped")
        for mixed in MIXED:
            for how in ("eager", "compile"):
                results[f"{mixed}-{how}"] = engine_losses(rank, 0, "", how, mixed=mixed)
        results["core"] = {str(c): core_losses(rank, c) for c in (False, True)}
        errors = {}
        engine, *_ = fzero.initialize(model=_model(), config=_config(3, "fp32"), printer=lambda _: None)
        for name, call in {
            "schedule": lambda e: e.compile(schedule=object()),
            "autograd": lambda e: e.compile(compiled_autograd_enabled=True),
            "kwargs": lambda e: e.compile(compile_kwargs={"fulgraph": True}),
        }.items():
            try:
                call(engine)
            except Exception as e:  # (the test reads the message)
                errors[name] = f"{type(e).__name__}: {e}"
        results["errors"] = errors
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()


if __name__ == "__main__":
    sys.exit("run through tests/test_compile.py")

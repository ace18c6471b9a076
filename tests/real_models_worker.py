"""The 2-process gloo half of tests/test_real_models.py: the functional core on a DistMesh against the same run
on a SimMesh (dropout on), and the DeepSpeed-style engine on Hugging Face models with everyday habits."""

from __future__ import annotations

import hashlib
import os

import torch

import fzero
from fzero.host import process_group
from tests.bounds import adam_check
from tests.real_models import frozen_embeddings, gpt2, lm_loss, lora, reference, token_batches
from tests.spawn import init_worker, report
from tests.support import differing

WORLD = 2
STEPS = 3


def _core_case(mesh, make, preset: str, checkpointing: bool) -> list[str]:
    """Names of the tensors where the DistMesh run differs from the SimMesh run (computed here too)."""
    out = {}
    for m in (mesh, fzero.SimMesh(WORLD)):
        model = make()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tx = getattr(fzero, preset)(fzero.adamw(1e-2))
        state = fzero.init(model, tx, m, seed=7)
        step = fzero.train_step(model, lm_loss(model), tx, m)
        for batch in token_batches(WORLD, STEPS, seed=11):
            state, _ = step(state, batch if m is not mesh else {k: v[mesh.rank] for k, v in batch.items()})
        out[m is mesh] = fzero.state_dict(state, m)
    return differing(out[True], out[False])


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _engine_case(stage: int, precision: str, rank: int | None) -> dict:
    """GPT-2 with a frozen (tied) embedding through `fzero.initialize`, activation checkpointing on, and evaluation
    passes between steps: under `no_grad` in eval mode, under `inference_mode`, and a grad-enabled forward whose
    graph is dropped before the training forward. `rank`: this process's rank, or None for one process training on
    every rank's examples."""
    # off: DeepSpeed 0.19.3+ clips at 1.0 by default
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}  # fmt: skip
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    model = frozen_embeddings()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = fzero.initialize(
        model=model, model_parameters=model.parameters(), config=config, printer=lambda line: None
    )
    batches = token_batches(WORLD, STEPS, seed=5)
    if rank is None:
        config["train_micro_batch_size_per_gpu"] = 2 * WORLD
    seen = []
    for batch in batches:
        x = batch["x"].flatten(0, 1) if rank is None else batch["x"][rank]
        engine.eval()
        with torch.no_grad():
            seen.append(engine(x).logits)
        with torch.inference_mode():
            seen.append(engine(x).logits.clone())
        engine.train()
        engine(x)  # a forward whose graph is never used: several forwards before one backward
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
    params = engine.module_state_dict()
    strict = True
    try:
        frozen_embeddings().load_state_dict(params, strict=True)
    except RuntimeError:
        strict = False
    out = {"params": _digest(params[k] for k in sorted(params)), "eval": _digest(seen), "strict_load": strict}
    if not rank:
        start = frozen_embeddings().state_dict()
        out["vs_reference"] = adam_check(params, reference(frozen_embeddings(), batches), start, 1e-2, STEPS)
    return out


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what the engine reads
    init_worker(rank, world, f"{out_dir}/store")
    try:
        mesh = fzero.DistMesh()
        results: dict = {"core": {}, "engine": {}}
        cases = {
            "gpt2-dropout-zero2": (lambda: gpt2(dropout=0.1), "zero2", False),
            "gpt2-dropout-zero3-checkpointing": (lambda: gpt2(dropout=0.1), "zero3", True),
            "lora-dropout-zero3": (lambda: lora(dropout=0.1), "zero3", False),
        }
        for name, (make, preset, checkpointing) in cases.items():
            results["core"][name] = _core_case(mesh, make, preset, checkpointing)
        for stage in (2, 3):
            for precision in ("fp32", "bf16"):
                results["engine"][f"{stage}-{precision}"] = _engine_case(stage, precision, rank)
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()

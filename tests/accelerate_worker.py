"""The ranks of tests/test_integration_accelerate.py: one Accelerate training loop, on fzero or on Accelerate's DDP.

A tiny GPT-2 (tied embeddings, no dropout), 24 fixed sequences, 2 sequences per rank and micro-batch, accumulation 2,
clipping 1.0, a decaying learning rate: the ordinary Accelerate loop, unchanged between the runs. Each run reports
its losses and (on rank 0) writes its final full parameters to `out/NAME.safetensors`.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from safetensors.torch import save_file

from fzero.host import process_group
from tests.real_models import T, V, gpt2
from tests.spawn import init_worker, report

MICRO, GAS, STEPS, LR = 2, 2, 6, 1e-2


def data() -> torch.Tensor:
    """Enough sequences for STEPS optimizer steps on 2 ranks."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (STEPS * GAS * MICRO * 2, T), generator=g)


def config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }


def _accelerator(kind: str, **kwargs: Any) -> Any:
    from accelerate import Accelerator as Plain
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if kind == "ddp":
        return Plain(cpu=True, gradient_accumulation_steps=GAS)
    from fzero.integrations.accelerate import Accelerator

    return Accelerator(fzero_config=config(int(kind[-1])), gradient_accumulation_steps=GAS, **kwargs)


def train(kind: str, out: str, stop: int = STEPS, save_at: int | None = None, resume: bool = False) -> list[float]:
    """The loop, to optimizer step `stop`; `save_at`: save_state there; `resume`: load_state first (step 3)."""
    acc = _accelerator(kind)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    loader = torch.utils.data.DataLoader(data(), batch_size=MICRO)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    start = 0
    if resume:
        acc.load_state(os.path.join(out, f"state-{kind}"))
        start = 3
        loader = acc.skip_first_batches(loader, start * GAS)
    losses, step = [], start
    for ids in loader:
        with acc.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.item())
        if acc.sync_gradients:
            step += 1
            if step == save_at:
                acc.save_state(os.path.join(out, f"state-{kind}"))
            if step == stop:
                break
    if kind != "ddp":
        assert acc.gather_for_metrics(torch.tensor([acc.process_index])).tolist() == [0, 1]
        assert type(acc.unwrap_model(model)).__name__ == "GPT2LMHeadModel"
    full = acc.get_state_dict(model)
    if acc.is_main_process:
        save_file({k: v.clone() for k, v in full.items()}, os.path.join(out, f"{kind}-{stop}-{resume}.safetensors"))
    return losses


def shell(stage: int, out: str, rank: int) -> list[float]:
    """The same training through `fzero.deepspeed.initialize` directly (each rank's micro-batches as Accelerate's
    loader deals them: batch `2 i + rank` of the unsharded loader)."""
    import fzero.deepspeed as deepspeed

    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    world = 2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    cfg = config(stage) | {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    batches = data().split(MICRO)
    losses = []
    for i in range(STEPS * GAS):
        ids = batches[world * i + rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            for _ in range(world):  # Accelerate's scheduler steps once per process at each optimizer step
                sched.step()
    full = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module_state_dict()
    if rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, os.path.join(out, f"shell{stage}.safetensors"))
    return losses


def refused_clip() -> str:
    """`clip_grad_norm_` with a max_norm the config does not clip at: the refusal's message."""
    acc = _accelerator("fzero2", cpu=True)  # (Accelerate's own cpu=True would leave DeepSpeed's path)
    model = gpt2()
    loader = torch.utils.data.DataLoader(data(), batch_size=MICRO)
    model, _, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    assert type(model).__name__ == "Engine", type(model)
    for ids in data().split(MICRO)[:GAS]:
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
    try:
        acc.clip_grad_norm_(model.parameters(), 0.5)
    except ValueError as err:
        return str(err)
    return "not refused"


def worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    init_worker(rank, world, store)
    results: dict[str, Any] = {}
    results["ddp"] = train("ddp", out)
    for stage in (2, 3):
        kind = f"fzero{stage}"
        results[kind] = train(kind, out, save_at=3)
        results[f"{kind}-resumed"] = train(kind, out, resume=True)
        results[f"shell{stage}"] = shell(stage, out, rank)
    results["refused_clip"] = refused_clip()
    gc.collect()  # every fzero Accelerator gone: Accelerate's process-wide DeepSpeed switch is back as it was
    results["env_after"] = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    report(rank, out, results)
    process_group.shutdown()

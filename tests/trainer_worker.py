"""The ranks of tests/test_integration_transformers.py: Hugging Face `Trainer` runs, on fzero or on plain DDP.

A tiny GPT-2 (tests.real_models), 48 fixed sequences in order, 2 per rank and micro-batch, accumulation 2, clipping
1.0, `Trainer`'s own AdamW and linear schedule with warmup, 6 optimizer steps. Each run records its logged losses,
gradient norms and learning rates, and rank 0 writes its final full parameters to `out/NAME.safetensors`.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from safetensors.torch import save_file

from fzero.host import process_group
from tests.real_models import T, V, gpt2, lora
from tests.spawn import init_worker, report

STEPS, LR = 6, 1e-2


def config(stage: int) -> dict[str, Any]:
    """A Hugging Face-style DeepSpeed config: every batch and clipping value "auto" (filled from the arguments)."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }


def arguments(out: str, stage: int | None, **extra: Any) -> Any:
    from transformers import TrainingArguments

    common = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
        max_steps=STEPS, learning_rate=LR, warmup_steps=2, weight_decay=0.01, logging_steps=1, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, train_sampling_strategy="sequential", save_strategy="no",
    )  # fmt: skip
    common.update(extra)
    if stage is None:
        return TrainingArguments(**common)
    from fzero.integrations.transformers import FzeroTrainingArguments

    return FzeroTrainingArguments(**common, fzero_config=config(stage))


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, V, (STEPS * 8, T), generator=g)]


def logged(trainer: Any) -> dict[str, list[float]]:
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [float(h[k]) for h in rows] for k in ("loss", "grad_norm", "learning_rate")}


def run(name: str, out: str, stage: int | None, model: Any = None, resume: str | None = None, **extra: Any) -> Any:
    from transformers import Trainer

    from fzero.integrations.transformers import FzeroTrainer

    args = arguments(os.path.join(out, name), stage, **extra)
    model = gpt2() if model is None else model
    kind = Trainer if stage is None else FzeroTrainer
    trainer = kind(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    full = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if stage is not None:  # as under DeepSpeed, model_wrapped is the engine: module_state_dict() consolidates
        engine_full = trainer.model_wrapped.module_state_dict()
        if trainer.accelerator.is_main_process:
            assert engine_full.keys() == full.keys() and all(torch.equal(engine_full[k], full[k]) for k in full)
    if trainer.accelerator.is_main_process:
        save_file({k: v.detach().clone() for k, v in full.items()}, os.path.join(out, f"{name}.safetensors"))
    return trainer


def shell(stage: int, out: str, rank: int, world: int = 2) -> list[float]:
    """The Trainer's arithmetic through `fzero.deepspeed.initialize` directly: its param groups (no decay on biases
    and LayerNorms), its linear schedule with warmup, stepped by the engine, and its loss under DeepSpeed: summed over
    the tokens, divided by the window's label count over every rank, times the world size, backward with
    `scale_wrt_gas=False`; each rank's micro-batches as its sequential loader deals them (batch `2 i + rank`)."""
    from transformers import Trainer, get_linear_schedule_with_warmup

    import fzero.deepspeed as deepspeed

    model = gpt2()
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    cfg = config(stage) | {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                           "train_batch_size": 2 * 2 * world, "gradient_clipping": 1.0}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    batches = torch.stack([d["input_ids"] for d in dataset()]).split(2)
    losses = []
    for step in range(STEPS):
        window = [batches[world * (2 * step + m) + r] for m in range(2) for r in range(world)]
        items = torch.tensor(sum(ids.numel() for ids in window))  # (transformers 5.24 counts GPT-2's unshifted labels)
        for m in range(2):
            ids = batches[world * (2 * step + m) + rank]
            loss = engine(input_ids=ids, labels=ids, num_items_in_batch=items).loss * world
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            losses.append(loss.item())
    full = engine.module_state_dict()
    if rank == 0:
        save_file({k: v.detach().clone() for k, v in full.items()}, os.path.join(out, f"shell{stage}.safetensors"))
    return losses


def worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    init_worker(rank, world, store)
    held_out = dataset()[:8]
    trainer = run("ddp", out, None)
    results: dict[str, Any] = {"ddp": logged(trainer), "ddp-eval": trainer.evaluate(held_out)["eval_loss"]}
    results["fzero2"] = logged(run("fzero2", out, 2))
    results["shell2"] = shell(2, out, rank)
    trainer = run("fzero3", out, 3, save_strategy="steps", save_steps=3)
    results["fzero3"] = logged(trainer)
    results["fzero3-eval"] = trainer.evaluate(held_out)["eval_loss"]
    results["engine"] = type(trainer.model_wrapped).__module__
    trainer.save_model(os.path.join(out, "saved"))
    checkpoint = os.path.join(out, "fzero3", "checkpoint-3")
    results["resumed"] = logged(run("resumed", out, 3, resume=checkpoint))
    # from_pretrained after the arguments exist: sharded as it loads (zero.Init), never whole on a rank
    from transformers import GPT2LMHeadModel

    args = arguments(os.path.join(out, "pretrained"), 3)
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "saved"))
    results["sharded"] = all(p.numel() == 0 and hasattr(p, "ds_id") for p in loaded.parameters())
    results["from-sharded"] = logged(run("from-sharded", out, 3, model=loaded, max_steps=2))
    del args, loaded
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # (its DeepSpeed plugin keeps a config alive)
    gc.collect()  # no Hugging Face DeepSpeed config alive: from_pretrained builds the model whole
    whole = GPT2LMHeadModel.from_pretrained(os.path.join(out, "saved"))
    results["whole"] = all(p.numel() > 0 for p in whole.parameters())
    results["from-whole"] = logged(run("from-whole", out, 3, model=whole, max_steps=2))
    # LoRA at stage 3: the adapter alone is saved, and reloads
    trainer = run("lora", out, 3, model=lora(), save_strategy="steps", save_steps=3)  # PEFT: frozen left out
    trainer.save_model(os.path.join(out, "adapter"))
    results["lora"] = logged(trainer)
    report(rank, out, results)
    process_group.shutdown()

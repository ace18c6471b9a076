"""Workers of tests/test_deepspeed_engine.py: the same script, DeepSpeed 0.19.8 (CPU accelerator, gloo) and fzero
behind `import fzero.deepspeed as deepspeed`, runs the engine methods scripts call (`no_sync`,
`set_gradient_accumulation_boundary`, `save_16bit_model`, `save_checkpoint(exclude_frozen_parameters=True)` and its
load, the accessors) on 1 or 2 processes, and writes what each returned.

Every run sees the same global batch per step (`tests.deepspeed_worker.GLOBAL` samples split over the ranks, then
into micro-batches), so the losses are the same quantity at every world size.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from fzero.engine import Engine
from fzero.host import process_group
from tests.deepspeed_worker import GLOBAL, Net, batch
from tests.spawn import init_deepspeed_worker

STEPS = 3
# name: (stage, gradient_accumulation_steps, micro-batches per step and rank, what the script does, precision)
CASES: dict[str, tuple[int, int, int, str, str]] = {
    "nosync-z0": (0, 1, 3, "nosync", "fp32"),
    "nosync-z1": (1, 1, 3, "nosync", "fp32"),
    "boundary-z1": (1, 2, 2, "boundary", "fp32"),
    "boundary-z2": (2, 2, 2, "boundary", "fp32"),
    "boundary-z3": (3, 2, 2, "boundary", "fp32"),
    "boundary-z2-bf16": (2, 2, 2, "boundary", "bf16"),
    "frozen-z2": (2, 1, 1, "frozen", "fp32"),
    "frozen-z3": (3, 1, 1, "frozen", "fp32"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def config(trainer: str, name: str, world: int) -> dict[str, Any]:
    stage, gas, micro, _, precision = CASES[name]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL // world // micro,
        "gradient_accumulation_steps": gas,
        # (DeepSpeed's memory-efficient linear would replace torch.nn.functional.linear for the rest of the process,
        # fzero's runs included)
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": name != "frozen-z3",
            "memory_efficient_linear": False,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if trainer == "fzero":  # DeepSpeed's arithmetic: its fp32 master starts from the bf16 weights, and it
            # reduces and accumulates bf16 gradients in bf16 (fzero's defaults: the exact weights, in fp32)
            cfg["fzero_precision"] = {"round_initial_master": True}
            cfg["communication_data_type"] = "bf16"
            cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    return cfg


def global_loss(loss: torch.Tensor, world: int) -> str:
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float((total / world).item()).hex()


def raises(fn: Any) -> str | None:
    """The message of what `fn()` raised, None if it returned."""
    try:
        fn()
    except Exception as e:  # (DeepSpeed asserts where fzero raises RuntimeError: the message is compared)
        return f"{type(e).__name__}: {e}"
    return None


def accessors(engine: Any, scheduler: Any, loader: Any) -> dict[str, Any]:
    info = engine.get_batch_info()  # (DeepSpeed 0.19.8 returns the bound methods)
    return {
        "loss_scale": engine.loss_scale(),
        "batch_info": [x() if callable(x) else x for x in info],
        "stage": engine.zero_optimization_stage(),
        "partition_gradients": engine.zero_optimization_partition_gradients(),
        "partition_weights": engine.zero_optimization_partition_weights(),
        "gather_16bit": engine.zero_gather_16bit_weights_on_model_save(),
        "gas": engine.gradient_accumulation_steps(),
        # (DeepSpeed's stage 0 in fp32 hands out the torch optimizer itself, which has neither)
        "cur_scale": getattr(engine.optimizer, "cur_scale", None),
        "optimizer_loss_scale": getattr(engine.optimizer, "loss_scale", None),
        "lr_scheduler_is_returned": engine.lr_scheduler is scheduler,
        "training_dataloader_is_returned": engine.training_dataloader is loader and loader is not None,
        "dp_world_size": engine.dp_world_size,
    }


def train_steps(engine: Any, name: str, steps: range, rank: int, world: int) -> dict[str, Any]:
    """The script of case `name` for `steps`: losses (global, float hex) and the boundaries it saw."""
    _, _, micro, mode, precision = CASES[name]
    losses, boundaries, errors, collectives = [], [], {}, []
    for step in steps:
        x, y = batch(step, rank, world)
        xs, ys = x.to(DTYPES[precision]).chunk(micro), y.chunk(micro)
        for i in range(micro):
            last = i == micro - 1
            if mode == "boundary":  # what Accelerate does: the boundary before every backward, one step() per window
                engine.set_gradient_accumulation_boundary(last)
                boundaries.append(engine.is_gradient_accumulation_boundary())
            if mode == "nosync" and not last:  # every micro-batch but the last adds its gradient locally
                # (fzero's mesh counts the collectives issued in it: none)
                record = engine.mesh.record() if isinstance(engine, Engine) else contextlib.nullcontext()
                with engine.no_sync(), record as ledger:
                    loss = (engine(xs[i]).float() - ys[i]).square().mean()
                    engine.backward(loss)
                    if step == steps[0] and i == 0:
                        errors["step_in_no_sync"] = raises(engine.step)
                if ledger is not None:
                    collectives.extend(ledger.entries)
            else:
                loss = (engine(xs[i]).float() - ys[i]).square().mean()
                engine.backward(loss)
            if mode != "nosync" and mode != "boundary":
                engine.step()
            losses.append(global_loss(loss, world))
        if mode != "frozen":
            engine.step()
    counters = [engine.global_steps, engine.global_samples, engine.micro_steps]
    return {"losses": losses, "boundaries": boundaries, "counters": counters, "errors": errors,
            "collectives_in_no_sync": collectives}  # fmt: skip


def run_case(deepspeed: Any, trainer: str, name: str, rank: int, world: int, out: str) -> dict[str, Any]:
    stage, _, _, mode, _ = CASES[name]
    kwargs = {"printer": lambda *_: None} if trainer == "fzero" else {}
    cfg = config(trainer, name, world)
    torch.manual_seed(0)
    model = Net()
    data = torch.utils.data.TensorDataset(torch.randn(8, 6)) if name == "nosync-z0" else None
    engine, _, loader, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                                        training_data=data, **kwargs)  # fmt: skip
    result: dict[str, Any] = {"accessors": accessors(engine, scheduler, loader)}
    if stage >= 2:
        result["no_sync"] = raises(lambda: engine.no_sync().__enter__())
    result.update(train_steps(engine, name, range(1, STEPS + 1), rank, world))
    if mode == "frozen":
        ckpt = os.path.join(out, name, "ckpt")
        engine.save_checkpoint(ckpt, exclude_frozen_parameters=True)
        more = train_steps(engine, name, range(STEPS + 1, STEPS + 2), rank, world)  # moves the state on
        result["saved_files"] = sorted(os.listdir(ckpt))
        engine.destroy()
        torch.manual_seed(7)  # other initial values: the trainable ones come from the checkpoint, frozen ones not
        model = Net()
        with torch.no_grad():
            model.ln.bias.fill_(0.25)  # (a LayerNorm's bias starts at zero whatever the seed)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kwargs)
        result["strict_load"] = raises(lambda: engine.load_checkpoint(ckpt))
        path, client = engine.load_checkpoint(ckpt, load_module_strict=False)
        result["loaded"] = [os.path.relpath(path, ckpt).split(os.sep)[0], client]
        resumed = train_steps(engine, name, range(STEPS + 1, STEPS + 3), rank, world)
        result["resumed_losses"], result["moved_losses"] = resumed["losses"], more["losses"]
        result["resumed_counters"] = resumed["counters"]
        if trainer == "deepspeed" and rank == 0:  # DeepSpeed's own consolidation of its checkpoint, for the test
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            from safetensors.torch import save_file

            fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
            save_file({k: v.clone().contiguous() for k, v in fp32.items()}, os.path.join(out, name, "fp32.safetensors"))
    saved = engine.save_16bit_model(os.path.join(out, name, "model16"))
    result["save_16bit_model"] = saved
    result["destroy"] = engine.destroy()
    return result


def run(rank: int, world: int, out_dir: str) -> None:
    """Every case with DeepSpeed, then with fzero; `out_dir/{trainer}-{world}.json` and the files they wrote."""
    deepspeed, shell = init_deepspeed_worker(rank, world, os.path.join(out_dir, f"store-{world}"))
    for trainer, module in (("deepspeed", deepspeed), ("fzero", shell)):
        out = os.path.join(out_dir, f"{trainer}-{world}")
        results = {name: run_case(module, trainer, name, rank, world, out) for name in CASES}
        if rank == 0:
            with open(f"{out}.json", "w") as f:
                json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

"""Worker of tests/test_integration_lightning.py: real Lightning Trainers in 2 already-spawned gloo processes.

Each process joins the gloo group (`tests.spawn.init_worker`) and sets the launcher's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT): Lightning's `LightningEnvironment` then sees processes created
externally (it launches none) and its DDP set-up finds the group already initialised (it creates none). Every
Trainer of the test runs in these two processes, one after the other:

- Lightning's own `strategy="ddp"` (the reference), recording each micro-batch's loss and the L1 norm of its
  gradient at the reference's parameters (for the loss bound);
- per ZeRO stage (2, 3): `FzeroStrategy`, 6 optimizer steps with `ModelCheckpoint` saving after each epoch (3
  steps); a new Trainer resuming from the step-3 checkpoint to step 6; `trainer.save_checkpoint` of the result,
  consolidated with `fzero.consolidate`;
- the config's optimizer and WarmupLR (`configure_optimizers` returning None): 6 steps and the resume;
- a contradicting `accumulate_grad_batches`, and `precision` (the ValueErrors' messages);
- first, with no strategy alive yet: the alias while a strategy lives, and the client_state's JSON encoding.

Rank 0 writes the numbers to results.json and the parameters to safetensors files (`tests.spawn.report`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from typing import Any

import lightning
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save_file
from torch.func import functional_call, grad
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import fzero
from fzero.host import process_group
from fzero.integrations import lightning as fl
from fzero.integrations.lightning import FzeroStrategy
from tests.spawn import init_worker, report

SEQUENCES, LENGTH, VOCAB, MICRO, ACCUMULATE, STEPS, LR, CLIP = 24, 16, 64, 2, 2, 6, 1e-2, 1.0
STAGES = (2, 3)


def data() -> DataLoader[Any]:
    """24 fixed sequences; Lightning's distributed sampler (it shuffles training data, seed 0, whatever the loader
    says) gives each rank 12 per epoch: 6 micro-batches of 2 per rank and epoch, 3 optimizer steps per epoch."""
    tokens = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(1234))
    return DataLoader(TensorDataset(tokens), batch_size=MICRO, shuffle=False)


def config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        **extra,
    }


class TinyGPT(lightning.LightningModule):
    """A 2-layer GPT-2 (no dropout), AdamW and a decaying LambdaLR; records every micro-batch's loss, and with
    `measure` the parameters after every optimizer step (`lightning_module_state_dict`), with `grads` the L1 norm
    of each micro-batch's gradient at the parameters it ran with (computed apart from the training's backward)."""

    def __init__(self, measure: bool = False, grads: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(cfg)
        self.measure, self.grads = measure, grads
        self.losses: list[float] = []
        self.grad_l1: list[float] = []
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # with `measure`: the parameters after each step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(loss.item())
        if self.grads:  # (torch.func: its own leaves, so DDP's gradient hooks never see this backward)
            params = {k: v.detach() for k, v in self.model.named_parameters()}
            g = grad(lambda p: functional_call(self.model, p, (), {"input_ids": x, "labels": x}).loss)(params)
            self.grad_l1.append(sum(t.abs().sum().item() for t in g.values()))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if self.measure and step not in self.snapshots:  # (every rank calls it: at stage 3 it all-gathers)
            self.snapshots[step] = full(self.trainer.strategy.lightning_module_state_dict())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(strategy: Any, accumulate: int = ACCUMULATE, **kwargs: Any) -> lightning.Trainer:
    return lightning.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False), **kwargs,
    )  # fmt: skip


def gathered(values: list[float]) -> list[list[float]]:
    """Every rank's list, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def steps(module: TinyGPT) -> dict[str, torch.Tensor]:
    """The parameters after each optimizer step, as `"{step}/{name}"`."""
    return {f"{step}/{name}": t for step, state in module.snapshots.items() for name, t in state.items()}


CONFIG_OPTIMIZER = config(
    2,
    optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": True}},
    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 4}},
)


class ConfigOptimizer(TinyGPT):
    def configure_optimizers(self) -> Any:
        return None  # (the config's)


def fit_and_resume(
    name: str, cfg: dict[str, Any], make: type[TinyGPT], out: str, tensors: dict[str, dict[str, torch.Tensor]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor], lightning.Trainer]:
    """6 steps with a `ModelCheckpoint` every 3, then a new Trainer and module (other values) resuming from
    step 3 to 6. Returns the numbers, the first run's `lightning_module_state_dict()` and the second Trainer."""
    ckpts = os.path.join(out, f"ckpt-{name}")
    module = make(measure=True)
    t = trainer(
        FzeroStrategy(config=cfg), enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_train_steps=3)],
    )  # fmt: skip
    t.fit(module, data())
    r: dict[str, Any] = {"losses": gathered(module.losses), "global_step": t.global_step}
    r["checkpoints"] = sorted(os.listdir(ckpts))
    state = full(t.strategy.lightning_module_state_dict())
    tensors[name], tensors[f"{name}-steps"] = state, steps(module)

    resumed = make()
    with torch.no_grad():  # (its own values must not matter)
        for p in resumed.parameters():
            p.add_(1.0)
    t2 = trainer(FzeroStrategy(config=cfg))
    t2.fit(resumed, data(), ckpt_path=os.path.join(ckpts, "epoch=0-step=3.ckpt"))
    r["resumed_losses"] = gathered(resumed.losses)
    r["resumed_global_step"] = t2.global_step
    tensors[f"{name}-resumed"] = full(t2.strategy.lightning_module_state_dict())
    return r, state, t2


def alias_check() -> dict[str, Any]:
    """Before any other strategy exists: while one lives, `import deepspeed` is fzero's shell, even where
    Lightning's check that the deepspeed distribution is installed reads False (its cached answers are restored);
    once it is collected, the alias is gone."""
    from lightning.pytorch.strategies import deepspeed as pl_deepspeed

    caches = (pl_deepspeed._DEEPSPEED_AVAILABLE, pl_deepspeed._DEEPSPEED_GREATER_EQUAL_0_16)
    saved = [dict(c.__dict__) for c in caches]
    try:
        for c in caches:
            c.available = False
        strategy = FzeroStrategy(config=config(2))
        import deepspeed

        during = deepspeed.__name__
        restored = [bool(c) for c in caches]
    finally:
        for c, attrs in zip(caches, saved, strict=True):
            c.__dict__.clear()
            c.__dict__.update(attrs)
    del strategy, deepspeed
    gc.collect()
    after = getattr(sys.modules.get("deepspeed"), "__name__", None)
    return {"during": during, "caches_after_init": restored, "after": after}


def client_state_check() -> dict[str, Any]:
    """Lightning's checkpoint entries through the JSON encoding of `FzeroStrategy`'s client_state: tensors
    (ModelCheckpoint's scores, `inf` before any) and non-finite floats come back equal, dtypes and shapes too."""
    value = {
        "kth_value": torch.tensor(float("inf")),
        "scores": torch.tensor([[1.5, -2.0], [float("nan"), 3.0]]),
        "count": torch.tensor([3, 4], dtype=torch.int64),
        "flag": torch.tensor(True),
        "best": float("-inf"),
        "pair": (1, "a"),
    }
    back = fl._from_json(json.loads(json.dumps(fl._to_json(value, "checkpoint"), allow_nan=False)))
    same = {
        k: bool(torch.equal(back[k].nan_to_num(), v.nan_to_num()) and torch.equal(back[k].isnan(), v.isnan()))
        and back[k].dtype == v.dtype
        for k, v in value.items()
        if isinstance(v, torch.Tensor)
    }
    try:
        fl._to_json({"z": torch.zeros(1, dtype=torch.complex64)}, "checkpoint")
        refused = None
    except TypeError as e:
        refused = str(e)
    return {"same": same, "best": repr(back["best"]), "pair": back["pair"], "refused": refused}


def shell(stage: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The same training through `fzero.deepspeed.initialize` directly: TinyGPT's model, optimizer and schedule
    (stepped by the engine, once per update, as Lightning's `interval: "step"`), Lightning's loss (divided by the
    accumulation, then `engine.backward(scale_wrt_gas=False)`), each rank's micro-batches as Lightning's
    distributed sampler deals them: shuffled, seed 0, a new order each epoch). Returns the final full parameters."""
    import fzero.deepspeed as deepspeed

    module = TinyGPT()
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step))
    cfg = config(stage) | {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATE,
                           "gradient_clipping": CLIP}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=module.model, optimizer=opt, lr_scheduler=sched, config=cfg)
    (tokens,) = data().dataset.tensors  # type: ignore[attr-defined]
    sampler = DistributedSampler(range(SEQUENCES), num_replicas=world, rank=rank, shuffle=True, seed=0)
    micro, epoch = [], 0
    while len(micro) < STEPS * ACCUMULATE:  # (Lightning sets the epoch on its sampler)
        sampler.set_epoch(epoch)
        micro += list(torch.tensor(list(sampler)).split(MICRO))
        epoch += 1
    for index in micro[: STEPS * ACCUMULATE]:
        x = tokens[index]
        loss = engine(input_ids=x, labels=x).loss / ACCUMULATE
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
    return {f"model.{k}": v for k, v in full(engine.module_state_dict()).items()}


def run(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    init_worker(rank, world, store)
    warnings.filterwarnings("ignore")  # (Lightning's advice on workers, logging and CPU training)
    results: dict[str, Any] = {"setup": {"steps": STEPS, "accumulate": ACCUMULATE, "lr": LR, "stages": list(STAGES)}}
    results["alias"] = alias_check()
    results["client_state"] = client_state_check()
    tensors: dict[str, dict[str, torch.Tensor]] = {}

    # the reference: Lightning's own DDP
    module = TinyGPT(measure=True, grads=True)
    tensors["start"] = full(module.state_dict())
    trainer("ddp").fit(module, data())
    results["ddp"] = {"losses": gathered(module.losses), "grad_l1": gathered(module.grad_l1)}
    tensors["ddp"] = full(module.state_dict())
    tensors["ddp-steps"] = steps(module)

    for stage in STAGES:
        r, state, t2 = fit_and_resume(f"z{stage}", config(stage), TinyGPT, out, tensors)
        r["module_state_dict_keys"] = sorted(TinyGPT().state_dict())
        r["state_dict_shapes"] = {k: list(v.shape) for k, v in state.items()}
        flat = torch.cat([v.reshape(-1).double() for v in state.values()])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        r["same_on_every_rank"] = all(torch.equal(every[0], other) for other in every)
        # trainer.save_checkpoint: a directory of fzero's format; consolidated, the same parameters
        final = os.path.join(out, f"final-z{stage}.ckpt")
        t2.save_checkpoint(final)
        tensors[f"z{stage}-consolidated"] = full(fzero.consolidate(os.path.join(final, "checkpoint")))
        results[f"z{stage}"] = r
    tensors["z2-shell"] = shell(2, rank, world)
    # the optimizer and a WarmupLR from the config's blocks (configure_optimizers returns None): the engine steps
    # and restores the schedule, Lightning's calls on it do nothing
    results["config-optimizer"] = fit_and_resume("config-optimizer", CONFIG_OPTIMIZER, ConfigOptimizer, out, tensors)[0]

    # a contradiction: the Trainer's accumulation against the config's
    bad = trainer(FzeroStrategy(config=config(2, gradient_accumulation_steps=2)), accumulate=4)
    try:
        bad.fit(TinyGPT(), data())
        results["contradiction"] = None
    except ValueError as e:
        results["contradiction"] = str(e)
    # and the Trainer's precision against the config's
    bad = trainer(FzeroStrategy(config=config(2, bf16={"enabled": True})), precision="16-mixed")
    try:
        bad.fit(TinyGPT(), data())
        results["precision_contradiction"] = None
    except ValueError as e:
        results["precision_contradiction"] = str(e)

    if rank == 0:
        for name, state in tensors.items():
            save_file(state, os.path.join(out, f"{name}.safetensors"))
    report(rank, out, results)
    process_group.shutdown()

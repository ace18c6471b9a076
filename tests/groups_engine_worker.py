"""The 2-process gloo half of tests/test_engine_groups.py: the Hugging Face Trainer's parameter grouping through the
DeepSpeed-style engine on a tiny GPT-2, at stages 2 and 3, against plain `torch.optim.AdamW` with the same groups."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero.host import process_group
from tests.bounds import adam_check
from tests.real_models import gpt2, token_batches
from tests.spawn import init_worker, report

WORLD = 2
STEPS = 3
# transformers 5's Trainer.get_decay_parameter_names: no LayerNorm modules, no biases, no norms by name
FORBIDDEN = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
LAMBDAS = [lambda n: 0.8**n, lambda n: 1.0 / (n + 1)]


def decay_names(model: nn.Module) -> list[str]:
    from transformers.trainer_pt_utils import get_parameter_names

    return get_parameter_names(model, [nn.LayerNorm], FORBIDDEN)


def trainer_groups(model: nn.Module, weight_decay: float, lrs: tuple[float, float] | None = None) -> list[dict]:
    """The two groups `Trainer.create_optimizer` builds (transformers 5), optionally with an lr each."""
    decay = set(decay_names(model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
         "weight_decay": 0.0},
    ]  # fmt: skip
    if lrs is not None:
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
    return groups


def _digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(params[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def reference(case: str, batches) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Plain torch on the full batch (every rank's examples at once): AdamW with the Trainer's groups."""
    model = gpt2()
    if case == "config":
        opt = torch.optim.AdamW(trainer_groups(model, 0.5), lr=1e-2, weight_decay=0.0, foreach=False)
        sched = None
    else:
        opt = torch.optim.AdamW(trainer_groups(model, 0.5, (1e-2, 3e-3)), lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
    lrs = []
    for batch in batches:
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        x = batch["x"].flatten(0, 1)
        model(x, labels=x).loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs


def engine(case: str, stage: int, rank: int, batches) -> dict:
    model = gpt2()
    # off: DeepSpeed 0.19.3+ clips at 1.0 by default
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    if case == "config":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
        engine, opt, _, _ = fzero.initialize(model=model, model_parameters=trainer_groups(model, 0.5), config=config)
    else:
        client = torch.optim.AdamW(trainer_groups(model, 0.5, (1e-2, 3e-3)), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(client, LAMBDAS)
        engine, opt, _, _ = fzero.initialize(model=model, optimizer=client, lr_scheduler=sched, config=config)
    lrs = []
    for batch in batches:
        lrs.append(engine.get_lr())
        x = batch["x"][rank]
        engine.backward(engine(x, labels=x).loss)
        engine.step()
    params = engine.module_state_dict()
    digest = _digest(params)
    digests = [None] * WORLD
    dist.all_gather_object(digests, digest)
    return {
        "params": digest,
        "same_on_ranks": len(set(digests)) == 1,
        "lrs": lrs,
        "view_groups": [{k: v for k, v in g.items() if k in ("lr", "weight_decay")} for g in opt.param_groups],
        "_params": params,
    }


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # what the engine reads
    init_worker(rank, world, f"{out_dir}/store")
    try:
        from transformers.trainer_pt_utils import get_parameter_names

        model = gpt2()
        classic = [n for n in get_parameter_names(model, [nn.LayerNorm]) if "bias" not in n]
        results: dict = {"decay_names_agree": sorted(classic) == sorted(decay_names(model))}
        batches = token_batches(WORLD, STEPS, seed=3)
        for case in ("config", "client"):
            want, want_lrs = reference(case, batches) if rank == 0 else (None, None)
            for stage in (2, 3):
                r = engine(case, stage, rank, batches)
                params = r.pop("_params")
                if rank == 0:
                    r["vs_reference"] = adam_check(params, want, gpt2().state_dict(), 1e-2, STEPS)  # lr: the largest
                    r["reference_lrs"] = want_lrs
                results[f"{case}-{stage}"] = r
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()

"""Engines with each optimizer's DeepSpeed config on a tiny Hugging Face GPT-2, shared by
`tests/test_engine_optimizers.py` and its 2-process gloo worker (`run`).

Every case trains at gradient_accumulation_steps 2, fp32, with gradient clipping and a WarmupLR schedule (so the
applied-update count drives the learning rate as well as the optimizer's own step-dependent terms), and, where it
says so, over two param groups (`model_parameters` dicts: no weight decay on biases and LayerNorm weights).
"""

from __future__ import annotations

import json
import os
import warnings

import optree
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

import fzero
from fzero.checkpoint.tree import FULL, REPLICATED, SHARD, flatten_state
from fzero.host import process_group
from fzero.layout import flatten, unflatten, unshard
from tests.real_models import gpt2, token_batches
from tests.spawn import init_worker

GAS, MICRO = 2, 2  # gradient accumulation steps; sequences per rank and micro-step
SAVE_AT, STEPS = 2, 4  # optimizer steps before the save, and in all (an uninterrupted run)
WORLD = 2

_LAMB = {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.1, "max_coeff": 0.3, "min_coeff": 0.02}}
_LION = {"type": "Lion", "params": {"lr": 2e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}}
_ADAGRAD = {"type": "Adagrad", "params": {"lr": 5e-2, "lr_decay": 0.05, "initial_accumulator_value": 0.1,
                                          "weight_decay": 0.01, "eps": 1e-8}}  # fmt: skip
_ADAM_NO_BC = {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False, "weight_decay": 0.05}}
_AMSGRAD = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "amsgrad": True, "weight_decay": 0.05}}
_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}
_MUON = {"type": "Muon", "params": {"lr": 2e-2, "adam_lr": 1e-3, "weight_decay": 0.05}}

_MOMENTS = ("exp_avg", "exp_avg_sq")

# name: (stage, optimizer block, top-level keys, param groups, the optimizer module the engine must run, its state
# leaves besides the count)
CASES: dict[str, tuple[int, dict, dict, bool, str, tuple[str, ...]]] = {
    "lamb-2": (2, _LAMB, {}, True, "lamb", _MOMENTS),
    "lamb-3": (3, _LAMB, {}, True, "lamb", _MOMENTS),
    "lion-2": (2, _LION, {}, True, "cpu_lion", ("exp_avg",)),
    "lion-3": (3, _LION, {}, True, "cpu_lion", ("exp_avg",)),
    "adagrad-2": (2, _ADAGRAD, {}, True, "cpu_adagrad", ("sum",)),
    "adam-no-bias-correction-2": (2, _ADAM_NO_BC, {}, True, "cpu_adamw", _MOMENTS),  # (DeepSpeed: adam_w_mode)
    "adamw-torch-amsgrad-2": (2, _AMSGRAD, {}, True, "adamw", (*_MOMENTS, "max_exp_avg_sq")),
    "adamw-prescale-2": (2, _ADAMW, {"prescale_gradients": True}, True, "cpu_adamw", _MOMENTS),
    "adamw-predivide-2": (2, _ADAMW, {"gradient_predivide_factor": 3.0}, False, "cpu_adamw", _MOMENTS),
    "muon-2": (2, _MUON, {}, True, "muon", ("exp_avg",)),  # (exp_avg_sq: zero on the Muon tensors)
    "muon-3": (3, _MUON, {}, True, "muon", ("exp_avg",)),
}


def model(seed: int) -> nn.Module:
    """A 2-layer GPT-2 of width 32 with residual and embedding dropout: a resume matches only if the generators
    are restored too."""
    return gpt2(seed, dropout=0.1)


def config(case: str, average: bool = True) -> dict:
    """The case's DeepSpeed config; `average=False` drops its prescale_gradients / gradient_predivide_factor."""
    stage, optimizer, extra, _, _, _ = CASES[case]
    lr = optimizer["params"]["lr"]
    # WarmupLR from lr / 4 (DeepSpeed's schedule holds its minimum for the first two updates) to lr in 3 updates
    warmup = {"warmup_min_lr": lr / 4, "warmup_num_steps": 3, "warmup_type": "linear"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "optimizer": optimizer,
        "scheduler": {"type": "WarmupLR", "params": warmup},
        "gradient_clipping": 1.0,
        **(extra if average else {}),
    }


def parameters(case: str, module: nn.Module) -> list:
    """`model_parameters`: two groups (the Hugging Face Trainer's split: no weight decay on biases and LayerNorm
    weights, the group's own `weight_decay` 0) where the case has them, else `module.parameters()`."""
    if not CASES[case][3]:
        return list(module.parameters())
    plain = [p for n, p in module.named_parameters() if n.endswith(".bias") or ".ln_" in n]
    decayed = [p for n, p in module.named_parameters() if not (n.endswith(".bias") or ".ln_" in n)]
    return [{"params": decayed}, {"params": plain, "weight_decay": 0.0}]


def engine(case: str, seed: int = 0, average: bool = True):
    module = model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on config keys
        eng, *_ = fzero.initialize(
            model=module,
            model_parameters=parameters(case, module),
            config=config(case, average),
            printer=lambda *a: None,
        )
    return eng


def optimizer_name(eng) -> str:
    """Which fzero optimizer the engine's chain runs (`Optimizer.name`): `cpu_lion`, `cpu_adagrad`, `cpu_adamw` (the
    native kernels), `lamb`, `adamw` (torch's arithmetic), ...; for `adam(w)(fused=True)`, the one its master
    weights' device runs."""
    opt = dict(eng.tx.children)["shard_update"].update.__self__.optimizer
    if hasattr(opt.update, "choose"):
        opt = opt.update.choose(eng.state.params)
    return opt.name


def batches(world: int, micro_steps: int) -> list[Tensor]:
    """Token batches `[world, MICRO, T]`: rank r trains on `[r]`."""
    return [b["x"] for b in token_batches(world, micro_steps, per_rank=MICRO, seed=11)]


def train(eng, data: list[Tensor], rank: int, start: int, stop: int) -> list[float]:
    """Micro-steps `start` .. `stop - 1`: the losses `backward` returns."""
    out = []
    for x in data[start:stop]:
        out.append(float(eng.backward(eng(x[rank], labels=x[rank]).loss)))
        eng.step()
    return out


def counters(eng) -> list[int]:
    return [eng.global_steps, eng.global_samples, eng.micro_steps, eng.skipped_steps, eng.applied_updates()]


def _all_gather(x: Tensor, world: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def gathered_state(eng) -> dict[str, Tensor]:
    """Every leaf of the engine's live state, consolidated from memory (not from a checkpoint): param-space leaves
    (parameters, moments, accumulators) all-gathered from the ranks, put in parameter order (`fzero.layout.unshard`)
    and split by parameter as ``"key/name"``; the others (counts, step) as ``"key"``. Every rank calls it (at
    world 1 the gather is the identity)."""
    flat = flatten_state(eng.state)
    layout, world = flat.layout, flat.world
    distributed = dist.is_available() and dist.is_initialized() and not flat.simulated
    out: dict[str, Tensor] = {}
    for e, x in zip(flat.entries, flat.leaves, strict=True):
        x = x.reshape(e.shape)  # (drops a SimMesh world axis of 1)
        if e.kind == REPLICATED:
            out[e.key] = x.clone()
            continue
        assert e.lead == (), f"{e.key}: a leaf with leading dimensions {e.lead}"
        space = e.layout_in(layout)
        if e.kind == SHARD:
            shards = _all_gather(x, world) if distributed else x.reshape(world, -1)
            full = unshard(space, shards)
        else:
            assert e.kind == FULL
            full = x
        for name, value in unflatten(space, full).items():
            out[f"{e.key}/{name}"] = value.clone()
    return out


def inject(eng, values: dict[str, Tensor]) -> object:
    """The engine's state (world 1) with every leaf replaced by `values` (`gathered_state`'s form): the same
    training state put in place in memory, without any checkpoint."""
    flat = flatten_state(eng.state)
    assert flat.world == 1
    leaves = []
    for e, x in zip(flat.entries, flat.leaves, strict=True):
        if e.kind == REPLICATED:
            new = values[e.key]
        else:
            space = e.layout_in(flat.layout)
            new = flatten(space, {leaf.name: values[f"{e.key}/{leaf.name}"] for leaf in space.leaves})
        assert new.numel() == x.numel() and new.dtype == x.dtype, e.key
        leaves.append(new.reshape(x.shape).clone())
    return optree.tree_unflatten(flat.treespec, leaves)


def differing(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """The keys whose tensors are not bitwise equal (or that only one side has)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def run(rank: int, world: int, out_dir: str) -> None:
    """For every case: train SAVE_AT optimizer steps, save, train on to STEPS (the uninterrupted run); a fresh
    engine (another seed, another generator state) loads the checkpoint and trains the same micro-steps. Rank 0
    writes the live state consolidated at the save (`gathered_state`) for the single-process resharding test."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store")
    try:
        results: dict = {}
        data = batches(world, STEPS * GAS)
        k, n = SAVE_AT * GAS, STEPS * GAS
        for case in CASES:
            root = os.path.join(out_dir, case)
            a = engine(case, seed=0)
            torch.manual_seed(100 + rank)  # each rank its own dropout masks
            train(a, data, rank, 0, k)
            a.save_checkpoint(root)
            at_save = gathered_state(a)
            if rank == 0:
                save_file(at_save, os.path.join(out_dir, f"{case}.safetensors"))
            saved_counters = counters(a)
            average_changes = None
            if CASES[case][2]:  # the same run without prescale_gradients / gradient_predivide_factor
                plain = engine(case, seed=0, average=False)
                torch.manual_seed(100 + rank)
                train(plain, data, rank, 0, k)
                average_changes = bool(differing(gathered_state(plain), at_save))
            losses_a = train(a, data, rank, k, n)
            b = engine(case, seed=1)
            torch.manual_seed(999)
            start = differing(gathered_state(b), at_save)
            path, _ = b.load_checkpoint(root)
            losses_b = train(b, data, rank, k, n)
            pa, pb = a.module_state_dict(), b.module_state_dict()
            results[case] = {
                "optimizer": optimizer_name(a),
                "path": path,
                "start_differs": len(start),
                "params_differ": differing(pa, pb),
                "state_differ": differing(gathered_state(a), gathered_state(b)),
                "losses": [losses_a, losses_b],
                "counters": [saved_counters, counters(a), counters(b)],
                "average_changes": average_changes,
            }
        with open(os.path.join(out_dir, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        process_group.shutdown()

"""Worker of tests/test_random_ltd.py: DeepSpeed 0.19.8's random-LTD (CPU accelerator, gloo) and fzero's, side by
side on 2 processes, and what each computed, written as JSON.

DeepSpeed's random-LTD loads a CUDA op (`RandomLTDBuilder`: `token_sort_`, `token_gather`, `token_scatter_`) that
its CPU accelerator cannot build ("This op had not been implemented on CPU backend"). `RefKernel` below stands in for
it: the three kernels' semantics (`csrc/random_ltd/*.cu`), one element at a time, written independently of fzero.
Everything else is DeepSpeed's own code: its config parsing, scheduler, token sampling (`torch.multinomial`), the
autograd functions, the layer wrapper, `convert_to_random_ltd` and the engine's `update_seq` in its forward.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fzero.host import process_group
from tests.spawn import init_deepspeed_worker

V, S, D, LAYERS, MICRO, STEPS = 32, 8, 16, 4, 2, 6
SCHEDULE = {"min_value": 3, "max_value": S, "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 4, "seq_per_step": 1}}  # fmt: skip
# the examples' configs (DeepSpeedExamples training/data_efficiency/*/config/ds_config_*_random_ltd.json)
EXAMPLES = [
    dict(total=12, layers=10, min=128, max=1024, require=400, per=8, batch=4),  # gpt base / medium
    dict(total=12, layers=10, min=32, max=197, require=3910, per=8, batch=32),  # vit cifar
    dict(total=24, layers=22, min=16, max=197, require=1000, per=4, batch=8),
]


class RefKernel:
    """DeepSpeed's random-LTD CUDA kernels, element by element (in place where theirs are)."""

    @staticmethod
    def token_sort_(ids: torch.Tensor, original_tokens: int) -> torch.Tensor:
        for layer in range(ids.shape[0]):
            for b in range(ids.shape[1]):
                ids[layer, b] = torch.tensor(sorted(ids[layer, b].tolist()), dtype=ids.dtype)
        return ids

    @staticmethod
    def token_gather(activations: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
        b, k = idx.shape
        out = activations.new_empty((b, k, activations.shape[2]) if batch_first else (k, b, activations.shape[2]))
        for i in range(b):
            for j in range(k):
                t = int(idx[i, j])
                if batch_first:
                    out[i, j] = activations[i, t]
                else:
                    out[j, i] = activations[t, i]
        return out

    @staticmethod
    def token_scatter_(everything: torch.Tensor, part: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> Any:
        for i in range(idx.shape[0]):
            for j in range(idx.shape[1]):
                t = int(idx[i, j])
                if batch_first:
                    everything[i, t] = part[i, j]
                else:
                    everything[t, i] = part[j, i]
        return everything


class Block(nn.Module):
    """A GPT-2-like block as transformers 4 called it: the mask a keyword, a tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln_2, self.fc, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        q, k, v = self.attn(self.ln_1(hidden)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D) + attention_mask[:, 0]
        hidden = hidden + self.proj(scores.softmax(-1) @ v)
        return (hidden + self.out(F.gelu(self.fc(self.ln_2(hidden)))),)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(S, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(s))
        mask = torch.full((s, s), -1e9).triu(1)[None, None].expand(b, 1, s, s)
        for block in self.h:
            x = block(x, attention_mask=mask)[0]
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000,
                              "memory_efficient_linear": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10**9,
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
            "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": SCHEDULE}}},
    }  # fmt: skip


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, V, (MICRO, S), generator=g)


def global_loss(loss: torch.Tensor, world: int) -> str:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float((total / world).item()).hex()


def train(deepspeed: Any, trainer: str, stage: int, rank: int, world: int) -> dict[str, Any]:
    """STEPS steps of TinyGPT with blocks 1 and 2 dropping tokens; the global RNG seeded before each forward, so
    both trainers draw the same tokens."""
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd as ds_convert

    from fzero.deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd as fz_convert
    from fzero.sharding.bind import Unavailable

    torch.manual_seed(0)
    model = TinyGPT()
    kwargs = {"printer": lambda *_: None} if trainer == "fzero" else {}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, world),
                                      **kwargs)  # fmt: skip
    engine = (ds_convert if trainer == "deepspeed" else fz_convert)(engine, Block)
    seen: list[list[Any]] = []

    def look(module: nn.Module, args: Any) -> None:  # the block itself (inside the wrapper): its input, parameters
        real = all(not isinstance(p, Unavailable) and p.numel() > 0 for p in module.parameters())
        seen[-1].append([int(args[0].shape[1]), real])

    for block in model.h:
        inner = getattr(block, "random_ltd_layer", block)
        inner.register_forward_pre_hook(look)
    out: dict[str, Any] = {"losses": [], "kept": [], "seen": seen, "consumed": []}
    if trainer == "fzero":
        out["units"] = [u.name for u in engine.state.layout.units]
        out["wrapped"] = [type(m).__name__ for m in engine.module.h]
    for step in range(STEPS):
        seen.append([])
        torch.manual_seed(1000 * step + rank)
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        out["losses"].append(global_loss(loss, world))
        out["kept"].append(engine.random_ltd_scheduler.get_current_seq())
        out["consumed"].append(engine.random_ltd_scheduler.state["consumed_layer_tokens"])
    engine.destroy()
    return out


def resume(deepspeed: Any, stage: int, rank: int, world: int, tmp: str) -> dict[str, Any]:
    """fzero: 2 steps, save, 2 more; a new engine loads the checkpoint and runs the same 2 (no seeding: the
    checkpoint restores the random generators the token draws use)."""
    from fzero.deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

    def build() -> Any:
        torch.manual_seed(0)
        model = TinyGPT()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, world), printer=lambda *_: None)  # fmt: skip
        return convert_to_random_ltd(engine, Block)

    def run(engine: Any, steps: range) -> list[str]:
        losses = []
        for step in steps:
            loss = engine(batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(global_loss(loss, world))
        return losses

    torch.manual_seed(5 + rank)
    engine = build()
    run(engine, range(2))
    engine.save_checkpoint(tmp, client_state={"mine": 1})
    saved_state = dict(engine.random_ltd_scheduler.state_dict())
    after = run(engine, range(2, 4))
    final = engine.random_ltd_scheduler.state_dict()
    engine.destroy()
    torch.manual_seed(99)  # another generator state: the load restores the saved one
    engine = build()
    _, client = engine.load_checkpoint(tmp)
    loaded = dict(engine.random_ltd_scheduler.state_dict())
    resumed = run(engine, range(2, 4))
    out = {"after": after, "resumed": resumed, "client": client, "saved": saved_state, "loaded": loaded,
           "final": final, "resumed_final": engine.random_ltd_scheduler.state_dict()}  # fmt: skip
    engine.destroy()
    return out


def pieces() -> dict[str, Any]:
    """Rank 0: DeepSpeed's scheduler, config parsing, sampling and token autograd functions against fzero's."""
    from deepspeed.ops.random_ltd import dropping_utils as ds_ops
    from deepspeed.runtime.data_pipeline.config import get_data_routing
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler as DSScheduler

    from fzero.config.data_routing import parse_data_routing
    from fzero.deepspeed.ops.random_ltd import dropping_utils as fz_ops
    from fzero.deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler as FZScheduler

    out: dict[str, Any] = {"schedules": []}
    for ex in EXAMPLES:
        cfg = {"total_layer_num": ex["total"], "random_ltd_layer_num": ex["layers"], "global_batch_size": ex["batch"],
               "layer_token_lr_schedule": {"enabled": False},
               "random_ltd_schedule": {"min_value": ex["min"], "max_value": ex["max"], "schedule_type": "fixed_linear",
                                       "schedule_config": {"require_steps": ex["require"],
                                                           "seq_per_step": ex["per"]}}}  # fmt: skip
        runs = []
        for cls in (DSScheduler, FZScheduler):
            s = cls(cfg)
            trace = []
            for step in range(int(ex["require"] * 1.25)):
                for _ in range(2):  # two micro-steps per step: counted once
                    s.update_seq(step)
                trace.append([s.get_current_seq(), s.state["consumed_layer_tokens"]])
            runs.append(trace)
        out["schedules"].append(runs)
    blocks = [{}, {"enabled": True}, {"random_ltd": {"enabled": False, "total_layer_num": 3}},
              {"enabled": True, "random_ltd": {"enabled": True, **config(0, 1)["data_efficiency"]["data_routing"][
                  "random_ltd"]}}]  # fmt: skip
    # (DeepSpeed's reads the data_efficiency block: data_routing inside it)
    out["config"] = [[get_data_routing({"data_routing": json.loads(json.dumps(b))}), parse_data_routing(b, "x")]
                     for b in blocks]  # fmt: skip

    ds_ops.random_ltd_module = RefKernel
    mask = torch.randn(3, 1, 10, 10)
    same = []
    for sample in ("gpt_sample_tokens", "bert_sample_tokens"):
        torch.manual_seed(3)
        ds_idx, ds_mask = getattr(ds_ops, sample)(4, 10, 3, 2, "cpu", mask)
        torch.manual_seed(3)
        fz_idx, fz_mask = getattr(fz_ops, sample)(4, 10, 3, 2, "cpu", mask)
        masks = [ds_mask] if sample == "gpt_sample_tokens" else list(zip(ds_mask, fz_mask, strict=True))
        same.append([torch.equal(ds_idx, fz_idx), ds_idx.dtype == fz_idx.dtype,
                     all(torch.equal(a, b) for a, b in masks) if sample != "gpt_sample_tokens"
                     else torch.equal(ds_mask, fz_mask)])  # fmt: skip
    out["sampling"] = same
    grads = []
    for batch_first in (True, False):
        torch.manual_seed(4)
        x0 = torch.randn(3, 10, 5) if batch_first else torch.randn(10, 3, 5)
        w, weights = torch.randn(5, 5), torch.randn_like(x0)
        idx = fz_ops.gpt_sample_tokens(4, 10, 3)[0][0]
        results = []
        for ops in (ds_ops, fz_ops):
            x = x0.clone().requires_grad_(True)
            passed, part = ops.GatherTokens.apply(x, idx, batch_first)
            y = ops.ScatterTokens.apply(passed, torch.tanh(part @ w), idx, batch_first)
            (y * weights).sum().backward()
            results.append((y.detach(), x.grad))
        grads.append([torch.equal(results[0][0], results[1][0]), torch.equal(results[0][1], results[1][1])])
    out["autograd"] = grads
    return out


def run(rank: int, world: int, out_dir: str) -> None:
    deepspeed, shell = init_deepspeed_worker(rank, world, os.path.join(out_dir, "store"))
    from deepspeed.ops.random_ltd import dropping_utils

    dropping_utils.random_ltd_module = RefKernel  # (see the module docstring)

    results: dict[str, Any] = {"deepspeed": train(deepspeed, "deepspeed", 0, rank, world)}
    # (stages 0 and 3 only: random-LTD acts in the forward, which runs on the full compute parameters at stages 0-2
    # alike and on gathered units at stage 3; with one micro-step per step stages 0-3 are bitwise equal to each other
    # (docs/equivalence.md's table, tests/test_stages.py), so 1 and 2 equal DeepSpeed where 0 and 3 do)
    results["fzero"] = {stage: train(shell, "fzero", stage, rank, world) for stage in (0, 3)}
    results["resume"] = resume(shell, 3, rank, world, os.path.join(out_dir, "ckpt"))
    if rank == 0:
        results["pieces"] = pieces()
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    process_group.shutdown()
    # (the results are written and every rank is done: skip the interpreter's teardown, 2.5 s of C-level finalization
    # once DeepSpeed and torch._dynamo are loaded (measured on this 2-core machine); an error above still raises)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

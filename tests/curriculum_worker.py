"""Worker of tests/test_curriculum.py: DeepSpeed 0.19.8 (CPU accelerator, gloo) and fzero, on the same ranks.

1. The legacy `curriculum_learning` block. DeepSpeed 0.19.8 refuses the block, so its engine runs with the removed
   lines put back as a forward pre-hook, with DeepSpeed's own `CurriculumScheduler` and `global_steps`:
   `if module.training: kwargs["curriculum_seqlen"] = scheduler.update_difficulty(engine.global_steps + 1)`.
   A tiny language model truncates its tokens to `curriculum_seqlen`, as Megatron's does, and records each value.
2. The curriculum data sampler: DeepSpeed's `DeepSpeedDataSampler` and fzero's, over the same index files (written
   by DeepSpeed's builder; fzero's writer must write the same bytes), one metric and two, the batch indices of
   every micro-batch on every rank.
3. `initialize(training_data=...)` with curriculum data sampling: the engine's loader yields DeepSpeed's batches;
   fzero's checkpoint resumes the sampler and the legacy schedule bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fzero.host import process_group
from tests.spawn import init_deepspeed_worker

T, VOCAB, MICRO, GAS, STEPS, N = 32, 11, 2, 2, 4, 40
LEGACY = {
    "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
    # 40 reaches the maximum: the difficulty then stays 40 although the schedule says 16 (state a resume must keep)
    "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 40, 16], "max_step": [1, 2]},
}  # fmt: skip


class TinyLM(nn.Module):
    """Next-token prediction; `curriculum_seqlen` truncates the sequences first (Megatron's GPT model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)
        self.seen: list[Any] = []

    def forward(self, tokens: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append(curriculum_seqlen)
        if curriculum_seqlen is not None and curriculum_seqlen < tokens.shape[1]:
            tokens = tokens[:, :curriculum_seqlen]
        logits = self.out(torch.tanh(self.emb(tokens[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO, T), generator=g)


def engine_config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10**9, **extra,
    }  # fmt: skip


def global_loss(loss: torch.Tensor) -> str:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.item()).hex()


def train(engine: Any, model: TinyLM, steps: range, rank: int, evaluate: bool = False) -> dict[str, Any]:
    losses = []
    for step in steps:
        for i in range(GAS):
            loss = engine(tokens(step, i, rank))
            engine.backward(loss)
            engine.step()
            losses.append(global_loss(loss))
        if evaluate:  # an evaluation forward: no curriculum update, no curriculum_seqlen
            engine.eval()
            with torch.no_grad():
                engine(tokens(step, 9, rank))
            engine.train()
    return {"losses": losses, "seen": list(model.seen)}


def legacy(deepspeed: Any, trainer: str, rank: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    if trainer == "deepspeed":
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=engine_config())
        scheduler = CurriculumScheduler({k: v for k, v in LEGACY.items() if k != "enabled"})

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:  # DeepSpeed's removed lines
            if module.training:
                return args, {**kwargs, "curriculum_seqlen": scheduler.update_difficulty(engine.global_steps + 1)}
            return None

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return train(engine, model, range(1, STEPS + 1), rank, evaluate=True)
    cfg = engine_config(curriculum_learning=LEGACY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      printer=lambda *_: None)  # fmt: skip
    result = train(engine, model, range(1, STEPS + 1), rank, evaluate=True)
    result["accessors"] = [engine.curriculum_enabled_legacy(), engine.curriculum_params_legacy()["curriculum_type"]]
    # resume: train 2 steps, save, train on; a new engine loads and trains the same steps
    torch.manual_seed(0)
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      printer=lambda *_: None)  # fmt: skip
    train(engine, model, range(1, 3), rank)
    engine.save_checkpoint(os.path.join(out, "legacy-ckpt"), client_state={"mine": 1})
    more = train(engine, model, range(3, STEPS + 1), rank)
    torch.manual_seed(5)
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      printer=lambda *_: None)  # fmt: skip
    path, client = engine.load_checkpoint(os.path.join(out, "legacy-ckpt"))
    resumed = train(engine, model, range(3, STEPS + 1), rank)
    result["resume"] = {"uninterrupted": more["losses"], "resumed": resumed["losses"], "client": client,
                        "seen_uninterrupted": more["seen"][-2 * GAS:], "seen_resumed": resumed["seen"],
                        "parts": record_parts(path)}  # fmt: skip
    return result


def record_parts(path: str) -> dict[str, Any]:
    """The engine record's `parts` of the checkpoint at `path` (what the engine saved beside the training state)."""
    from fzero.checkpoint import read_manifest

    return read_manifest(path).user_state["engine"]["parts"]


# ------------------------------------------------------------------------------------------------ data sampling
def write_index(builder_module: Any, prefix: str, rows: list[list[int]], dtype: Any) -> None:
    builder = builder_module.create_mmap_dataset_builder(prefix, dtype)
    for row in rows:
        builder.add_item_numpy(np.array(row, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def index_files(root: str) -> dict[str, str]:
    """The DataAnalyzer's files of two metrics over N samples: `value` (i % 7, value-based) and `rank` (a ranking)."""
    from deepspeed.runtime.data_pipeline.data_sampling import utils as ds_utils

    os.makedirs(root, exist_ok=True)
    values = [i % 7 for i in range(N)]
    by_value = [[i for i in range(N) if values[i] == v] for v in sorted(set(values))]
    order = sorted(range(N), key=lambda i: ((i * 13) % N, i))
    by_rank = [order[k : k + 5] for k in range(0, N, 5)]
    paths = {}
    for name, rows in (("value_sample", by_value), ("value_metric", [[v] for v in sorted(set(values))]),
                       ("rank_sample", by_rank)):  # fmt: skip
        paths[name] = os.path.join(root, name)
        write_index(ds_utils, paths[name], rows, np.int64)
    return paths


def sampling_config(paths: dict[str, str], cluster: str, two: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "value": {
            "index_to_sample_path": paths["value_sample"], "index_to_metric_path": paths["value_metric"],
            "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 3,
            "max_difficulty": 6, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 1},
        }
    }  # fmt: skip
    if two:
        metrics["rank"] = {
            "index_to_sample_path": paths["rank_sample"], "difficulty_type": "percentile",
            "clustering_type": "schedule_based", "min_difficulty": 4, "max_difficulty": 10,
            "schedule_type": "custom",
        }  # fmt: skip
    return {"enabled": True, "seed": 7, "data_sampling": {"enabled": True, "num_epochs": 2, "curriculum_learning": {
        "enabled": True, "data_cluster_path": cluster, "curriculum_metrics": metrics}}}  # fmt: skip


def custom(step: int) -> int:
    return min(10, 4 + step // 2)  # (tenths of the ranking: 4 samples each)


def sampler_batches(trainer: str, paths: dict[str, str], root: str, two: bool, rank: int, world: int) -> Any:
    cluster = os.path.join(root, f"clusters-{trainer}-{int(two)}")
    if trainer == "deepspeed":
        from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler as DS

        sampler = DS(sampling_config(paths, cluster, two), N, MICRO, rank, world, dist.group.WORLD, GAS, rank)
    else:
        from fzero.config.data_efficiency import DATA_EFFICIENCY
        from fzero.deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

        checked = DATA_EFFICIENCY.validate(sampling_config(paths, cluster, two), "data_efficiency", [])

        def broadcast(x: torch.Tensor) -> torch.Tensor:
            dist.broadcast(x, 0)
            return x

        sampler = DeepSpeedDataSampler(checked, N, MICRO, rank, world, None, GAS, rank, broadcast=broadcast)
    if two:
        sampler.set_custom_curriculum_learning_schedule({"rank": custom})
    it = iter(sampler)
    return [[int(i) for i in next(it)] for _ in range(10 * GAS)]


class Indices(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def engine_batches(deepspeed: Any, trainer: str, paths: dict[str, str], root: str, rank: int) -> dict[str, Any]:
    kwargs = {"printer": lambda *_: None} if trainer == "fzero" else {}
    cfg = engine_config(data_efficiency=sampling_config(paths, os.path.join(root, f"engine-{trainer}"), False))
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                                training_data=Indices(), **kwargs)  # fmt: skip
    it = iter(loader)
    out: dict[str, Any] = {"batches": [], "type": type(loader).__name__}

    def steps(n: int, it: Any, engine: Any) -> list[list[int]]:
        seen = []
        for _ in range(n * GAS):
            b = next(it)
            seen.append(b.tolist())
            loss = engine(b.float().view(-1, 1)).square().mean()
            engine.backward(loss)
            engine.step()
        return seen

    out["batches"] = steps(3, it, engine)
    if trainer == "fzero":
        ckpt = os.path.join(root, "sampler-ckpt")
        engine.save_checkpoint(ckpt)
        if rank == 0:
            shutil.copytree(os.path.join(root, "engine-fzero"), os.path.join(root, "engine-resumed"))
        dist.barrier()
        out["more"] = steps(4, it, engine)
        cfg = engine_config(data_efficiency=sampling_config(paths, os.path.join(root, "engine-resumed"), False))
        engine, _, loader, _ = deepspeed.initialize(model=nn.Linear(1, 1), config=cfg, training_data=Indices(),
                                                    **kwargs)  # fmt: skip
        path, _ = engine.load_checkpoint(ckpt)
        out["parts"] = sorted(record_parts(path))
        out["resumed"] = steps(4, iter(loader), engine)
    return out


def run(rank: int, world: int, out_dir: str) -> None:
    deepspeed, shell = init_deepspeed_worker(rank, world, os.path.join(out_dir, "store"))

    paths = index_files(os.path.join(out_dir, f"index-{rank}"))
    results: dict[str, Any] = {}
    for trainer, module in (("deepspeed", deepspeed), ("fzero", shell)):
        results[trainer] = {
            "legacy": legacy(module, trainer, rank, out_dir),
            "sampler1": sampler_batches(trainer, paths, os.path.join(out_dir, "s"), False, rank, world),
            "sampler2": sampler_batches(trainer, paths, os.path.join(out_dir, "s"), True, rank, world),
            "engine": engine_batches(module, trainer, paths, out_dir, rank),
        }
    # fzero's writer: the same bytes as DeepSpeed's
    from fzero.deepspeed.runtime.data_pipeline.data_sampling import indexed_dataset as fz

    mine = os.path.join(out_dir, f"index-{rank}", "fzero_value_sample")
    write_index(fz, mine, [[i for i in range(N) if i % 7 == v] for v in range(7)], np.int64)
    theirs = os.path.join(out_dir, f"index-{rank}", "value_sample")
    results["same_bytes"] = all(
        open(mine + ext, "rb").read() == open(theirs + ext, "rb").read() for ext in (".idx", ".bin")
    )
    with open(os.path.join(out_dir, f"results-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()
    # (the results are written and every rank is done: skip the interpreter's teardown, 2.5 s of C-level finalization
    # once DeepSpeed and torch._dynamo are loaded (measured on this 2-core machine); an error above still raises)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

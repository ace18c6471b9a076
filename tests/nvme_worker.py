"""The multi-process and killed-process halves of tests/test_nvme.py: training with the NVMe tier against the
same training in memory, as a functional loop (`train`) and through the DeepSpeed-style engine from a DeepSpeed
JSON config with `offload_optimizer.device: "nvme"`."""

from __future__ import annotations

import copy
import os
import signal
import tempfile

import torch
import torch.nn.functional as F

import fzero
from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

PRESETS = {0: fzero.zero0, 1: fzero.zero1, 2: fzero.zero2, 3: fzero.zero3}
KW = {"stage": 3, "precision": "bf16", "micro": 2, "groups": True}  # the killed run's configuration
CASES = ["core fp32 50 steps", "core bf16 accumulation", "core threads 4 buffered", "core params bf16",
         "core checkpoint and resume",
         "engine fp32", "engine bf16 accumulation", "engine params bf16",
         "speculate core nvme params 20 steps", "speculate core cpu bf16 accumulation",
         "speculate core stage 2 threads 4 buffered",
         "speculate engine nvme params", "speculate engine cpu bf16 accumulation",
         "speculate engine two backwards", "engine stage 3 two backwards"]  # fmt: skip
CLIP = 0.8  # the tiny GPT's gradient norms are 0.5-1.5: some steps are clipped (speculation misses), most not


def optimizer(groups: bool, kill_at: int | None = None) -> fzero.Optimizer:
    spec = fzero.param_groups({"*.bias": {"weight_decay": 0.0}}) if groups else None
    opt = fzero.cpu_adamw(1e-2, weight_decay=0.1, groups=spec)
    if kill_at is None:
        return opt
    calls = [0]

    def update(*args, **kw):  # the kernel on each chunk; the process dies in the middle of the pipeline
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return opt.update(*args, **kw)

    return opt._replace(update=update)


def train(*, stage=3, world=2, precision=None, micro=1, steps=3, offload=None, groups=False, state=None, start=0,
          mesh=None, rank=None, opt=None, save=None, clip=None, hits=None, donate=False, metrics=None):  # fmt: skip
    """`steps` steps of the tiny GPT from `state` (default: a fresh one), batches from step `start`; with `rank`,
    on a `DistMesh` (its rows of each batch); with `save`, a checkpoint `(directory, after step)`; `hits` collects
    the speculation's outcomes, `metrics` each step's metrics; `donate`: the step's (`fzero.train_step`)."""
    model = tiny_gpt(0)
    tx = PRESETS[stage](opt or optimizer(groups), accumulate=micro, precision=precision, offload=offload, clip=clip)
    mesh = mesh or fzero.SimMesh(world)
    state = state if state is not None else fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=donate)
    losses, io = [], []
    batches = lm_batches(tiny_gpt(0), world, micro, 2, steps + start, 7)[start * micro :]
    for i, batch in enumerate(batches):
        state, m = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
        losses.append(float(m["loss"]))
        io.append(m.get("io"))
        if metrics is not None:
            metrics.append(m)
        if hits is not None and "speculation" in m:
            hits.append(m["speculation"]["hit"])
        if save is not None and (i + 1) == save[1] * micro:
            fzero.checkpoint.save(state, save[0], mesh=None if rank is None else mesh)
    return state, losses, io


def killed_run(swap: str, ck: str) -> None:
    """Train 6 steps with a checkpoint after step 3, and die by SIGKILL in the middle of step 5's update."""
    shard_chunks = 0  # the optimizer runs once per chunk: die halfway through step 5's chunks
    probe, _, _ = train(steps=0, offload=fzero.Offload("nvme", path=swap, chunk=4096), **KW)
    shard_chunks = len(probe.params.store.tasks)
    probe.params.store.close()
    kill_at = 4 * shard_chunks + shard_chunks // 2 + 1
    train(steps=6, offload=fzero.Offload("nvme", path=swap, chunk=4096), opt=optimizer(True, kill_at),
          save=(ck, 3), **KW)  # fmt: skip


def resume(swap: str, ck: str) -> fzero.TrainState:
    """The run `killed_run` began, resumed from its checkpoint in this process, to step 6."""
    offload = fzero.Offload("nvme", path=swap, chunk=4096)
    like, _, _ = train(steps=0, offload=offload, **KW)
    state, extra = fzero.checkpoint.load(ck, like)
    assert extra["step"] == 3 * KW["micro"]
    state, _, _ = train(steps=3, start=3, offload=offload, state=state, **KW)
    return state


def _outcomes(hits: list[bool], want: str) -> list[str]:
    """What is wrong with a speculative run's outcomes: `want` "both" (hits and misses), "misses" (all)."""
    if want == "misses":
        return [] if hits and not any(hits) else [f"outcomes {hits}: expected every step to miss"]
    return [] if any(hits) and not all(hits) else [f"outcomes {hits}: expected hits and misses"]


def _speculation(mesh: fzero.DistMesh, rank: int, swap: str) -> dict[str, list[str]]:
    """SuperOffload (`Offload(speculate=True)`, `super_offload`) against the plain in-memory run: bitwise, whether
    the speculation hit (most steps) or missed (clipped steps; a second backward)."""
    results = {}
    core = {"speculate core nvme params 20 steps": ({"steps": 20}, "nvme", {"params": "nvme"}),
            "speculate core cpu bf16 accumulation": ({"precision": "bf16", "micro": 2, "groups": True, "steps": 6},
                                                     "cpu", {}),
            "speculate core stage 2 threads 4 buffered": ({"stage": 2, "steps": 6}, "nvme",
                                                          {"threads": 4, "direct": False})}  # fmt: skip
    for name, (kw, device, tier) in core.items():
        ref, ref_losses, _ = train(mesh=mesh, rank=rank, clip=CLIP, **kw)
        offload = fzero.Offload(device, path=swap if device == "nvme" else None, speculate=True, **tier)
        hits: list[bool] = []
        got, losses, _ = train(mesh=mesh, rank=rank, offload=offload, clip=CLIP, hits=hits, **kw)
        diff = differing(fzero.state_dict(ref, mesh), fzero.state_dict(got, mesh))
        results[name] = diff + (["losses"] if losses != ref_losses else []) + _outcomes(hits, "both")
    cases = {
        "speculate engine nvme params": (("fp32", 1, "nvme", "nvme"), {"steps": 8}, "both"),
        "speculate engine cpu bf16 accumulation": (("bf16", 2, "cpu", "none"), {"steps": 8}, "both"),
        "speculate engine two backwards": (("fp32", 1, "cpu", "none"), {"backwards": 2}, "misses"),
    }
    for name, ((precision, micro, device, params), kw, want) in cases.items():
        ref, ref_losses, _ = _engine(precision, micro, "cpu", "none", swap, clip=CLIP, **kw)
        got, losses, hits = _engine(precision, micro, device, params, swap, speculate=True, clip=CLIP, **kw)
        results[name] = differing(ref, got) + (["losses"] if losses != ref_losses else []) + _outcomes(hits, want)
    # a second backward at stage 3 gathers every unit again (the root's stays gathered through the step): stage 2's
    ref, ref_losses, _ = _engine("fp32", 1, "none", "none", swap, backwards=2, stage=2)
    got, losses, _ = _engine("fp32", 1, "none", "none", swap, backwards=2, stage=3)
    results["engine stage 3 two backwards"] = differing(ref, got) + (["losses"] if losses != ref_losses else [])
    return results


# ---------------------------------------------------------------------------------------------------- 2 processes
def _engine(precision: str, micro: int, device: str, params: str, swap: str, speculate: bool = False,
           clip: float | None = None, backwards: int = 1, steps: int = 4, stage: int = 3):  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": device, "nvme_path": swap,
                                                                "pipeline_read": True, "pipeline_write": True},
                              "offload_param": {"device": params, "nvme_path": swap}},
        "aio": {"block_size": 1 << 16, "intra_op_parallelism": 2},
        "bf16": {"enabled": precision == "bf16"},
    }  # fmt: skip
    if speculate:
        config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    if clip is not None:
        config["gradient_clipping"] = clip
    model = tiny_gpt(0)
    engine, *_ = fzero.initialize(model=model, config=copy.deepcopy(config), model_parameters=model.parameters())
    rank, losses = engine.global_rank, []
    assert type(engine.state.compute).__name__ == ("Offloaded" if params == "nvme" else "Tensor")
    hits = []
    for batch in lm_batches(tiny_gpt(0), 2, micro, 2, steps, 7):
        logits = engine(batch["x"][rank])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["y"][rank].flatten())
        for i in range(backwards):  # (a second backward adds to the first: each unit's gradient lands twice)
            engine.backward(loss / (i + 1), retain_graph=i + 1 < backwards)
        engine.step()
        losses.append(loss.item())
        if "speculation" in engine.step_metrics:
            hits.append(engine.step_metrics["speculation"]["hit"])
    return engine.module_state_dict(), losses, hits  # (consolidated: at stage 3 the module's own are empty)


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    swap = tempfile.mkdtemp(dir=out_dir, prefix=f"swap{rank}-")
    results = {}
    core = {"core fp32 50 steps": ({"steps": 50}, {}),
            "core bf16 accumulation": ({"precision": "bf16", "micro": 2, "groups": True}, {}),
            "core threads 4 buffered": ({"precision": "bf16"}, {"threads": 4, "direct": False}),
            "core params bf16": ({"precision": "bf16", "micro": 2}, {"params": "nvme"})}  # fmt: skip
    for name, (kw, tier) in core.items():
        ref, ref_losses, _ = train(mesh=mesh, rank=rank, **kw)
        offload = fzero.Offload("nvme", path=swap, chunk=4096, **tier)
        got, losses, _ = train(mesh=mesh, rank=rank, offload=offload, **kw)
        assert type(got.params).__name__ == "Offloaded"
        diff = differing(fzero.state_dict(ref, mesh), fzero.state_dict(got, mesh))
        results[name] = diff + (["losses"] if losses != ref_losses else [])
    # saved on NVMe by 2 processes mid-run, loaded into a fresh NVMe state, continued: the in-memory run's values
    kw, ck = {"precision": "bf16", "micro": 2}, f"{out_dir}/ck"
    offload = fzero.Offload("nvme", params="nvme", path=swap, chunk=4096)
    ref, ref_losses, _ = train(mesh=mesh, rank=rank, steps=4, **kw)
    got, losses, _ = train(mesh=mesh, rank=rank, steps=2, offload=offload, save=(ck, 2), **kw)
    like, _, _ = train(mesh=mesh, rank=rank, steps=0, offload=offload, **kw)
    state, _ = fzero.checkpoint.load(ck, like, mesh=mesh)
    got, more, _ = train(mesh=mesh, rank=rank, steps=2, start=2, offload=offload, state=state, **kw)
    diff = differing(fzero.state_dict(ref, mesh), fzero.state_dict(got, mesh))
    results["core checkpoint and resume"] = diff + (["losses"] if losses + more != ref_losses else [])
    cases = {"engine fp32": ("fp32", 1, "none"), "engine bf16 accumulation": ("bf16", 2, "none"),
             "engine params bf16": ("bf16", 2, "nvme")}  # fmt: skip
    for name, (precision, micro, params) in cases.items():
        ref, ref_losses, _ = _engine(precision, micro, "cpu", "none", swap)
        got, losses, _ = _engine(precision, micro, "nvme", params, swap)
        results[name] = differing(ref, got) + (["losses"] if losses != ref_losses else [])
    results.update(_speculation(mesh, rank, swap))
    report(rank, out_dir, results)
    process_group.shutdown()

"""The 2-process half of tests/test_desync.py: per-rank skipped units, a rank whose forward raises, ranks at
different steps, over a real gloo group. Results go to `results.json` (rank 0's) and `RANK.json`."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero.host import process_group
from tests.spawn import init_worker

CASES = [
    ("zero2", "autograd", 0),
    ("zero3", "autograd", 0),
    ("zero3", "autograd", 1),
    ("zero0", "autograd", 1),
    ("zero3", "func", 1),
]  # fmt: skip  (preset, autodiff, prefetch)


class Drop(nn.Module):
    """Four residual blocks, any of which a rank may skip (layer drop; skipping the last ones is an early exit)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if not skip[i]:
                h = h + torch.tanh(block(h))
        return self.out(h)


def loss_of(model: nn.Module):
    def loss_fn(params, batch):
        if batch["fail"]:
            raise ValueError("a bad batch on this rank")
        out = torch.func.functional_call(model, params, (batch["x"], batch["skip"]))
        return ((out - batch["y"]) ** 2).mean()

    return loss_fn


def batches(world: int, skips: list[list[list[int]]], fail_at: int | None = None) -> list[dict]:
    """One batch per step; `skips[step][rank]` lists the blocks that rank skips; `fail_at`: the step where the last
    rank's loss raises."""
    g = torch.Generator().manual_seed(3)
    out = []
    for s, per_rank in enumerate(skips):
        skip = torch.zeros(world, 4, dtype=torch.bool)
        for r, blocks in enumerate(per_rank):
            skip[r, blocks] = True
        fail = torch.tensor([False] * (world - 1) + [s == fail_at])
        out.append({"x": torch.randn(world, 3, 4, generator=g), "y": torch.randn(world, 3, 2, generator=g),
                    "skip": skip, "fail": fail})  # fmt: skip
    return out


SKIPS = [[[], [1]], [[2], [3]], [[], [2, 3]], [[], []]]  # layer drop, early exit, none


def train(mesh, preset: str, autodiff: str, prefetch: int, data: list[dict], rank: int | None, start: int = 0):
    """Train over `data` (rank `rank`'s rows, or all rows on a SimMesh); returns the state dict and, per step, the
    DesyncError's (type of its cause, in_step) if one was raised (caught, as a skip-the-bad-batch loop does)."""
    model = Drop()
    tx = getattr(fzero, preset)(fzero.adamw(1e-2))
    state = fzero.init(model, tx, mesh)
    state = state.replace(step=state.step + start)
    step = fzero.train_step(model, loss_of(model), tx, mesh, autodiff=autodiff,
                            gather=fzero.GatherPolicy(prefetch=prefetch))  # fmt: skip
    errors = []
    for batch in data:
        try:
            state, _ = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
            errors.append(None)
        except fzero.DesyncError as e:
            errors.append([type(e.__cause__).__name__, e.in_step, str(e)])
    return {k: v.tolist() for k, v in fzero.state_dict(state, mesh).items()}, errors


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    results = {}
    for preset, autodiff, prefetch in CASES:
        key = f"{preset}-{autodiff}-{prefetch}"
        results[f"skip {key}"] = train(mesh, preset, autodiff, prefetch, batches(world, SKIPS), rank)
        results[f"fail {key}"] = train(mesh, preset, autodiff, prefetch, batches(world, SKIPS, fail_at=1), rank)
    results["out of step"] = train(mesh, "zero2", "autograd", 1, batches(world, [[[], []]] * 2), rank, start=rank)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bad batch on this rank")


class Failing(Drop):
    """`Drop` whose forward (`fail="forward"`) or backward (`fail="backward"`, halfway: after the last two blocks'
    gradients are complete) raises when asked to (a bad batch on one rank)."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor, fail: str = "") -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if fail == "backward" and i == 2:
                h = _RaiseInBackward.apply(h)
            if not skip[i]:
                h = h + torch.tanh(block(h))
        if fail == "forward":
            raise ValueError("a bad batch on this rank")
        return self.out(h)


def engine_config(stage: int, world: int, gas: int = 1) -> dict:
    """Each block its own unit, gathered when the forward reaches it (no unit is small enough to persist)."""
    return {
        "train_batch_size": 3 * world * gas,
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def engine_train(stage: int, rank: int, world: int, data: list[dict], fail_at: int | None, how: str = "forward",
                gas: int = 1) -> tuple[dict, list]:  # fmt: skip
    """An engine over `data` (rank `rank`'s rows) whose forward or backward (`how`) raises on the last rank at
    micro-step `fail_at`; the consolidated parameters and, per micro-step, the DesyncError's (type of its cause,
    in_step, text) or None."""
    engine, *_ = fzero.initialize(model=Failing(), config=engine_config(stage, world, gas), printer=lambda _: None)
    errors = []
    for s, batch in enumerate(data):
        try:
            fail = how if s == fail_at and rank == world - 1 else ""
            engine.backward(engine(batch["x"][rank], batch["skip"][rank], fail=fail).square().mean())
            engine.step()
            errors.append(None)
        except fzero.DesyncError as e:
            errors.append([type(e.__cause__).__name__, e.in_step, str(e)])
    return {k: v.tolist() for k, v in engine.module_state_dict().items()}, errors


def engine_eval(stage: int, rank: int, world: int, data: list[dict]) -> dict:
    """Evaluation forwards (no_grad) in which the last rank exits early (skips the last two blocks) while the others
    run every block, between training steps: each rank's outputs, and those with no rank exiting early."""
    engine, *_ = fzero.initialize(model=Failing(), config=engine_config(stage, world), printer=lambda _: None)
    out: dict = {"early": [], "full": []}
    for batch in data:
        x, none = batch["x"][rank], torch.zeros(4, dtype=torch.bool)
        early = torch.tensor([False, False, True, True]) if rank == world - 1 else none
        with torch.no_grad():
            out["early"].append(engine(x, early).tolist())
            out["full"].append(engine(x, none).tolist())
        engine.backward(engine(x, none).square().mean())  # the collectives still pair: training goes on
        engine.step()
    out["params"] = {k: v.tolist() for k, v in engine.module_state_dict().items()}
    return out


def engine(rank: int, world: int, out_dir: str) -> None:
    """The engine's half: `fzero.initialize` engines whose ranks are at different micro-steps (as after resuming
    from different checkpoints) at stages 0-3; per stage and step, the `DesyncError` raised (in_step, text)."""
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    results = {}
    for stage in (0, 1, 2, 3):
        model = Drop()
        config = {
            "train_batch_size": 3 * world,
            "train_micro_batch_size_per_gpu": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.state = engine.state.replace(step=engine.state.step + rank)
        data = batches(world, [[[], []]] * 2)
        errors = []
        for batch in data:
            try:
                engine.backward(engine(batch["x"][rank], batch["skip"][rank]).square().mean())
                engine.step()
                errors.append(None)
            except fzero.DesyncError as e:
                engine.zero_grad()
                errors.append([e.in_step, str(e)])
        results[str(stage)] = {"errors": errors, "micro_steps": engine.micro_steps}
        data = batches(world, [[[], []]] * 4)
        results[f"fail {stage}"] = engine_train(stage, rank, world, data, fail_at=1)
        results[f"without {stage}"] = engine_train(stage, rank, world, [data[0], data[2], data[3]], None)
        results[f"fail backward {stage}"] = engine_train(stage, rank, world, data, fail_at=1, how="backward")
        # gradient accumulation over 2 micro-steps: the second of the first window fails
        more = batches(world, [[[], []]] * 6)
        results[f"fail gas {stage}"] = engine_train(stage, rank, world, more, fail_at=1, gas=2)
        results[f"without gas {stage}"] = engine_train(stage, rank, world, more[:1] + more[2:], None, gas=2)
        results[f"eval {stage}"] = engine_eval(stage, rank, world, data[:2])
    with open(os.path.join(out_dir, f"engine-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

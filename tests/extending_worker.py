"""The model, data and chains of tests/test_extending.py, and its 2-process gloo half: each transform of
tests/extending_transforms.py trained at stages 0-3 on a `DistMesh`, against the same run on a `SimMesh(2)`."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.host import process_group
from tests.extending_transforms import clip_by_value, grad_mask, gradient_noise, topk_reduce, unit_norms
from tests.spawn import init_worker, report
from tests.support import differing

WORLD, STEPS, LR = 2, 3, 1e-2
WIDTHS = (6, 8, 8, 3)  # a unit per layer: units "layers.0", "layers.1", "layers.2"
PER_RANK = 4  # examples per rank and micro-step


class Net(nn.Module):
    """Linear layers in an `nn.ModuleList` (one unit each), tanh between them."""

    def __init__(self, widths=WIDTHS, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.tanh(x) if i < len(self.layers) - 1 else x
        return x


def loss_of(model):
    return lambda params, batch: F.mse_loss(torch.func.functional_call(model, params, (batch["x"],)), batch["y"])


def batches(steps=STEPS, micro=1, seed=1, world=WORLD):
    """`steps * micro` batches `{x, y}` of shape `[world, PER_RANK, ...]`."""
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(world, PER_RANK, WIDTHS[0], generator=g),
             "y": torch.randn(world, PER_RANK, WIDTHS[-1], generator=g)} for _ in range(steps * micro)]  # fmt: skip


def stage_chain(stage, before=(), after=(), reduce=None, micro=1, scale="none", opt=None):
    """The chain of stage 0-3, spelled out as `fzero.zero0..3` build it, with the user's transforms inserted:
    `before` ahead of the reduction, `after` after the reduction and the accumulation (ahead of the optimizer);
    `reduce` replaces the reduction (default `all_reduce()` at stage 0, `reduce_scatter()` above)."""
    red = reduce if reduce is not None else fzero.all_reduce() if stage == 0 else fzero.reduce_scatter()
    acc = fzero.accumulate(micro)
    head = [acc, *before, red] if stage < 2 else [*before, red, acc]
    opt = opt if opt is not None else fzero.adamw(LR, weight_decay=0.0)  # a zero gradient: no step at all
    return fzero.chain(*head, fzero.scale_loss(scale), *after, fzero.shard_update(opt),
                       fzero.gather(lazy=stage > 0, keep=stage in (1, 2)))  # fmt: skip


def train(tx, data, mesh=None, model=None, rank=None, micro=1):
    """Train `model` (default `Net()`) with `tx` on `data` (every rank's rows; a `DistMesh` takes row `rank`); the
    consolidated parameters and each update's metrics (the `unit_grad_norm/` ones and the loss)."""
    mesh = mesh if mesh is not None else fzero.SimMesh(WORLD)
    model = model if model is not None else Net()
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh)
    metrics = []
    for batch in data:
        state, m = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
        if m["applied"]:
            metrics.append({k: float(v) for k, v in m.items() if k.startswith("unit_grad_norm/") or k == "loss"})
    return fzero.state_dict(state, mesh), metrics


def element_keep(seed=0, density=0.5, model=None):
    """A random element mask for every parameter of `model` (default `Net()`), True with probability `density`."""
    g = torch.Generator().manual_seed(seed)
    model = model if model is not None else Net()
    return {n: torch.rand(p.shape, generator=g) < density for n, p in model.named_parameters()}


# the runs the gloo half repeats, by name: (chain of a stage, micro-steps)
CASES = {
    "noise_after": (lambda s: stage_chain(s, after=[gradient_noise(1e-2)]), 1),
    "noise_before": (lambda s: stage_chain(s, before=[gradient_noise(1e-2)], micro=2), 2),
    "clip_after": (lambda s: stage_chain(s, after=[clip_by_value(2e-2)], scale=64.0), 1),
    "clip_before": (lambda s: stage_chain(s, before=[clip_by_value(2e-2)]), 1),
    "mask_before": (lambda s: stage_chain(s, before=[grad_mask(element_keep())], micro=2), 2),
    "mask_after": (lambda s: stage_chain(s, after=[grad_mask(element_keep())]), 1),
    "topk": (lambda s: stage_chain(s, reduce=topk_reduce(20, fzero.all_reduce() if s == 0 else None)), 1),
    "norms": (lambda s: stage_chain(s, after=[unit_norms()], scale=64.0), 1),
}


def stages(case):
    # topk_reduce, and noise and clipping before the reduction, have no unit form: stage 3 refuses them there
    return (0, 1, 2) if case in ("topk", "noise_before", "clip_before") else (0, 1, 2, 3)


def synced(params, mesh):
    """Whether every process holds the same parameters (stage 0's replicas)."""
    flat = torch.cat([v.flatten().float() for v in params.values()])
    every = mesh.all_gather(flat).view(mesh.world, -1)
    return all(torch.equal(every[0], row) for row in every)


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    try:
        mesh = fzero.DistMesh()
        results = {}
        for case, (make, micro) in CASES.items():
            data = batches(micro=micro)
            for stage in stages(case):
                dist, dist_metrics = train(make(stage), data, mesh, rank=rank)
                sim, sim_metrics = train(make(stage), data)
                results[f"{case}/{stage}"] = {"params": differing(dist, sim), "metrics": dist_metrics == sim_metrics}
                if stage == 0:
                    results[f"{case}/{stage}"]["synced"] = synced(dist, mesh)
        report(rank, out_dir, results)
    finally:
        process_group.shutdown()

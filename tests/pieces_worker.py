"""Worker for tests/test_pieces.py: stages 0, 2 and 3 over a real gloo group on a model with a parameter the loss
does not reach, in both precisions; rank 0 saves the parameters."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

import fzero
from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import regression_loss

STEPS = 3
CASES = [(f"{preset}-{name}", preset, dtype) for preset in ("zero0", "zero2", "zero3")
         for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))]  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.spare = nn.Parameter(torch.ones(5))  # in the unit, never used: its piece of the gradient is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def model(dtype: torch.dtype) -> Model:
    torch.manual_seed(0)
    return Model().to(dtype)


def batches(world: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(world, 4, 6, generator=g).to(dtype), "y": torch.randn(world, 4, 2, generator=g).to(dtype)}
            for _ in range(STEPS)]  # fmt: skip


def train(mesh: fzero.Mesh, preset: str, dtype: torch.dtype, rank: int | None) -> dict[str, torch.Tensor]:
    """`preset` (mixed precision for bfloat16) on `mesh`, this rank's slice of each batch (`rank`) or all of them."""
    net = model(torch.float32)
    precision = "bf16" if dtype == torch.bfloat16 else None
    tx = getattr(fzero, preset)(fzero.adamw(1e-2), precision=precision)
    state = fzero.init(net, tx, mesh)
    step = fzero.train_step(net, regression_loss(net), tx, mesh)
    for batch in batches(mesh.world, dtype):
        state, _ = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
    return fzero.state_dict(state, mesh) if rank is not None else fzero.state_dict(state)


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    for name, preset, dtype in CASES:
        full = train(mesh, preset, dtype, rank)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, f"{out_dir}/{name}.st")
    report(rank, out_dir, "done")
    process_group.shutdown()

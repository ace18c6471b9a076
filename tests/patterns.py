"""Models whose code does to stage 3's units what real models do: parameters in the root before and after the
units (an embedding, a head, tied or not), in-place ops on a unit's outputs (ReLU(inplace=True), a residual `+=`, a
write into a slice), a unit called twice, 2-D and 3-D activations (a `Linear` on a 3-D input returns a view, whose
hooks an in-place op drops). Shared by tests/test_unit_patterns.py and its 2-process worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

import fzero

D, VOCAB = 8, 10


@dataclass(frozen=True)
class Pattern:
    """One model shape.

    Attributes:
      embed: the root starts with an `Embedding` (token ids in, 3-D activations); else float inputs.
      head: after the units, in the root: "none", "linear", or "tied" (the head's weight is the embedding's).
      units: how many `Linear(D, D)` units the `ModuleList` holds.
      inplace: what the root does to each unit's output: "none", "relu" (`ReLU(inplace=True)`), "add" (a residual
        `+=`), "slice" (`mul_` on a slice: an in-place op on a view of the output).
      reuse: the last unit is called twice.
      rank3: float inputs are `[batch, time, D]` (3-D) rather than `[batch, D]`.
    """

    embed: bool = True
    head: str = "linear"
    units: int = 2
    inplace: str = "relu"
    reuse: bool = False
    rank3: bool = True

    def __post_init__(self) -> None:
        if self.head == "tied" and not self.embed:
            raise ValueError("a tied head needs the embedding")


ISSUE = Pattern()  # the issue's case: Embedding -> 2 x (Linear, ReLU(inplace)) -> Linear head
ISSUE_TIED = Pattern(head="tied")


class Net(nn.Module):
    def __init__(self, p: Pattern) -> None:
        super().__init__()
        self.p = p
        self.emb = nn.Embedding(VOCAB, D) if p.embed else None
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(p.units))
        self.act = nn.ReLU(inplace=True)
        self.head = None if p.head == "none" else nn.Linear(D, VOCAB, bias=False)
        if p.head == "tied":
            self.head.weight = self.emb.weight

    def _after(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        kind = self.p.inplace
        if kind == "relu":
            return self.act(y)
        if kind == "add":
            y += x
        elif kind == "slice":
            y[..., : D // 2].mul_(0.5)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x) if self.emb is not None else x
        for layer in self.layers:
            x = self._after(layer(x), x)
        if self.p.reuse:
            x = self._after(self.layers[-1](x), x)
        return x if self.head is None else self.head(x)


def make(p: Pattern, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(p)


def batches(p: Pattern, world: int, micro: int, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """`steps * micro` batches with a leading world axis: token ids `[world, 2, 5]`, or floats."""
    g = torch.Generator().manual_seed(seed)
    shape = (world, 2, 5) if p.embed or p.rank3 else (world, 2)
    if p.embed:
        return [{"x": torch.randint(0, VOCAB, shape, generator=g)} for _ in range(steps * micro)]
    return [{"x": torch.randn(*shape, D, generator=g)} for _ in range(steps * micro)]


def loss_of(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the input ids where there are any (the issue's loss), else a square mean."""
    if out.shape[-1] == VOCAB and not x.is_floating_point():
        return nn.functional.cross_entropy(out.flatten(0, -2), x.flatten())
    return out.square().mean()


def loss_fn(model: nn.Module):
    def loss(params, batch):
        return loss_of(torch.func.functional_call(model, params, (batch["x"],)), batch["x"])

    return loss


def train(p: Pattern, preset: str, mesh, data, micro: int = 1, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The core's parameters after `data` (each batch's rank `rank` on a `DistMesh`)."""
    model = make(p)
    tx = getattr(fzero, preset)(fzero.adamw(1e-2), accumulate=micro)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_fn(model), tx, mesh)
    for batch in data:
        state, _ = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
    return fzero.state_dict(state, mesh)


def as_dict(p: Pattern) -> dict:
    return asdict(p)

"""DeepSpeed's `MuAdam` / `MuAdamW` / `MuSGD`: the `mup` package's optimizers on the model's parameters (each
matrix's lr scaled by its width multiplier), which the engine runs bitwise as torch would."""

from __future__ import annotations

import mup
import pytest
import torch
from torch import nn

import fzero
from fzero.config import ConfigError


class Net(nn.Module):
    """A width-`w` MLP with mup's readout layer."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(6, w), nn.Linear(w, w), mup.MuReadout(w, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def model() -> nn.Module:
    torch.manual_seed(0)
    net = Net(32)
    mup.set_base_shapes(net, Net(8), delta=Net(16))  # width multiplier 4 for the hidden matrices
    return net


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


@pytest.mark.parametrize(
    ("kind", "params", "stage"),
    [("MuAdam", {"lr": 1e-2, "weight_decay": 0.1}, 2), ("MuAdamW", {"lr": 1e-2, "weight_decay": 0.1}, 2),
     ("MuSGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, 2), ("MuAdamW", {"lr": 1e-2}, 3)],
)  # fmt: skip
def test_mup_optimizers_train_as_mup_built_them(kind, params, stage):
    """The config's `MuX` with `params` trains bitwise like `mup.MuX(model.parameters(), **params)` stepped by
    torch, and its groups carry mup's width-scaled learning rates. `MuReadout`'s forward reads its weight's
    `infshape`: the tensors fzero binds in the parameters' places carry their attributes (stage 3's gathered units
    too)."""
    net = model()
    ref = model()  # the same weights and base shapes (a deep copy would drop the parameters' infshape)
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": kind, "params": params}}  # fmt: skip
    engine, opt, *_ = fzero.initialize(model=net, config=cfg)
    lrs = sorted({g["lr"] for g in opt.param_groups})
    assert len(lrs) > 1, lrs  # the hidden matrices' lr differs from the vectors'
    torch_opt = getattr(mup, kind)(ref.parameters(), **params)
    for x, y in data(3):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        torch_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        torch_opt.step()
    got = engine.module_state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def test_mup_needs_base_shapes_and_lr():
    torch.manual_seed(0)
    cfg = {"train_batch_size": 4, "optimizer": {"type": "MuAdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=r"optimizer.type: MuAdamW: .*set_base_shapes"):
        fzero.initialize(model=Net(8), config=cfg)
    with pytest.raises(ConfigError, match="optimizer.params.lr: is required"):
        fzero.initialize(model=model(), config={**cfg, "optimizer": {"type": "MuAdamW", "params": {}}})


class Tagged(nn.Module):
    """Reads an attribute of its parameter in the forward, as mup's `MuReadout` does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.gain = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.lin.weight * self.lin.weight.gain, self.lin.bias)


@pytest.mark.parametrize("preset", ["zero0", "zero2", "zero3"])
def test_parameter_attributes_reach_the_forward_at_every_stage(preset):
    """The tensors bound in the parameters' places (views of the flat buffer, stage 3's gathered units on 2 ranks,
    the evaluation forward) carry the parameters' attributes."""
    torch.manual_seed(0)
    model = nn.Sequential(Tagged(), nn.Tanh(), Tagged())
    tx = getattr(fzero, preset)(fzero.adamw(1e-2))
    mesh = fzero.SimMesh(2)
    state = fzero.init(model, tx, mesh)

    def loss_fn(params, batch):
        return torch.func.functional_call(model, params, (batch["x"],)).square().mean()

    step = fzero.train_step(model, loss_fn, tx, mesh)
    state, metrics = step(state, {"x": torch.randn(2, 3, 4)})
    assert torch.isfinite(torch.as_tensor(metrics["loss"])).all()
    engine, *_ = fzero.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "AdamW"},
                                                       "zero_optimization": {"stage": int(preset[-1])}})  # fmt: skip
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    with torch.no_grad():
        engine(torch.randn(2, 4))

"""`fzero.call`: inside a step, the model called directly on the tensors the step bound into it; elsewhere
`functional_call`. Either way the same tensors, so the same training bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.sharding import bind
from tests.support import differing, lm_batches, lm_loss, tiny_gpt


def call_loss(model, seen: list[bool]):
    """`lm_loss` through `fzero.call`, noting whether each call found its params bound (the direct path)."""

    def loss_fn(params, batch):
        seen.append(bind.bound_to(model) is params)
        logits = fzero.call(model, params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    return loss_fn


def train(stage: int, world: int, micro: int, autodiff: str, loss_of) -> dict[str, torch.Tensor]:
    model = tiny_gpt(0)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro, clip=1.0)
    mesh = fzero.SimMesh(world)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh, autodiff=autodiff)
    for batch in lm_batches(tiny_gpt(0), world, micro, 2, 2, 7):
        state, _ = step(state, batch)
    return fzero.state_dict(state, mesh)


@given(
    stage=st.integers(0, 3),
    world=st.sampled_from([1, 2]),
    micro=st.sampled_from([1, 2]),
    autodiff=st.sampled_from(["autograd", "func"]),
)
def test_call_trains_bitwise_as_functional_call(stage, world, micro, autodiff):
    seen: list[bool] = []
    direct = train(stage, world, micro, autodiff, lambda m: call_loss(m, seen))
    assert seen and all(seen), "every call inside the step found its params bound"
    assert differing(direct, train(stage, world, micro, autodiff, lm_loss)) == []


def test_call_outside_a_step_is_functional_call():
    model = tiny_gpt(0)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    x = torch.randint(0, 32, (2, 8))
    assert bind.bound_to(model) is None
    assert torch.equal(fzero.call(model, params, x), torch.func.functional_call(model, params, (x,)))
    assert differing(own, model.state_dict()) == []  # the model's own tensors are back


def test_call_with_other_tensors_than_the_bound_ones():
    """A mapping that is not the one bound (a copy with one tensor replaced) is swapped in: its tensors count."""
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(1)
    tx = fzero.zero0(fzero.sgd(0.1))
    x = torch.randint(0, 32, (1, 2, 8))
    seen: dict[str, torch.Tensor] = {}

    def loss_fn(params, batch):
        zeroed = {**params, "ln_f.weight": torch.zeros_like(params["ln_f.weight"])}
        out = fzero.call(model, params, batch["x"])
        seen["direct"], seen["zeroed"] = out.detach(), fzero.call(model, zeroed, batch["x"]).detach()
        seen["swapped"] = torch.func.functional_call(model, zeroed, (batch["x"],)).detach()
        assert bind.bound_to(model) is params  # the copy's swap put the bound tensors back
        return out.sum()

    fzero.train_step(model, loss_fn, tx, mesh)(fzero.init(model, tx, mesh), {"x": x})
    assert torch.equal(seen["zeroed"], seen["swapped"])
    assert not torch.equal(seen["direct"], seen["zeroed"])
    assert bind.bound_to(model) is None  # the binding ends with the step


def test_call_with_the_bound_mapping_changed_in_place():
    """The bound mapping itself with an entry replaced after the binding: its tensors count, as `functional_call`'s
    would; the direct call only while it holds exactly what was bound."""
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(1)
    tx = fzero.zero0(fzero.sgd(0.1))
    seen: dict[str, torch.Tensor] = {}

    def loss_fn(params, batch):
        out = fzero.call(model, params, batch["x"])
        seen["direct"] = out.detach()
        weight = params["ln_f.weight"]
        params["ln_f.weight"] = torch.zeros_like(weight)
        seen["replaced"] = fzero.call(model, params, batch["x"]).detach()
        seen["swapped"] = torch.func.functional_call(model, params, (batch["x"],)).detach()
        params["ln_f.weight"] = weight
        seen["restored"] = fzero.call(model, params, batch["x"]).detach()
        return out.sum()

    fzero.train_step(model, loss_fn, tx, mesh)(fzero.init(model, tx, mesh), {"x": torch.randint(0, 32, (1, 2, 8))})
    assert torch.equal(seen["replaced"], seen["swapped"])
    assert not torch.equal(seen["direct"], seen["replaced"])
    assert torch.equal(seen["direct"], seen["restored"])


def test_call_passes_keywords_named_like_its_own_arguments():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x, model=1.0, params=1.0):
            return self.w * x * model * params

    m = Scaled()
    p = {"w": torch.full((2,), 3.0)}
    assert torch.equal(fzero.call(m, p, torch.ones(2), model=2.0, params=5.0), torch.full((2,), 30.0))


def test_nested_bindings_restore_the_outer():
    model = torch.nn.Linear(2, 1)
    outer = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    inner = {"weight": torch.full((1, 2), 2.0), "bias": torch.zeros(1)}
    with bind.bound(model, outer):
        with bind.bound(model, inner):
            assert bind.bound_to(model) is inner
        assert bind.bound_to(model) is outer
        assert model.weight is outer["weight"]
    assert bind.bound_to(model) is None


@pytest.mark.parametrize("stage", [0, 3])
def test_call_in_eval_step(stage):
    model = tiny_gpt(0)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2))
    mesh = fzero.SimMesh(2)
    state = fzero.init(model, tx, mesh)
    batch = {"x": torch.randint(0, 32, (2, 2, 8))}
    direct = fzero.eval_step(model, lambda p, b: fzero.call(model, p, b["x"]), mesh)(state, batch)
    swapped = fzero.eval_step(model, lambda p, b: torch.func.functional_call(model, p, (b["x"],)), mesh)(state, batch)
    assert torch.equal(direct, swapped)

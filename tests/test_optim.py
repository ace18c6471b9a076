"""The functional optimizers against torch.optim, bitwise, on the same gradient sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.optim.groups import Segments

dtypes = st.sampled_from([torch.float32, torch.float64])


def compare(ours, make_torch, n, steps, seed, dtype, lr_of=None, donate=False):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=dtype)
    grads = [torch.randn(n, generator=g, dtype=dtype) for _ in range(steps)]
    ref = p0.clone().requires_grad_()
    opt = make_torch([ref])
    p, state = p0.clone(), ours.init(p0)
    for t, grad in enumerate(grads):
        if lr_of is not None:
            opt.param_groups[0]["lr"] = lr_of(t)
        ref.grad = grad.clone()
        opt.step()
        p, state = ours.update(grad, state, p, donate=donate)
        assert torch.equal(p, ref.detach()), f"step {t + 1}"
    assert int(state.count) == steps


hyper = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-3, 1e-2, 0.3]),
        "b1": st.sampled_from([0.0, 0.8, 0.9]),
        "b2": st.sampled_from([0.95, 0.999]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "wd": st.sampled_from([0.0, 0.01, 0.1]),
    }
)


@given(h=hyper, n=st.integers(0, 70), steps=st.integers(1, 6), seed=st.integers(0, 99), dtype=dtypes,
       donate=st.booleans())  # fmt: skip
def test_adamw_and_adam_bitwise(h, n, steps, seed, dtype, donate):
    kw = {"lr": h["lr"], "betas": (h["b1"], h["b2"]), "eps": h["eps"], "weight_decay": h["wd"]}
    compare(
        fzero.adamw(**kw), lambda p: torch.optim.AdamW(p, **kw, foreach=False), n, steps, seed, dtype, donate=donate
    )
    compare(fzero.adam(**kw), lambda p: torch.optim.Adam(p, **kw, foreach=False), n, steps, seed, dtype, donate=donate)


@given(h=hyper, n=st.integers(0, 70), steps=st.integers(1, 4), seed=st.integers(0, 99), dtype=dtypes,
       decoupled=st.booleans(), grouped=st.booleans())  # fmt: skip
def test_adam_without_bias_correction_bitwise(h, n, steps, seed, dtype, decoupled, grouped):
    """`bias_correction=False` (DeepSpeed's FusedAdam / CPU Adam option) is torch's Adam with both corrections 1:
    torch has no switch, but a step count so large that `1 - beta^t` is exactly 1.0 in float64 (`beta <= 0.999`
    here: `0.999^1e6` underflows to 0) runs torch's own code with corrections of 1."""
    kw = {"lr": h["lr"], "betas": (h["b1"], h["b2"]), "eps": h["eps"], "weight_decay": h["wd"]}
    ours = (fzero.adamw if decoupled else fzero.adam)(**kw, bias_correction=False)
    # the grouped path: one segment in group 1, whose override is the same lr
    segments = Segments((n,), (1,), ({}, {"lr": h["lr"]})) if grouped else None
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=dtype)
    ref = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], **kw, foreach=False)
    p, state = p0.clone(), ours.init(p0)
    for t in range(steps):
        grad = torch.randn(n, generator=g, dtype=dtype)
        ref.grad = grad.clone()
        if t == 0:
            opt.state[ref] = {"step": torch.tensor(1e6), "exp_avg": torch.zeros_like(p0),
                              "exp_avg_sq": torch.zeros_like(p0)}  # fmt: skip
        opt.step()
        p, state = ours.update(grad, state, p, segments=segments)
        assert torch.equal(p, ref.detach()), f"step {t + 1}"


@given(h=hyper, n=st.integers(0, 70), steps=st.integers(1, 5), seed=st.integers(0, 99), dtype=dtypes,
       decoupled=st.booleans(), grouped=st.booleans(), donate=st.booleans())  # fmt: skip
def test_amsgrad_bitwise(h, n, steps, seed, dtype, decoupled, grouped, donate):
    """`amsgrad=True` is torch's AMSGrad (the path DeepSpeed's `torch_adam` takes), grouped or not, bitwise."""
    kw = {"lr": h["lr"], "betas": (h["b1"], h["b2"]), "eps": h["eps"], "weight_decay": h["wd"]}
    ours = (fzero.adamw if decoupled else fzero.adam)(**kw, amsgrad=True)
    segments = Segments((n,), (1,), ({}, {"lr": h["lr"]})) if grouped else None
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=dtype)
    ref = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], **kw, amsgrad=True, foreach=False)
    p, state = p0.clone(), ours.init(p0)
    for t in range(steps):
        ref.grad = torch.randn(n, generator=g, dtype=dtype) * (3.0 if t % 2 else 0.1)  # v rises and falls
        opt.step()
        p, state = ours.update(ref.grad.clone(), state, p, segments=segments, donate=donate)
        assert torch.equal(p, ref.detach()), f"step {t + 1}"
        assert torch.equal(state.max_exp_avg_sq, opt.state[ref]["max_exp_avg_sq"])


@given(momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.1]), nesterov=st.booleans(),
       wd=st.sampled_from([0.0, 0.01]), n=st.integers(0, 40), steps=st.integers(1, 5), seed=st.integers(0, 99),
       dtype=dtypes, donate=st.booleans())  # fmt: skip
def test_sgd_bitwise(momentum, dampening, nesterov, wd, n, steps, seed, dtype, donate):
    if nesterov and (momentum == 0 or dampening != 0):
        return
    kw = {"lr": 0.1, "momentum": momentum, "dampening": dampening, "weight_decay": wd, "nesterov": nesterov}
    compare(fzero.sgd(**kw), lambda p: torch.optim.SGD(p, **kw, foreach=False), n, steps, seed, dtype, donate=donate)


def test_schedule_is_a_function_of_applied_updates():
    schedule = lambda t: 0.1 / (1 + t)  # noqa: E731
    compare(fzero.adamw(schedule), lambda p: torch.optim.AdamW(p, lr=1.0, foreach=False), 17, 5, 0, torch.float32,
            lr_of=schedule)  # fmt: skip


def test_pure_without_donation():
    opt = fzero.adamw(0.1)
    p = torch.ones(4)
    state = opt.init(p)
    new_p, new_state = opt.update(torch.ones(4), state, p)
    assert torch.equal(p, torch.ones(4)) and not state.exp_avg.any() and int(state.count) == 0
    assert int(new_state.count) == 1 and not torch.equal(new_p, p)


def test_hyper_parameter_errors():
    with pytest.raises(ValueError, match="invalid learning rate: -1"):
        fzero.adamw(-1.0)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        fzero.adam(betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="learning rate must be a float"):
        fzero.sgd("0.1")
    with pytest.raises(ValueError, match="Nesterov"):
        fzero.sgd(0.1, nesterov=True)


def test_beta_schedules_follow_torch():
    """OneCycle drives Adam's beta1 (DeepSpeed writes `betas` into the param group each step)."""
    from fzero.optim.schedules import one_cycle_momentum

    mom = one_cycle_momentum(0.8, 0.95, cycle_first_step_size=3)
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(33, generator=g)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=0.01, foreach=False)
    ours = fzero.adamw(0.01, betas=(mom, 0.99))
    p, state = p0.clone(), ours.init(p0)
    for t in range(8):
        grad = torch.randn(33, generator=g)
        opt.param_groups[0]["betas"] = (mom(t), 0.99)
        ref.grad = grad.clone()
        opt.step()
        p, state = ours.update(grad, state, p)
        assert torch.equal(p, ref.detach())

"""Lion and Adagrad (`fzero/optim/lion.py`, `fzero/optim/adagrad.py`).

Adagrad: bitwise `torch.optim.Adagrad(foreach=False)`, with parameter groups and schedules. Lion (DeepSpeed's,
which torch lacks): bitwise a numpy transcription of its formula in the module's operation order (each operation
rounded once: ISA-independent), and within a derived bound of the formula in float64, sign decisions compared on
their own. Both: the grouped path is the ungrouped path on each segment, a shard's update is the slice of the full
buffer's, donation changes nothing but where the result lives, the pure form leaves its inputs alone, zero padding
stays zero, the ZeRO stages agree, and bad hyper-parameters are refused by name.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.optim.adagrad import adagrad
from fzero.optim.groups import Segments, param_groups
from fzero.optim.lion import lion
from tests.bounds import U32, U64
from tests.support import mlp, regression_batches, regression_loss
from tests.test_groups import reference, run

dtypes = st.sampled_from([torch.float32, torch.float64])
shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)
seeds = st.integers(0, 2**16)

ADAGRAD = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-2, 0.1, 0.5]),
        "lr_decay": st.sampled_from([0.0, 0.01, 0.3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.2]),
        "initial_accumulator_value": st.sampled_from([0.0, 0.1, 1.0]),
        "eps": st.sampled_from([1e-10, 1e-6]),
    }
)
ADAGRAD_GROUP = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.sampled_from([3e-2, 0.3]),
        "lr_decay": st.sampled_from([0.0, 0.1]),
        "weight_decay": st.sampled_from([0.0, 0.05]),
        "eps": st.sampled_from([1e-10, 1e-3]),
    },
)
LION = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-4, 1e-3, 3e-2]),
        "betas": st.sampled_from([(0.9, 0.999), (0.9, 0.99), (0.95, 0.98), (0.0, 0.9)]),
        "weight_decay": st.sampled_from([0.0, 0.1, 1.0]),
    }
)
LION_GROUP = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.sampled_from([3e-4, 1e-2]),
        "betas": st.sampled_from([(0.8, 0.9), (0.95, 0.999)]),
        "weight_decay": st.sampled_from([0.0, 0.5]),
    },
)
MAKERS = {"lion": lion, "adagrad": adagrad}
BASE = {
    "lion": {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1},
    "adagrad": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
}
GROUP = {"lion": LION_GROUP, "adagrad": ADAGRAD_GROUP}


def gamma(k: int, u: float) -> float:
    """Higham's gamma_k = k u / (1 - k u): k roundings of unit roundoff u, each relative, compose within it."""
    return k * u / (1 - k * u)


def schedule(n: int) -> float:
    """A learning-rate schedule of the applied-update count (constant for three updates, then decaying)."""
    return 0.05 * min(n + 1, 3) / (1 + n)


def random_case(shape, steps, seed, dtype):
    """Parameters, `steps` gradients, and the mask of the elements that are not padding-like (about a third are:
    zero parameters with zero gradients throughout)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(shape, generator=g) > 1 / 3).to(dtype)
    p0 = torch.randn(shape, generator=g, dtype=dtype) * mask
    grads = [torch.randn(shape, generator=g, dtype=dtype) * mask for _ in range(steps)]
    return p0, grads, mask


# ---------------------------------------------------------------------------------------------------- Adagrad


@given(h=ADAGRAD, shape=shapes, steps=st.integers(1, 6), seed=seeds, dtype=dtypes, donate=st.booleans())
def test_adagrad_bitwise_torch(h, shape, steps, seed, dtype, donate):
    """`torch.optim.Adagrad(foreach=False)`'s parameters and sums, bitwise, every step."""
    p0, grads, _ = random_case(shape, steps, seed, dtype)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.Adagrad([ref], **h, foreach=False)
    ours = adagrad(**h)
    p, state = p0.clone(), ours.init(p0)
    for t, grad in enumerate(grads):
        ref.grad = grad.clone()
        opt.step()
        p, state = ours.update(grad, state, p, donate=donate)
        assert torch.equal(p, ref.detach()), f"step {t + 1}"
        assert torch.equal(state.sum, opt.state[ref]["sum"]), f"step {t + 1}"
    assert int(state.count) == steps


@given(base=ADAGRAD, over=ADAGRAD_GROUP, sizes=st.lists(st.integers(0, 9), min_size=3, max_size=3),
       steps=st.integers(1, 5), seed=seeds, dtype=dtypes, scheduled=st.booleans(), donate=st.booleans())  # fmt: skip
def test_adagrad_groups_bitwise_torch(base, over, sizes, steps, seed, dtype, scheduled, donate):
    """Two groups with different hyper-parameters (group 0's elements in two segments, either side of group 1's)
    equal torch's Adagrad with the same param_groups bitwise; with `scheduled`, group 1's lr is a schedule, which
    torch gets by writing the value into its group before each step."""
    n0, n1, n2 = sizes
    p0, grads, _ = random_case((n0 + n1 + n2,), steps, seed, dtype)
    pieces = [p0[:n0], p0[n0 : n0 + n1], p0[n0 + n1 :]]
    a, b, c = (x.clone().requires_grad_() for x in pieces)
    over = {**over, "lr": schedule} if scheduled else over
    const = {k: v for k, v in over.items() if not callable(v)}
    opt = torch.optim.Adagrad([{"params": [a, c]}, {"params": [b], **const}], **base, foreach=False)
    ours = adagrad(**base)
    segs = Segments((n0, n0 + n1, n0 + n1 + n2), (0, 1, 0), ({}, over))
    p, state = p0.clone(), ours.init(p0)
    for t, grad in enumerate(grads):
        if scheduled:
            opt.param_groups[1]["lr"] = schedule(t)
        for x, piece in zip((a, b, c), torch.split(grad, sizes), strict=True):
            x.grad = piece.clone()
        opt.step()
        p, state = ours.update(grad, state, p, donate=donate, segments=segs)
        assert torch.equal(p, torch.cat([a, b, c]).detach()), f"step {t + 1}"
        assert torch.equal(state.sum, torch.cat([opt.state[x]["sum"] for x in (a, b, c)])), f"step {t + 1}"


def test_adagrad_lr_schedule_bitwise_torch():
    """A schedule is a function of the applied-update count: the update after `n` updates uses `lr(n)`, as torch
    does when the value is written into its group before each step (lr_decay applies on top, as in torch)."""
    p0, grads, _ = random_case((37,), 6, 0, torch.float32)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.Adagrad([ref], lr=1.0, lr_decay=0.1, foreach=False)
    ours = adagrad(schedule, lr_decay=0.1)
    p, state = p0.clone(), ours.init(p0)
    for t, grad in enumerate(grads):
        opt.param_groups[0]["lr"] = schedule(t)
        ref.grad = grad.clone()
        opt.step()
        p, state = ours.update(grad, state, p)
        assert torch.equal(p, ref.detach()), f"step {t + 1}"


# ------------------------------------------------------------------------------------------------------- Lion


def lion_transcription(p, m, g, lr, b1, b2, wd, dtype):
    """Lion's formula in numpy, in the module's order, each operation rounded once to `dtype` (numpy rounds every
    ufunc call; the scalars rounded from double as torch rounds a Python float)."""
    f = np.float32 if dtype == torch.float32 else np.float64
    c = f(b1) * m + f(1 - b1) * g
    s = np.sign(c)
    if wd != 0:
        p = p * f(1 - lr * wd)
    p = p + f(-lr) * s  # lr * sign(c) is exact
    m = f(b2) * m + f(1 - b2) * g
    return p, m


@given(h=LION, shape=shapes, steps=st.integers(1, 8), seed=seeds, dtype=dtypes, donate=st.booleans(),
       scheduled=st.booleans())  # fmt: skip
def test_lion_bitwise_transcription(h, shape, steps, seed, dtype, donate, scheduled):
    """The numpy transcription, bitwise, on gradients of either sign, padding-like zeros, and elements whose
    gradient is chosen to make `c` vanish up to rounding (`g = -b1 m / (1 - b1)`: `c` is then 0, or a few ulp of
    either sign), so `sign(0) = 0` and the decisions at the edge are those of the transcription too."""
    p0, grads, _ = random_case(shape, steps, seed, dtype)
    b1, b2 = h["betas"]
    lr_of = schedule if scheduled else (lambda n: h["lr"])
    ours = lion(**({**h, "lr": schedule} if scheduled else h))
    p, state = p0.clone(), ours.init(p0)
    rp, rm = p0.numpy().copy(), np.zeros_like(p0.numpy())
    for t, grad in enumerate(grads):
        flat = grad.reshape(-1)
        if b1 > 0 and t > 0:
            k = flat.numel() // 4
            flat[:k] = -(b1 * state.exp_avg.reshape(-1)[:k]) / (1 - b1)
        rp, rm = lion_transcription(rp, rm, grad.numpy(), lr_of(t), b1, b2, h["weight_decay"], dtype)
        p, state = ours.update(grad, state, p, donate=donate)
        assert np.array_equal(p.numpy(), rp), f"step {t + 1}"
        assert np.array_equal(state.exp_avg.numpy(), rm), f"step {t + 1}"
    assert int(state.count) == steps


@given(h=LION, n=st.integers(1, 60), steps=st.integers(1, 8), seed=seeds)
def test_lion_float32_within_derived_bound_of_float64(h, n, steps, seed):
    """Float32 Lion against its formula run in float64, over several steps.

    Bound. With Higham's gamma_k = k u / (1 - k u), u = 2^-24: `m`'s update rounds two scalars, two products and
    a sum, so it lands within gamma_3 (b2 |m| + (1 - b2) |g|) <= gamma_3 G of the formula on its float32 inputs
    (G = max |g|, which bounds |m| too: a convex combination of gradients); b2 <= 1 carries the old error over
    unamplified, so after t steps |m - m64| <= t gamma_3 G. `c` likewise: |c - c64| <= b1 (t-1) gamma_3 G +
    gamma_3 G <= t gamma_3 G. `sign(c)` is then float64's wherever |c64| exceeds that; the data make it so: each
    element's gradients keep one sign with |g| in [0.5, 1.5], so |c| >= (1 - b1) |g| >= 0.025 against
    8 gamma_4 G ~ 1e-6 (asserted below), or are 0 throughout (c = 0 exactly in both runs). With the same signs,
    `p`'s update rounds the decay scalar, a product, `lr` and a sum (`lr * sign` is otherwise exact): within
    gamma_3 (d |p| + lr), with d = 1 - lr wd in [0, 1] carrying the old error over unamplified, so
    |p - p64| <= t gamma_3 (P + lr), P the largest |p| on the way. gamma_4 stands for gamma_3 to absorb the
    second-order terms (the errors' own contribution to |m|, |p|), and the float64 run's own error, the same with
    u = 2^-53, is added."""
    b1, b2 = h["betas"]
    lr, wd = h["lr"], h["weight_decay"]
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 3, (n,), generator=g).double() - 1  # -1, 0 (zero gradients) or 1 per element
    p0 = torch.randn(n, generator=g).double()
    grads = [sign * (0.5 + torch.rand(n, generator=g).double()) for _ in range(steps)]
    ours = lion(**h)
    p, state = p0.float(), ours.init(p0.float())
    p64, m64 = p0.clone(), torch.zeros(n, dtype=torch.float64)
    big_g, big_p = max(x.abs().max().item() for x in grads), p0.abs().max().item()
    for t, grad in enumerate(grads, start=1):
        grad32 = grad.float()
        grad = grad32.double()  # both runs see the same gradients
        c64 = b1 * m64 + (1 - b1) * grad
        margin = t * (gamma(4, U32) + gamma(4, U64)) * big_g
        assert (c64[sign != 0].abs() > margin).all() and (c64[sign == 0] == 0).all()  # the decisions are exact
        p64 = p64 * (1 - lr * wd) - lr * torch.sign(c64)
        m64 = b2 * m64 + (1 - b2) * grad
        p, state = ours.update(grad32, state, p)
        big_p = max(big_p, p64.abs().max().item())
        assert (p.double() - p64).abs().max().item() <= t * (gamma(4, U32) + gamma(4, U64)) * (big_p + lr)
        assert (state.exp_avg.double() - m64).abs().max().item() <= margin


@given(h=LION, n=st.integers(1, 80), seed=seeds)
def test_lion_sign_decisions(h, n, seed):
    """One float32 step from any state (momentum and gradient of either sign; a quarter of the elements with `c`
    within rounding of 0) against the formula in float64 on the same inputs, element by element.

    By the bounds of `test_lion_float32_within_derived_bound_of_float64` for one step: c32 is within
    e_c = gamma_3 (b1 |m| + (1 - b1) |g|) of c64 (plus float64's own), so where |c64| > e_c float32's sign is
    float64's; there the parameter is within gamma_3 (d |p| + lr) of float64's. Where the decision is within
    rounding, float32's own sign (0 included) is the one applied, and the parameter is within that bound of
    float64's step with that sign. The momentum is within gamma_3 (b2 |m| + (1 - b2) |g|) everywhere."""
    b1, b2 = h["betas"]
    lr, wd = h["lr"], h["weight_decay"]
    g = torch.Generator().manual_seed(seed)
    p0, m0, grad = (torch.randn(n, generator=g) for _ in range(3))
    k = n // 4
    if b1 > 0:
        grad[:k] = -(b1 * m0[:k]) / (1 - b1)
    else:
        grad[:k] = 0.0
    ours = lion(**h)
    p, state = ours.update(grad, ours.init(p0)._replace(exp_avg=m0.clone()), p0)
    p0_, m0_, g_ = p0.double(), m0.double(), grad.double()
    e = gamma(3, U32) + gamma(3, U64)
    c64 = b1 * m0_ + (1 - b1) * g_
    decisive = c64.abs() > e * (b1 * m0_.abs() + (1 - b1) * g_.abs())
    s32 = torch.sign(b1 * m0 + (1 - b1) * grad)  # (recomputed; the parameters below confirm it was the one applied)
    assert torch.equal(s32[decisive].double(), torch.sign(c64[decisive]))
    d = 1 - lr * wd
    p64 = d * p0_ - lr * s32.double()
    assert ((p.double() - p64).abs() <= e * (abs(d) * p0_.abs() + lr)).all()
    m64 = b2 * m0_ + (1 - b2) * g_
    assert ((state.exp_avg.double() - m64).abs() <= e * (b2 * m0_.abs() + (1 - b2) * g_.abs())).all()


def test_lion_sign_of_zero_is_zero():
    """`c == 0` moves nothing (DeepSpeed's CUDA kernel would move it by +lr, its CPU kernel by -lr), `c > 0`
    by -lr, `c < 0` by +lr; decay applies to all."""
    opt = lion(lr=0.5, betas=(0.5, 0.9), weight_decay=0.2)
    p = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    state = opt.init(p)._replace(exp_avg=torch.tensor([2.0, -2.0, 2.0], dtype=torch.float64))
    p, _ = opt.update(torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64), state, p)  # c = 1.5, -0.5, 0
    assert p.tolist() == [0.9 - 0.5, 0.9 + 0.5, 0.9]


# ------------------------------------------------------------------------------------------------------- both


@st.composite
def grouped_case(draw, which):
    """A segment table over 1-5 segments in groups 0-2 (group 2's lr a schedule), and the overrides."""
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=5))
    labels = [draw(st.integers(0, 2)) for _ in sizes]
    overrides = ({}, draw(GROUP[which]), {**draw(GROUP[which]), "lr": schedule})
    ends = tuple(int(x) for x in np.cumsum(sizes))
    return Segments(ends, tuple(labels), overrides)


def state_of(state):
    """The state's tensors (its `count` aside)."""
    return list(state[1:])


@given(data=st.data(), which=st.sampled_from(sorted(MAKERS)), steps=st.integers(1, 4), seed=seeds, dtype=dtypes,
       donate=st.booleans())  # fmt: skip
def test_groups_path_is_the_ungrouped_path_per_segment(data, which, steps, seed, dtype, donate):
    """Each segment of a grouped update equals, bitwise, the ungrouped optimizer built with that segment's group's
    hyper-parameters, run on that segment alone."""
    segs = data.draw(grouped_case(which))
    p0, grads, _ = random_case((segs.numel,), steps, seed, dtype)
    ours = MAKERS[which](**BASE[which])
    per_group = [MAKERS[which](**{**BASE[which], **o}) for o in segs.overrides]
    p, state = p0.clone(), ours.init(p0)
    bounds = list(zip((0, *segs.ends), segs.ends, segs.group, strict=False))
    alone = [(per_group[k], p0[a:b].clone(), per_group[k].init(p0[a:b])) for a, b, k in bounds]
    for t, grad in enumerate(grads):
        p, state = ours.update(grad, state, p, donate=donate, segments=segs)
        for i, (a, b, _) in enumerate(bounds):
            opt, q, s = alone[i]
            q, s = opt.update(grad[a:b], s, q)
            alone[i] = (opt, q, s)
            assert torch.equal(p[a:b], q), f"step {t + 1}, segment {i}"
            assert all(torch.equal(x[a:b], y) for x, y in zip(state_of(state), state_of(s), strict=True))


@given(data=st.data(), which=st.sampled_from(sorted(MAKERS)), steps=st.integers(1, 4), seed=seeds, dtype=dtypes,
       grouped=st.booleans())  # fmt: skip
def test_shard_update_is_the_slice_of_the_full_update(data, which, steps, seed, dtype, grouped):
    """Any slice `[a, b)` updated alone (with the slice of the segment table when grouped) equals the same slice of
    the full buffer's update, bitwise: every operation is elementwise and rounds once, wherever the element lies
    (vectorised body or scalar tail)."""
    segs = data.draw(grouped_case(which)) if grouped else None
    n = segs.numel if segs is not None else data.draw(st.integers(0, 90))
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    p0, grads, _ = random_case((n,), steps, seed, dtype)
    ours = MAKERS[which](**BASE[which])
    p, state = p0.clone(), ours.init(p0)
    q, shard_state = p0[a:b].clone(), ours.init(p0[a:b])
    shard_segs = segs.slice(a, b) if segs is not None else None
    for t, grad in enumerate(grads):
        p, state = ours.update(grad, state, p, segments=segs)
        q, shard_state = ours.update(grad[a:b].clone(), shard_state, q, segments=shard_segs)
        assert torch.equal(p[a:b], q), f"step {t + 1}"
        assert all(torch.equal(x[a:b], y) for x, y in zip(state_of(state), state_of(shard_state), strict=True))


@given(data=st.data(), which=st.sampled_from(sorted(MAKERS)), n=st.integers(0, 50), steps=st.integers(1, 4),
       seed=seeds, dtype=dtypes, grouped=st.booleans())  # fmt: skip
def test_donation_changes_nothing_but_where_the_result_lives(data, which, n, steps, seed, dtype, grouped):
    """`donate=True` gives `donate=False`'s values bitwise, in the parameters' and state's own storage; the pure
    form leaves its parameters, gradients and state untouched."""
    segs = data.draw(grouped_case(which)) if grouped else None
    n = segs.numel if segs is not None else n
    p0, grads, _ = random_case((n,), steps, seed, dtype)
    ours = MAKERS[which](**BASE[which])
    p, state = p0.clone(), ours.init(p0)
    q, donated = p0.clone(), ours.init(p0)
    for grad in grads:
        before = [p.clone(), grad.clone(), *(x.clone() for x in state_of(state))]
        new_p, new_state = ours.update(grad, state, p, segments=segs)
        assert all(torch.equal(x, y) for x, y in zip([p, grad, *state_of(state)], before, strict=True))
        assert int(state.count) == int(new_state.count) - 1
        storage = [q.data_ptr(), *(x.data_ptr() for x in state_of(donated))]
        q, donated = ours.update(grad, donated, q, donate=True, segments=segs)
        if n:
            assert [q.data_ptr(), *(x.data_ptr() for x in state_of(donated))] == storage
        p, state = new_p, new_state
        assert torch.equal(p, q) and all(
            torch.equal(x, y) for x, y in zip(state_of(state), state_of(donated), strict=True)
        )


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda: lion(lr=0.1, weight_decay=0.5),
        lambda: lion(lr=0.1, betas=(0.0, 0.5)),
        lambda: adagrad(lr=0.5, lr_decay=0.1, weight_decay=0.3, initial_accumulator_value=0.5),
        lambda: adagrad(lr=0.5, weight_decay=0.3),
        lambda: adagrad(lr=0.5, initial_accumulator_value=2.0, eps=1e-30),
    ],
)
def test_zero_padding_stays_zero(make, grouped):
    """Zero parameters with zero gradients (a flat buffer's padding) stay exactly zero, step after step, with
    weight decay and a nonzero initial accumulator; the other elements move."""
    ours = make()
    p0, grads, mask = random_case((64,), 5, 1, torch.float32)
    segs = Segments((20, 40, 64), (0, 1, 0), ({}, {"lr": 0.01})) if grouped else None
    p, state = p0.clone(), ours.init(p0)
    for grad in grads:
        p, state = ours.update(grad, state, p, segments=segs)
        assert torch.equal(p[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (p[mask == 1] != p0[mask == 1]).all()


def test_adagrad_padding_stays_zero_with_zero_sums():
    """Resharding a checkpoint refills the new padding's running sums with 0 (not `initial_accumulator_value`):
    with `eps > 0` (required) a zero gradient there still moves nothing (`0 / eps = 0`)."""
    ours = adagrad(lr=0.5, initial_accumulator_value=0.5, eps=1e-10, weight_decay=0.1)
    p0, grads, mask = random_case((64,), 4, 2, torch.float32)
    p, state = p0.clone(), ours.init(p0)
    state = state._replace(sum=state.sum * mask)
    for grad in grads:
        p, state = ours.update(grad, state, p)
        assert torch.equal(p[mask == 0], torch.zeros(int((mask == 0).sum())))


# --------------------------------------------------------------------------------------------- the ZeRO stages


class TorchLion(torch.optim.Optimizer):
    """Lion per tensor, as a `torch.optim` optimizer: the module's formula in its order (the reference at world 1)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = torch.mul(m, b1).add_(torch.mul(p.grad, 1 - b1)).sign_()
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(c, alpha=-lr)
                m.mul_(b2).add_(torch.mul(p.grad, 1 - b2))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("which", sorted(MAKERS))
@settings(max_examples=3)
@given(seed=seeds, data=st.data())
def test_zero_stages_agree(which, world, seed, data):
    """Stages 0-3 with random parameter groups, at world 1-3, one micro-step: bitwise each other (the same reduced
    gradients, elementwise updates on shards cut anywhere), and at world 1 bitwise torch's Adagrad / a per-tensor
    Lion with the same groups."""
    model = mlp([4, 5, 3], seed, torch.float64)
    names = [n for n, _ in model.named_parameters()]
    values = [data.draw(GROUP[which]) for _ in range(2)]
    label = [data.draw(st.integers(0, 1)) for _ in names]
    groups = [([n for n, k in zip(names, label, strict=True) if k == i], values[i]) for i in range(2)]
    batches = regression_batches(model, world, 1, 2, 3, seed + 1)
    opt = MAKERS[which](**BASE[which], groups=param_groups(groups=groups))
    presets = ("zero0", "zero1", "zero2", "zero3")
    got = {p: fzero.state_dict(run(model, regression_loss, batches, world, 1, p, opt)) for p in presets}
    first = got["zero0"]
    for name, sd in got.items():
        assert sd.keys() == first.keys() and all(torch.equal(sd[k], first[k]) for k in first), name
    if world == 1:
        make = (lambda g: torch.optim.Adagrad(g, **BASE[which], foreach=False)) if which == "adagrad" else (
            lambda g: TorchLion(g, **BASE[which]))  # fmt: skip
        ref = reference(copy.deepcopy(model), regression_loss, batches, 1, groups, make)
        assert all(torch.equal(first[k], ref[k]) for k in ref)


# ------------------------------------------------------------------------------------------------------ errors


def test_lion_hyper_parameter_errors():
    with pytest.raises(ValueError, match="invalid learning rate: -1"):
        lion(-1.0)
    with pytest.raises(ValueError, match="beta parameter at index 0"):
        lion(betas=(-0.1, 0.99))
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        lion(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="betas must be a pair"):
        lion(betas=(0.9,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid weight_decay value: -0.1"):
        lion(weight_decay=-0.1)
    with pytest.raises(TypeError, match="learning rate must be a float"):
        lion("0.1")  # type: ignore[arg-type]
    lion(betas=(1.0, 1.0))  # the closed end is allowed
    opt = lion(groups=param_groups({"w": {"lr": 1e-2}}))
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        opt.check(opt.group_hypers({"betas": (0.9, 2.0)}))


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("lr", "learning rate"),
        ("lr_decay", "lr_decay value"),
        ("weight_decay", "weight_decay value"),
        ("initial_accumulator_value", "initial_accumulator_value value"),
        ("eps", "epsilon value"),
    ],
)
def test_adagrad_negative_hyper_parameter_named(key, name):
    """torch's rule (every hyper-parameter >= 0), with its names."""
    with pytest.raises(ValueError, match=f"invalid {name}: -1"):
        adagrad(**{key: -1.0})


def test_adagrad_hyper_parameter_errors():
    with pytest.raises(ValueError, match=r"invalid epsilon value: 0.0 \(expected > 0"):
        adagrad(eps=0.0, initial_accumulator_value=0.1)  # (resharding refills the padding's sums with 0)
    with pytest.raises(TypeError, match="lr_decay must be a float"):
        adagrad(lr_decay=lambda n: 0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="learning rate must be a float"):
        adagrad("0.1")  # type: ignore[arg-type]
    opt = adagrad(initial_accumulator_value=0.1)
    opt.check(opt.group_hypers({"initial_accumulator_value": 0.1, "lr": 0.5}))  # torch groups carry every key
    with pytest.raises(ValueError, match="initial_accumulator_value 0.5 differs from the optimizer's 0.1"):
        opt.check(opt.group_hypers({"initial_accumulator_value": 0.5}))
    with pytest.raises(ValueError, match="invalid epsilon value: 0"):
        opt.check(opt.group_hypers({"eps": 0.0}))

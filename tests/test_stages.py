"""Stage equivalence: zero0..zero3 on a SimMesh against plain single-process torch.optim.AdamW on the full batch,
and bitwise against each other wherever the arithmetic is the same (docs/equivalence.md has the table)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.bounds import assert_adam_close, max_diff
from tests.support import lm_batches, lm_loss, mlp, reference_run, regression_batches, regression_loss, tiny_gpt

PRESETS = {"zero0": fzero.zero0, "zero1": fzero.zero1, "zero2": fzero.zero2, "zero3": fzero.zero3}
LR = 1e-2
STEPS = 3

# float64 tolerance, derived: reordering the sum of W*k <= 12 gradient terms changes a gradient element by at most
# 12 * u * G (u = 1.1e-16, |terms| G <= 10 here); Adam's update lr * m / (sqrt(v) + eps) changes by at most
# lr * that / eps = 1e-2 * 1.3e-14 / 1e-8 = 1.3e-8 per step in the worst (|g| ~ eps) case. Observed: <= 1e-14.
# A real bug (a wrong mean, a shifted shard) moves parameters by ~lr = 1e-2.
ATOL64 = 1.3e-8 * STEPS


def run(model, loss_of, batches, world, micro, preset, opt=None, donate=False, autodiff="autograd"):
    mesh = fzero.SimMesh(world=world)
    tx = PRESETS[preset](opt or fzero.adamw(LR), accumulate=micro)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh, donate=donate, autodiff=autodiff)
    for batch in batches:
        state, _ = step(state, batch)
    return fzero.state_dict(state)


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_family(model, loss_of, batches, world, micro):
    ref = reference_run(model, loss_of, batches, micro, lambda p: torch.optim.AdamW(p, lr=LR))
    out = {name: run(model, loss_of, batches, world, micro, name) for name in PRESETS}
    for name, sd in out.items():
        assert max_diff(sd, ref) <= ATOL64, (name, max_diff(sd, ref))
    # Bitwise: the per-element arithmetic is identical (rank-ordered sum / W, elementwise AdamW) ...
    assert equal(out["zero0"], out["zero1"])
    assert equal(out["zero2"], out["zero3"])
    # ... and across the pairs when there is no accumulation; with accumulation stages 0/1 sum micro-steps
    # before ranks and stages 2/3 ranks before micro-steps.
    if micro == 1:
        assert equal(out["zero1"], out["zero2"])
    if world == 1 and micro == 1:
        assert equal(out["zero0"], ref)  # one rank, one micro-step: the very same kernels as torch


@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    world=st.integers(1, 4),
    micro=st.integers(1, 3),
    per_rank=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_mlp_stages_match_reference(widths, world, micro, per_rank, seed):
    model = mlp(widths, seed, torch.float64)
    batches = regression_batches(model, world, micro, per_rank, STEPS, seed + 1)
    check_family(model, regression_loss, batches, world, micro)


# (each example trains every preset: fewer than the profile's; the MLP test above varies the shapes more)
@settings(max_examples=min(10, settings.default.max_examples))
@given(world=st.integers(1, 4), micro=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_transformer_stages_match_reference(world, micro, seed):
    model = tiny_gpt(seed, torch.float64)
    batches = lm_batches(model, world, micro, 2, STEPS, seed + 1)
    check_family(model, lm_loss, batches, world, micro)


def test_transformer_fp32_within_stated_tolerance():
    """float32, where no reordering bound is useful: Adam's step bound per element and the detection threshold in
    aggregate (tests/bounds.py, kind 3)."""
    model = tiny_gpt(3)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = lm_batches(model, 3, 2, 2, STEPS, 4)
    ref = reference_run(model, lm_loss, batches, 2, lambda p: torch.optim.AdamW(p, lr=LR))
    for name in PRESETS:
        assert_adam_close(run(model, lm_loss, batches, 3, 2, name), ref, start, LR, STEPS)


@given(world=st.integers(1, 3), micro=st.integers(1, 2), seed=st.integers(0, 1000))
def test_other_optimizers_match_torch(world, micro, seed):
    model = mlp([4, 6, 2], seed, torch.float64)
    batches = regression_batches(model, world, micro, 2, STEPS, seed)
    cases = [
        (fzero.adam(LR, weight_decay=0.1), lambda p: torch.optim.Adam(p, lr=LR, weight_decay=0.1)),
        (
            fzero.sgd(LR, momentum=0.9, nesterov=True, weight_decay=0.01),
            lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True, weight_decay=0.01),
        ),
    ]
    for ours, theirs in cases:
        ref = reference_run(model, regression_loss, batches, micro, theirs)
        for name in ("zero0", "zero2", "zero3"):
            assert max_diff(run(model, regression_loss, batches, world, micro, name, opt=ours), ref) <= ATOL64


@given(preset=st.sampled_from(sorted(PRESETS)), world=st.integers(1, 3), micro=st.integers(1, 3))
def test_donation_gives_the_same_parameters(preset, world, micro):
    model = mlp([3, 5, 2], world, torch.float32)
    batches = regression_batches(model, world, micro, 2, STEPS, micro)
    a = run(model, regression_loss, batches, world, micro, preset)
    b = run(model, regression_loss, batches, world, micro, preset, donate=True)
    assert equal(a, b)


@given(
    preset=st.sampled_from(sorted(PRESETS)), world=st.integers(1, 3), micro=st.integers(1, 2), seed=st.integers(0, 99)
)
def test_func_and_autograd_engines_agree_bitwise(preset, world, micro, seed):
    model = tiny_gpt(seed)
    batches = lm_batches(model, world, micro, 2, 2, seed)
    a = run(model, lm_loss, batches, world, micro, preset, autodiff="autograd")
    b = run(model, lm_loss, batches, world, micro, preset, autodiff="func")
    assert equal(a, b)


@given(preset=st.sampled_from(sorted(PRESETS)), micro=st.integers(1, 3))
def test_input_state_is_never_mutated(preset, micro):
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(world=2)
    tx = PRESETS[preset](fzero.adamw(LR), accumulate=micro)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    state = fzero.init(model, tx, mesh)
    for batch in regression_batches(model, 2, micro, 2, 2, 0):
        before = fzero.pytree.leaves(state)
        snapshot = [t.clone() for t in before]
        new, _ = step(state, batch)
        assert all(torch.equal(t, s) for t, s in zip(before, snapshot, strict=False))
        assert fzero.pytree.structure(new) == fzero.pytree.structure(state)
        state = new


def test_model_is_never_touched():
    model = mlp([3, 4, 2], 0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    out = run(model, regression_loss, regression_batches(model, 2, 1, 2, 2, 0), 2, 1, "zero3")
    assert equal(model.state_dict(), original)
    assert not equal(out, original)


def test_non_boundary_micro_steps_do_no_optimizer_work():
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(world=2)
    for preset, comm_between in [("zero1", {}), ("zero2", {"reduce_scatter"})]:
        tx = PRESETS[preset](fzero.adamw(LR), accumulate=3)
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, regression_loss(model), tx, mesh)
        batches = regression_batches(model, 2, 3, 2, 1, 0)
        for i, batch in enumerate(batches):
            params = state.params
            state, metrics = step(state, batch)
            boundary = i == 2
            assert metrics["applied"] is boundary
            opt_state = fzero.transforms.lookup(state.tx_state, "shard_update")
            assert int(opt_state.count) == (1 if boundary else 0)
            assert (state.params is params) is not boundary
            if not boundary:  # the window's first micro-step gathers the parameters (kept for the rest)
                gathers = {"all_gather"} if i == 0 else set()
                assert set(metrics["comm"]) - {"all_reduce"} == set(comm_between) | gathers


def test_frozen_parameters_and_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    batches = regression_batches(model, 1, 1, 5, 3, 0)
    ref = reference_run(
        model, regression_loss, batches, 1, lambda p: torch.optim.AdamW([q for q in p if q.requires_grad], lr=LR)
    )
    for name in PRESETS:
        out = run(model, regression_loss, batches, 1, 1, name)
        assert torch.equal(out["0.weight"], frozen)
        assert equal(out, ref), name  # running statistics included
        assert int(out["1.num_batches_tracked"]) == 3


def test_tied_weights_stay_tied_and_load():
    model = tiny_gpt(0)
    out = run(model, lm_loss, lm_batches(model, 2, 1, 2, 2, 0), 2, 1, "zero3")
    assert torch.equal(out["head.weight"], out["wte.weight"])
    fresh = tiny_gpt(1)
    fresh.load_state_dict(out)
    assert fresh.head.weight is fresh.wte.weight

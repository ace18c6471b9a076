"""Loss scaling and non-finite steps against a reference model of DeepSpeed's dynamic loss scaler."""

from __future__ import annotations

import math
from unittest import mock

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.state.loss_scale import DynamicLossScale, make_loss_scale
from fzero.transforms import stats
from tests.support import mlp, regression_batches
from tests.test_stages import PRESETS


class DeepSpeedScaler:
    """DeepSpeed 0.19's `DynamicLossScaler.update_scale`, written out from its source (runtime/fp16/loss_scaler.py)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale, self.scale_window, self.min_scale = init_scale, scale_window, min_scale
        self.delayed_shift, self.cur_hysteresis = delayed_shift, delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore.")
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


def patterns():
    n = st.integers(1, 60)
    none = n.map(lambda k: [False] * k)
    every = n.map(lambda k: [True] * k)
    rand = st.lists(st.booleans(), min_size=1, max_size=60)
    bursts = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=6).map(
        lambda runs: [x for ok, bad in runs for x in [False] * ok + [True] * bad]
    )  # bursts of overflows, some longer than the hysteresis
    return st.one_of(none, every, rand, bursts)


configs = st.fixed_dictionaries(
    {
        "initial_scale_power": st.integers(2, 16),
        "loss_scale_window": st.integers(1, 8),
        "hysteresis": st.integers(1, 4),
        "consecutive_hysteresis": st.booleans(),
        "min_loss_scale": st.sampled_from([0.25, 1.0, 4.0]),
    }
)


def reference_sequence(cfg, overflows):
    ref = DeepSpeedScaler(2.0 ** cfg["initial_scale_power"], cfg["loss_scale_window"], cfg["min_loss_scale"],
                          cfg["hysteresis"], cfg["consecutive_hysteresis"])  # fmt: skip
    scales = []
    for overflow in overflows:
        scales.append(ref.cur_scale)
        try:
            ref.update_scale(overflow)
        except Exception:
            return scales, True
    return scales, False


@given(cfg=configs, overflows=patterns())
def test_adjust_follows_deepspeed(cfg, overflows):
    want, raises = reference_sequence(cfg, overflows)
    ls = DynamicLossScale.create(**cfg)
    got = []
    try:
        for overflow in overflows:
            got.append(ls.loss_scale)
            ls = ls.adjust(not overflow)
        assert not raises
    except fzero.LossScaleError as e:
        assert raises
        assert "already at minimum" in str(e) and "Lower the learning rate" in str(e)
    assert got == want


@given(cfg=configs, overflows=patterns(), preset=st.sampled_from(sorted(PRESETS)))
def test_training_scale_sequence_skips_and_step_count(cfg, overflows, preset):
    """Overflows injected into real training (an inf loss on one rank): the scale sequence, the skipped steps and
    the optimizer's step count are DeepSpeed's."""
    want, raises = reference_sequence(cfg, overflows)
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(2)
    tx = PRESETS[preset](fzero.adamw(1e-3), loss_scale=DynamicLossScale.create(**cfg))
    loss_fn = poisoned_loss(model)
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, loss_fn, tx, mesh)
    scales, skipped = [], 0
    batches = regression_batches(model, 2, 1, 2, len(overflows), 0)
    try:
        for batch, overflow in zip(batches, overflows, strict=True):
            batch["poison"] = torch.tensor([1.0, math.inf if overflow else 1.0])  # rank 1 only
            state, metrics = step(state, batch)
            scales.append(metrics["loss_scale"])
            skipped += metrics["skipped"]
            assert metrics["applied"] is not overflow
    except fzero.LossScaleError:
        assert raises
        scales.append(fzero.transforms.current_loss_scale(state.tx_state).loss_scale)
    assert scales == want
    opt = fzero.transforms.lookup(state.tx_state, "shard_update")
    assert skipped == sum(overflows[: len(scales) - raises])
    assert int(opt.count) == len(scales) - raises - skipped


def poisoned_loss(model):
    def loss_fn(params, batch):
        x = batch["x"].to(next(iter(params.values())).dtype)  # bf16 parameters take bf16 inputs
        out = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.mse_loss(out.float(), batch["y"]) * batch["poison"]

    return loss_fn


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_inf_on_one_rank_skips_everywhere(preset, precision):
    model = mlp([3, 5, 2], 1)
    mesh = fzero.SimMesh(3)
    tx = PRESETS[preset](fzero.adamw(1e-2), precision=precision)
    step = fzero.train_step(model, poisoned_loss(model), tx, mesh)
    b = regression_batches(model, 3, 1, 2, 3, 1)
    for i, batch in enumerate(b):
        batch["poison"] = torch.tensor([1.0, 1.0, math.inf if i == 1 else 1.0])
    clean = fzero.init(model, tx, mesh)
    state, _ = step(clean, b[0])
    before = [t.clone() for t in fzero.pytree.leaves(state)]
    after, metrics = step(state, b[1])
    assert metrics["skipped"] and not metrics["applied"] and not math.isfinite(metrics["grad_norm"])
    # nothing changed on any rank: parameters, optimizer state (its step count included), compute copy
    assert torch.equal(after.params, state.params) and torch.equal(after.compute, state.compute)
    assert all(
        torch.equal(a, b_)
        for a, b_ in zip(fzero.pytree.leaves(after.tx_state), fzero.pytree.leaves(state.tx_state), strict=True)
    )
    assert all(torch.equal(t, s) for t, s in zip(fzero.pytree.leaves(state), before, strict=True))
    # the next finite step proceeds as if the bad batch had never come
    resumed, m = step(after, b[2])
    direct, _ = step(state, b[2])
    assert m["applied"] and torch.equal(resumed.params, direct.params)


@given(preset=st.sampled_from(sorted(PRESETS)), world=st.integers(2, 4), split=st.booleans(), data=st.data())
def test_one_non_finite_element_anywhere_skips_everywhere(preset, world, split, data):
    """One inf gradient element, in any parameter, from any one rank, skips the step on every rank: the ranks'
    statistics cover every element once, whichever part of the buffer each sums (at stage 0, with `split`, its
    1/world of the reduced gradient, as from `SPLIT_STATS_ELEMENTS` on)."""
    model = mlp([3, 5, 2], 2)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    name = data.draw(st.sampled_from(sorted(sizes)))
    index, rank = data.draw(st.integers(0, sizes[name] - 1)), data.draw(st.integers(0, world - 1))

    def loss_fn(params, batch):
        out = torch.func.functional_call(model, params, (batch["x"],))
        # d/dp of p * poison is poison: inf in one element of one rank's gradient, finite elsewhere
        return torch.nn.functional.mse_loss(out, batch["y"]) + params[name].reshape(-1)[index] * batch["poison"]

    mesh = fzero.SimMesh(world)
    tx = PRESETS[preset](fzero.adamw(1e-2))
    state = fzero.init(model, tx, mesh)
    batch = regression_batches(model, world, 1, 2, 1, 3)[0]
    batch["poison"] = torch.tensor([math.inf if r == rank else 0.0 for r in range(world)])
    with mock.patch.object(stats, "SPLIT_STATS_ELEMENTS", 0 if split else stats.SPLIT_STATS_ELEMENTS):
        after, metrics = fzero.train_step(model, loss_fn, tx, mesh)(state, batch)
    assert metrics["skipped"] and not metrics["applied"] and not math.isfinite(metrics["grad_norm"])
    assert torch.equal(after.params, state.params)


def test_skip_can_be_disabled():
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(2)
    tx = fzero.zero2(fzero.adamw(1e-2), skip_nonfinite=False)
    batch = regression_batches(model, 2, 1, 2, 1, 0)[0]
    batch["poison"] = torch.tensor([1.0, math.inf])
    state, metrics = fzero.train_step(model, poisoned_loss(model), tx, mesh)(fzero.init(model, tx, mesh), batch)
    assert metrics["applied"] and not metrics["skipped"] and not torch.isfinite(state.params).all()


def test_loss_scale_values_survive_pytree_round_trips():
    # every field non-default: jmp loses min_loss_scale through tree_map
    ls = DynamicLossScale.create(initial_scale_power=5, loss_scale_window=7, hysteresis=3, consecutive_hysteresis=True,
                                 min_loss_scale=0.5, raise_error_at_min_scale=False)  # fmt: skip
    ls = ls.adjust(False).adjust(True)
    for mapped in (optree.tree_map(lambda x: x.clone(), ls, namespace="fzero"),
                   torch_pytree.tree_map(lambda x: x.clone(), ls)):  # fmt: skip
        assert mapped == ls
        assert (mapped.min_loss_scale, mapped.scale_window, mapped.hysteresis) == (0.5, 7, 3)
        assert mapped.consecutive_hysteresis and not mapped.raise_error_at_min_scale
    static = make_loss_scale(128.0)
    assert optree.tree_map(lambda x: x, static, namespace="fzero").loss_scale == 128.0


def test_scale_and_unscale():
    ls = make_loss_scale("dynamic", initial_scale_power=3)
    assert float(ls.scale(torch.tensor(2.0))) == 16.0
    assert torch.equal(ls.unscale({"g": torch.tensor([8.0])})["g"], torch.tensor([1.0]))
    assert make_loss_scale(None).scale(torch.tensor(3.0)) == 3.0
    with pytest.raises(ValueError, match="loss_scale must be 'none', 'dynamic', a positive number"):
        make_loss_scale(-1.0)
    with pytest.raises(ValueError, match="hysteresis must be an int >= 1, got 0"):
        DynamicLossScale.create(hysteresis=0)


def test_no_error_at_minimum_when_asked():
    ls = DynamicLossScale.create(initial_scale_power=0, hysteresis=1, raise_error_at_min_scale=False)
    assert ls.adjust(False).loss_scale == 1.0

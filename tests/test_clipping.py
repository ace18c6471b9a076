"""Global-norm clipping equals torch.nn.utils.clip_grad_norm_ on the unsharded reference, for every stage."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.transforms import stats
from tests.support import lm_batches, lm_loss, tiny_gpt
from tests.test_stages import PRESETS, max_diff


def reference(model, batches, micro, max_norm, lr):
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    loss_fn, norms = lm_loss(ref), []
    for i in range(0, len(batches), micro):
        group = batches[i : i + micro]
        full = {k: torch.cat([b[k].flatten(0, 1) for b in group]) for k in group[0]}
        opt.zero_grad()
        loss_fn(dict(ref.named_parameters()), full).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        opt.step()
    return ref.state_dict(), norms


@given(world=st.integers(1, 4), micro=st.integers(1, 2), max_norm=st.sampled_from([0.05, 0.3, 100.0]),
       seed=st.integers(0, 999), split=st.booleans())  # fmt: skip
def test_clipping_matches_torch(world, micro, max_norm, seed, split):
    """`split`: stage 0's ranks each sum the squares of their part of the whole gradient, as from
    `SPLIT_STATS_ELEMENTS` on."""
    with mock.patch.object(stats, "SPLIT_STATS_ELEMENTS", 0 if split else stats.SPLIT_STATS_ELEMENTS):
        _clipping_matches_torch(world, micro, max_norm, seed)


def _clipping_matches_torch(world, micro, max_norm, seed):
    model = tiny_gpt(seed, torch.float64)
    batches = lm_batches(model, world, micro, 2, 3, seed)
    want, want_norms = reference(model, batches, micro, max_norm, 1e-2)
    for preset in PRESETS:
        mesh = fzero.SimMesh(world)
        tx = PRESETS[preset](fzero.adamw(1e-2), accumulate=micro, clip=max_norm)
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
        norms = []
        for batch in batches:
            state, metrics = step(state, batch)
            if metrics["applied"]:
                norms.append(metrics["grad_norm"])
        # float64: the norm differs from torch's only by summation order (~1e-15 relative); parameters as in
        # test_stages (the clipping coefficient moves by as little as the norm does)
        assert norms == pytest.approx(want_norms, rel=1e-12)
        assert max_diff(fzero.state_dict(state), want) <= 1e-8


def test_clip_factor_reaches_the_gradients_once():
    """Clipping below the norm changes the update; clipping far above it is bitwise a no-op."""
    model = tiny_gpt(0)
    batches = lm_batches(model, 2, 1, 2, 2, 0)
    runs = {}
    for clip in (None, 1e6, 1e-3):
        mesh = fzero.SimMesh(2)
        tx = fzero.zero2(fzero.sgd(0.1), clip=clip)
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
        for batch in batches:
            state, _metrics = step(state, batch)
        runs[clip] = fzero.state_dict(state)
    assert all(torch.equal(runs[None][k], runs[1e6][k]) for k in runs[None])
    assert max_diff(runs[1e-3], runs[None]) > 1e-3


def test_clip_needs_reduced_gradients():
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(2)
    tx = fzero.chain(fzero.clip_by_global_norm(1.0), fzero.reduce_scatter(), fzero.shard_update(fzero.adamw()))
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
    with pytest.raises(ValueError, match=r"clip_by_global_norm\(\) needs reduced gradients"):
        step(state, lm_batches(model, 2, 1, 2, 1, 0)[0])
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        fzero.clip_by_global_norm(0)

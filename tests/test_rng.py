"""`fzero.state.rng.stream`: the step's draws come from the seed alone; torch's global generator is left as it was."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.state import rng


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), before=st.integers(0, 2**63 - 1))
def test_stream_draws_from_the_seed_and_restores_the_global_generator(seed, before):
    with torch.random.fork_rng(devices=[]):  # (this test's own seeding of the global generator, undone)
        _check(seed, before)


def _check(seed: int, before: int) -> None:
    torch.manual_seed(before)
    state = torch.get_rng_state()
    with rng.stream(seed):
        drawn = torch.rand(5), torch.randint(0, 1000, (5,)), torch.nn.functional.dropout(torch.ones(8), 0.5)
    fresh = torch.Generator().manual_seed(seed)
    expected = torch.rand(5, generator=fresh), torch.randint(0, 1000, (5,), generator=fresh)
    assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[1], expected[1])
    with rng.stream(seed):
        torch.rand(5), torch.randint(0, 1000, (5,))
        assert torch.equal(torch.nn.functional.dropout(torch.ones(8), 0.5), drawn[2])  # the same masks again
    assert torch.equal(torch.get_rng_state(), state)  # the global stream goes on as if the block had not run

"""SimMesh collectives against their definitions, and the ledger's accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero


def per_rank(world, chunk, seed, lead=()):
    return torch.randn(world, *lead, world * chunk, generator=torch.Generator().manual_seed(seed))


def ordered_sum(x):
    total = x[0]
    for r in range(1, x.shape[0]):
        total = total + x[r]
    return total


@given(world=st.integers(1, 8), chunk=st.integers(1, 5), seed=st.integers(0, 99), lead=st.sampled_from([(), (2,)]))
def test_sim_collectives(world, chunk, seed, lead):
    mesh = fzero.SimMesh(world)
    x = per_rank(world, chunk, seed, lead)
    total = ordered_sum(x)
    assert torch.equal(mesh.all_reduce(x), total.expand_as(x))
    assert torch.equal(mesh.all_reduce(x, "mean"), (total / world).expand_as(x))
    rs = mesh.reduce_scatter(x, "mean")
    for r in range(world):
        assert torch.equal(rs[r], (total / world)[..., r * chunk : (r + 1) * chunk])
        assert torch.equal(mesh.local_shard(x)[r], x[r, ..., r * chunk : (r + 1) * chunk])
    gathered = mesh.all_gather(rs)
    assert torch.equal(gathered, (total / world).expand_as(x))  # all_gather inverts the scatter
    assert torch.equal(mesh.broadcast(x, src=world - 1), x[world - 1].expand_as(x))
    assert mesh.local_ranks == tuple(range(world)) and torch.equal(mesh.coords(), torch.arange(world))


def test_ledger_counts_elements_per_rank():
    mesh = fzero.SimMesh(4)
    x = per_rank(4, 3, 0)  # 12 elements per rank
    with mesh.record() as ledger:
        mesh.reduce_scatter(x)
        shard = mesh.local_shard(x)  # local: not a collective
        mesh.all_gather(shard)
        mesh.all_reduce(x)
    assert ledger.as_dict() == {
        "reduce_scatter": {"calls": 1, "elements": 12, "sent": 9, "received": 9},
        "all_gather": {"calls": 1, "elements": 12, "sent": 9, "received": 9},
        "all_reduce": {"calls": 1, "elements": 24, "sent": 18, "received": 18},
    }
    mesh.all_reduce(x)  # outside the block: not recorded
    assert ledger.total() == 48


def test_errors():
    with pytest.raises(ValueError, match="int >= 1"):
        fzero.SimMesh(0)
    mesh = fzero.SimMesh(3)
    with pytest.raises(ValueError, match="leading world axis of size 3"):
        mesh.all_reduce(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="not divisible by world=3"):
        mesh.reduce_scatter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        mesh.all_reduce(torch.zeros(3, 3), "max")
    with pytest.raises(RuntimeError, match="torchrun"):
        fzero.DistMesh()

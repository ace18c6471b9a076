"""Named mesh axes: a `SimMesh(shape=...)` collective over an axis equals the 1-D `SimMesh` collective on each
group of ranks along that axis, bitwise (the same code runs each group), and the ledger records it per axis."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero

shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(
    lambda sizes: {f"a{i}": n for i, n in enumerate(sizes)}
)


def groups(shape: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of ranks along `axis`, in coordinate order, from the row-major grid."""
    grid = torch.arange(math.prod(shape.values())).reshape(*shape.values())
    k = list(shape).index(axis)
    return grid.movedim(k, -1).reshape(-1, shape[axis]).tolist()


@given(shape=shapes, data=st.data(), seed=st.integers(0, 2**16))
def test_axis_collectives_are_the_1d_ones_on_each_group(shape, data, seed):
    mesh = fzero.SimMesh(shape=shape)
    axis = data.draw(st.sampled_from(list(shape)))
    n = shape[axis]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(mesh.world, 2, n * 3, generator=g)
    line = fzero.SimMesh(n)
    outs = {
        "all_reduce": (mesh.all_reduce(x, "mean", axis=axis), lambda y: line.all_reduce(y, "mean")),
        "reduce_scatter": (mesh.reduce_scatter(x, "mean", axis=axis), lambda y: line.reduce_scatter(y, "mean")),
        "all_gather": (mesh.all_gather(x, axis=axis), line.all_gather),
        "all_to_all": (mesh.all_to_all(x, axis=axis), line.all_to_all),
        "broadcast": (mesh.broadcast(x, n - 1, axis=axis), lambda y: line.broadcast(y, n - 1)),
        "local_shard": (mesh.local_shard(x, axis=axis), line.local_shard),
    }
    for name, (got, one) in outs.items():
        for ranks in groups(shape, axis):
            assert torch.equal(got[ranks], one(x[ranks])), (name, ranks)
    assert [mesh.group(r, axis) for r in range(mesh.world)] == [
        next(grp for grp in groups(shape, axis) if r in grp) for r in range(mesh.world)
    ]
    coords = mesh.coords(axis)
    assert all(mesh.group(r, axis)[int(coords[r])] == r for r in range(mesh.world))


def test_all_to_all_moves_chunk_k_to_rank_k():
    mesh = fzero.SimMesh(3)
    x = torch.arange(27.0).reshape(3, 9)  # rank r sends chunk k (3 elements) to rank k
    out = mesh.all_to_all(x)
    assert out.shape == (3, 3, 3)
    for to in range(3):
        for src in range(3):
            assert torch.equal(out[to, src], x[src, 3 * to : 3 * to + 3])


def test_no_axis_is_every_rank_and_1d_meshes_are_unchanged():
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    flat = fzero.SimMesh(6)
    x = torch.randn(6, 12)
    assert torch.equal(mesh.reduce_scatter(x, "mean"), flat.reduce_scatter(x, "mean"))
    assert torch.equal(mesh.all_reduce(x), flat.all_reduce(x))
    assert mesh.axes == ("replicate", "shard") and flat.axes == ()
    assert (mesh.size(), mesh.size("shard"), mesh.size("replicate")) == (6, 3, 2)
    assert repr(fzero.SimMesh(2)) == "SimMesh(world=2)"


def test_ledger_counts_per_axis_with_the_axis_size():
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    x = torch.randn(6, 12)
    with mesh.record() as ledger:
        shard = mesh.reduce_scatter(x, "mean", axis="shard")  # 12 elements per rank in, 4 out
        mesh.all_reduce(shard, "mean", axis="replicate")  # 4 elements over 2 ranks
        mesh.all_gather(shard, axis="shard")
        mesh.all_reduce(x)  # every rank: the 1-D entry
    assert ledger.on("shard") == {
        "reduce_scatter": {"calls": 1, "elements": 12, "sent": 8, "received": 8, "bytes": 48},
        "all_gather": {"calls": 1, "elements": 12, "sent": 8, "received": 8, "bytes": 48},
    }
    assert ledger.on("replicate") == {"all_reduce": {"calls": 1, "elements": 8, "sent": 4, "received": 4, "bytes": 16}}
    # on a mesh with named axes every entry has its payload bytes, the 1-D one too
    assert ledger.entries["all_reduce"] == {"calls": 1, "elements": 24, "sent": 20, "received": 20, "bytes": 48}
    # from outside the shard group (the other replicate row): the replicate all-reduce's (2 - 1) / 2 of 16 bytes,
    # twice; the 1-D all-reduce's (6 - 3) / 6 of 48, twice
    assert ledger.crossing(mesh.shape, "shard") == 2 * 16 // 2 + 2 * 48 * 3 // 6


def test_bad_shapes_and_axes_are_named():
    with pytest.raises(ValueError, match="axis 'shard' needs an int size >= 1, got 0"):
        fzero.SimMesh(shape={"replicate": 2, "shard": 0})
    with pytest.raises(ValueError, match="non-empty mapping"):
        fzero.SimMesh(shape={})
    with pytest.raises(ValueError, match="world=3 but shape"):
        fzero.SimMesh(3, shape={"replicate": 2, "shard": 2})
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    with pytest.raises(ValueError, match=r"has no axis 'node'; its axes are \['replicate', 'shard'\]"):
        mesh.all_reduce(torch.zeros(4, 2), axis="node")
    with pytest.raises(ValueError, match="has no axis 'shard'; its axes are none"):
        fzero.SimMesh(2).reduce_scatter(torch.zeros(2, 2), axis="shard")
    with pytest.raises(ValueError, match="not divisible by world=2"):
        mesh.reduce_scatter(torch.zeros(4, 3), axis="shard")

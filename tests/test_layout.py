"""Layout round trips for arbitrary shapes (scalars, zero-size, odd sizes), worlds 1-8 and unit groupings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero import layout as L

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 6))
    specs = [(f"p{i}", draw(shapes), torch.float32) for i in range(n)]
    units = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    world = draw(st.integers(1, 8))
    align = draw(st.sampled_from([1, 2, 3, 4, 16]))
    lay = L.make_layout(specs, world=world, align=align, unit_of=lambda name: f"u{units[int(name[1:])]}")
    return lay, specs


def values(specs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape, _ in specs}


@given(layouts())
def test_flatten_unflatten_round_trip(case):
    lay, specs = case
    tensors = values(specs)
    flat = L.flatten(lay, tensors)
    assert flat.shape == (lay.numel,)
    out = L.unflatten(lay, flat)
    assert set(out) == set(tensors)
    for unit in range(len(lay.units)):  # inside a unit, the given (named_parameters) order
        names = [leaf.name for leaf in lay.leaves if leaf.unit == unit]
        assert names == sorted(names, key=lambda n: int(n[1:]))
    for name, t in tensors.items():
        assert torch.equal(out[name], t)
        assert out[name].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, no copy
    assert not flat[lay.padding_mask()].any()  # padding is zero
    assert int((~lay.padding_mask()).sum()) == lay.real_numel == sum(math.prod(s) for _, s, _ in specs)


@given(layouts())
def test_shard_unshard_round_trip(case):
    lay, specs = case
    flat = L.flatten(lay, values(specs))
    shards = L.shard(lay, flat)
    assert shards.shape == (lay.world, lay.shard_numel)
    assert torch.equal(L.unshard(lay, shards), flat)
    # rank r's shard is the r-th chunk of every unit, units end to end
    for r in range(lay.world):
        expect = torch.cat([flat[lay.unit_slice(u)].view(lay.world, -1)[r] for u in range(len(lay.units))])
        assert torch.equal(shards[r], expect)
    # a unit's shard slice is contiguous on every rank and gathers back to the unit
    for u in range(len(lay.units)):
        assert torch.equal(shards[:, lay.unit_shard_slice(u)].reshape(-1), flat[lay.unit_slice(u)])
    batch = torch.stack([flat, flat * 2])
    assert torch.equal(L.to_unit_major(lay, L.to_rank_major(lay, batch)), batch)


@given(layouts())
def test_alignment_and_padding(case):
    lay, _ = case
    for unit in lay.units:
        assert unit.size % (lay.world * lay.align) == 0 and unit.size >= unit.numel
    for leaf in lay.leaves:
        assert leaf.offset % lay.align == 0
        unit = lay.units[leaf.unit]
        assert unit.start <= leaf.offset and leaf.offset + leaf.numel <= unit.start + unit.size


@given(layouts())
def test_json_round_trip(case):
    lay, _ = case
    assert L.Layout.from_json(lay.to_json()) == lay


def test_module_order_units_frozen_buffers_aliases():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.z_first = torch.nn.Linear(2, 3)  # named_parameters order, not sorted order
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
            self.a_norm = torch.nn.BatchNorm1d(3)
            self.frozen = torch.nn.Linear(3, 1)
            self.frozen.requires_grad_(False)
            self.tied = torch.nn.Linear(3, 3)
            self.tied.weight = self.blocks[0].weight

    lay = L.from_module(Net(), world=2)
    assert [leaf.name for leaf in lay.leaves] == [
        "z_first.weight", "z_first.bias", "a_norm.weight", "a_norm.bias", "tied.bias",
        "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias",
    ]  # fmt: skip
    assert [u.name for u in lay.units] == [L.ROOT_UNIT, "blocks.0", "blocks.1"]
    assert [s.name for s in lay.frozen] == ["frozen.weight", "frozen.bias"]
    assert [s.name for s in lay.buffers] == ["a_norm.running_mean", "a_norm.running_var", "a_norm.num_batches_tracked"]
    assert lay.aliases == (("tied.weight", "blocks.0.weight"),)
    assert L.Layout.from_json(lay.to_json()) == lay


def test_meta_model_layout():
    with torch.device("meta"):
        model = torch.nn.Linear(1000, 1000)
    lay = L.from_module(model, world=4)
    assert lay.real_numel == 1000 * 1000 + 1000


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no trainable parameters"):
        L.make_layout([], world=1)
    with pytest.raises(ValueError, match="nothing to train"):
        L.from_module(torch.nn.ReLU(), world=1)
    m = torch.nn.Linear(2, 2)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen parameters only"):
        L.from_module(m, world=1)
    m = torch.nn.Linear(2, 2)
    m.steps = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match="'steps' has dtype torch.int64"):
        L.from_module(m, world=1)
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(TypeError, match="mixed dtypes"):
        L.from_module(m, world=1)
    lay = L.make_layout([("w", (2,), torch.float32)], world=2)
    with pytest.raises(KeyError, match="'w'"):
        L.flatten(lay, {})
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\)"):
        L.flatten(lay, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        L.make_layout([("w", (2,), torch.float32)], world=0)

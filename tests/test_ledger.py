"""The byte ledger against the ZeRO paper's communication volumes per rank per step."""

from __future__ import annotations

import pytest

import fzero
from tests.support import lm_batches, lm_loss, tiny_gpt


def elements_per_step(preset, world, micro, gather=None):
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(world)
    tx = preset(fzero.adamw(1e-3), accumulate=micro)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, gather=gather)
    totals: dict[str, int] = {}
    for batch in lm_batches(model, world, micro, 2, 1, 0):
        state, metrics = step(state, batch)
        for kind, entry in metrics["comm"].items():
            totals[kind] = totals.get(kind, 0) + entry["elements"]
    # one-element all-reduces: the reported loss (every micro-step) and the gradients' global sum of squares for the
    # non-finite check (once per step, where gradients are sharded; at stage 0 each rank sums them whole below
    # fzero.transforms.stats.SPLIT_STATS_ELEMENTS)
    scalars = micro + (preset is not fzero.zero0)
    totals["all_reduce"] = totals.get("all_reduce", 0) - 2 * scalars
    return {k: v for k, v in totals.items() if v}, state.layout


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("micro", [1, 3])
def test_volumes_match_the_zero_paper(world, micro):
    n = {}
    for name in ("zero0", "zero1", "zero2", "zero3"):
        n[name], layout = elements_per_step(getattr(fzero, name), world, micro)
    psi, padded = layout.real_numel, layout.numel
    assert padded < 1.1 * psi  # padding aside, the counts below are the paper's Psi
    assert n["zero0"] == {"all_reduce": 2 * padded}  # all-reduce = reduce-scatter + all-gather = 2 Psi
    assert n["zero1"] == {"reduce_scatter": padded, "all_gather": padded}  # 2 Psi
    # stage 2 reduces every micro-step (as DeepSpeed does), so accumulation adds (k - 1) Psi
    assert n["zero2"] == {"reduce_scatter": micro * padded, "all_gather": padded}
    # stage 3 gathers each unit in the forward and again in the backward, and reduce-scatters each unit's gradient:
    # 3 Psi per micro-step, less the root unit (embeddings, final norm) and the last block, each gathered once and
    # kept through the backward that begins where the forward ended
    root, last = layout.units[0], layout.units[-1]
    assert root.name == fzero.layout.ROOT_UNIT and last.name == f"blocks.{len(layout.units) - 2}"
    assert n["zero3"] == {"reduce_scatter": micro * padded, "all_gather": micro * (2 * padded - root.size - last.size)}


def test_ring_model_sent_and_received():
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(4)
    tx = fzero.zero2(fzero.adamw(1e-3))
    state = fzero.init(model, tx, mesh)
    _, metrics = fzero.train_step(model, lm_loss(model), tx, mesh)(state, lm_batches(model, 4, 1, 2, 1, 0)[0])
    rs = metrics["comm"]["reduce_scatter"]
    assert rs["sent"] == rs["received"] == rs["elements"] * 3 // 4


def test_persistent_units_are_gathered_once():
    every_unit = fzero.GatherPolicy(persistence_threshold=10**9)
    n, layout = elements_per_step(fzero.zero3, 2, 1, gather=every_unit)
    assert n == {"reduce_scatter": layout.numel, "all_gather": layout.numel}

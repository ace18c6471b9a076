"""Per-rank code (shard_map-style): `SimMesh.run` gives each simulated rank its own values and a `RankMesh`, in
lockstep at its collectives (`fzero.mesh.lockstep`), and the chain runs a transform written for one rank on every
rank with random keys for what each rank holds (`fzero.transforms.per_rank`).

The collectives inside `run` must equal the `SimMesh`'s own on the stacked values (bitwise: the same arithmetic);
ranks that do not issue the same collectives, or that disagree on a value that is not a tensor, fail with
`MismatchError` naming both; an exception in one rank ends every rank and reaches the caller.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.mesh import MismatchError, RankMesh
from tests.extending_worker import Net, batches, loss_of, stage_chain


def _stacked(world: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(world, n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------- the lockstep
@settings(max_examples=20, deadline=None)
@given(world=st.integers(1, 4), chunk=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_collectives_inside_run_equal_the_stacked_ones(world, chunk, seed):
    """Each collective of a rank inside `run` returns that rank's row of the `SimMesh`'s collective on the stacked
    inputs, bitwise; the rank sees its own row (no world axis) and an int rank."""
    mesh = fzero.SimMesh(world)
    x = _stacked(world, world * chunk, seed)

    def per_rank(m, row):
        assert isinstance(m, RankMesh) and isinstance(m.rank, int) and row.shape == (world * chunk,)
        return {
            "sum": m.all_reduce(row),
            "mean": m.all_reduce(row, "mean"),
            "scatter": m.reduce_scatter(row, "mean"),
            "gather": m.all_gather(row[:chunk]),
            "bcast": m.broadcast(row, src=world - 1),
            "to_all": m.all_to_all(row),
            "own": m.local_shard(row),
            "rank": torch.tensor(m.rank),
        }

    out = mesh.run(per_rank, x)
    want = {
        "sum": mesh.all_reduce(x),
        "mean": mesh.all_reduce(x, "mean"),
        "scatter": mesh.reduce_scatter(x, "mean"),
        "gather": mesh.all_gather(x[:, :chunk]),
        "bcast": mesh.broadcast(x, src=world - 1),
        "to_all": mesh.all_to_all(x),
        "own": mesh.local_shard(x),
        "rank": torch.arange(world),
    }
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_named_axes_inside_run():
    """On a 2-D mesh each rank's `index(axis)` is its coordinate, and a collective over an axis is the stacked
    one's."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    x = _stacked(6, 6, 0)

    def per_rank(m, row):
        coords = torch.tensor([m.index("replicate"), m.index("shard")])
        return coords, m.reduce_scatter(row, "mean", axis="shard"), m.all_reduce(row, axis="replicate")

    coords, scattered, reduced = mesh.run(per_rank, x)
    assert coords.tolist() == [[r // 3, r % 3] for r in range(6)]
    assert torch.equal(scattered, mesh.reduce_scatter(x, "mean", axis="shard"))
    assert torch.equal(reduced, mesh.all_reduce(x, axis="replicate"))


def test_ranks_take_turns_in_order():
    """Rank 0 runs to its collective, then rank 1, ...; then rank 0 resumes: the same order every time, one rank
    at a time."""
    mesh, log, running = fzero.SimMesh(3), [], []
    lock = threading.Lock()

    def per_rank(m, row):
        for phase in range(2):
            with lock:
                running.append(m.rank)
                assert len(running) == 1  # never two ranks at once
                log.append((phase, m.rank))
                running.pop()
            row = m.all_reduce(row)
        return row

    mesh.run(per_rank, torch.ones(3, 1))
    assert log == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_the_ledger_counts_a_collective_once():
    mesh = fzero.SimMesh(4)
    with mesh.record() as ledger:
        mesh.run(lambda m, row: m.reduce_scatter(row), torch.ones(4, 8))
    with mesh.record() as stacked:
        mesh.reduce_scatter(torch.ones(4, 8))
    assert ledger.as_dict() == stacked.as_dict()


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (lambda m, row: m.reduce_scatter(row), r"rank 1 called reduce_scatter\(sum\) while rank 0 called all_reduce"),
        (lambda m, row: row, r"rank 1 returned while rank 0 called all_reduce"),
        (lambda m, row: m.all_reduce(row[:1]), r"inputs to all_reduce\(sum\) differ in shape"),
    ],
)
def test_ranks_that_disagree_fail_with_both_named(second, message):
    mesh = fzero.SimMesh(2)

    def per_rank(m, row):
        return m.all_reduce(row) if m.rank == 0 else second(m, row)

    with pytest.raises(MismatchError, match=message):
        mesh.run(per_rank, torch.ones(2, 4))


def test_an_exception_in_one_rank_ends_every_rank():
    """Rank 1 raises while rank 0 waits in a collective: the caller gets rank 1's exception, and no rank thread is
    left behind."""
    before = threading.active_count()

    def per_rank(m, row):
        if m.rank == 1:
            raise KeyError("rank one's own error")
        return m.all_reduce(row)

    with pytest.raises(KeyError, match="rank one's own error"):
        fzero.SimMesh(3).run(per_rank, torch.ones(3, 2))
    assert threading.active_count() == before


def test_values_other_than_tensors_must_agree():
    mesh = fzero.SimMesh(2)
    assert mesh.run(lambda m, row: {"n": 3, "x": row * 2}, torch.ones(2, 1))["n"] == 3
    with pytest.raises(MismatchError, match=r"\['n'\] = 0 on rank 0 but 1 on rank 1"):
        mesh.run(lambda m, row: {"n": m.rank}, torch.ones(2, 1))


def test_what_passes_through_is_not_copied():
    """An output that is each rank's own slice of an input comes back as that input (the same tensor)."""
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    a, b = fzero.SimMesh(2).run(lambda m, p, q: (p, q + 1), x, y)
    assert a is x and torch.equal(b, y + 1)


def test_grad_mode_is_the_callers():
    seen = []
    with torch.no_grad():
        fzero.SimMesh(2).run(lambda m, row: seen.append(torch.is_grad_enabled()), torch.ones(2, 1))
    assert seen == [False, False]


# -------------------------------------------------------------------------------------------- per-rank transforms
def _report_keys(prefix: str = "") -> fzero.Transform:
    """A per-rank transform that reports what it sees: its rank's key, rank key and rank, and its gradient's shape
    (tensors: kept per rank)."""

    def update(flow, ctx):
        seen = {
            "key": torch.tensor(ctx.key),
            "rank_key": torch.tensor(ctx.rank_key),
            "rank": torch.tensor(ctx.mesh.rank),
            "numel": flow.gradients("keys").shape[-1],
            "step": ctx.step,
        }
        return flow.with_metrics(**{prefix + k: v for k, v in seen.items()})

    return fzero.stateless(update, "keys")


def _metrics(tx, mesh, steps=1):
    model = Net()
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh)
    out = []
    for batch in batches(steps=steps, world=mesh.world):
        state, m = step(state, batch)
        out.append(m)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_transform_sees_one_ranks_values_and_keys_for_what_it_holds(stage):
    """After the reduction: this rank's shard (stages 1-3) or the whole average (stage 0), one rank's worth; the
    key the same on every rank at stage 0 (replicas), one per rank's shard above; before the reduction one per
    rank; `rank_key` always one per rank; every key new at each step."""
    mesh = fzero.SimMesh(2)
    first, second = _metrics(stage_chain(stage, after=[_report_keys()]), mesh, steps=2)
    layout = fzero.init(Net(), stage_chain(stage), mesh).layout
    assert first["numel"] == (layout.numel if stage == 0 else layout.shard_numel)
    assert first["rank"].tolist() == [0, 1]
    keys = first["key"].tolist()
    assert (keys[0] == keys[1]) == (stage == 0)
    assert first["rank_key"][0] != first["rank_key"][1]
    assert first["step"] == 0 and second["step"] == 1 and not torch.equal(first["key"], second["key"])
    if stage < 3:  # (before the reduction it has no unit form)
        (early,) = _metrics(stage_chain(stage, before=[_report_keys()]), mesh)
        assert early["numel"] == layout.numel and early["key"][0] != early["key"][1]


def test_replicas_of_a_shard_draw_alike_on_a_hybrid_mesh():
    """On a (replicate 2, shard 2) mesh, the ranks holding the same shard (0 and 2; 1 and 3) get the same key, the
    two shards different ones."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = stage_chain(2, after=[_report_keys()], reduce=fzero.reduce_scatter(axis="shard", replicate="replicate"))
    (m,) = _metrics(tx, mesh)
    k = m["key"].tolist()
    assert k[0] == k[2] and k[1] == k[3] and k[0] != k[1]


def test_two_transforms_in_one_chain_get_different_keys():
    (m,) = _metrics(stage_chain(0, after=[_report_keys("a/"), _report_keys("b/")]), fzero.SimMesh(2))
    assert m["a/key"][0] == m["a/key"][1] and m["a/key"][0] != m["b/key"][0]


def test_a_per_rank_state_is_kept_per_rank():
    """A per-rank transform's state has a leading world axis on a `SimMesh` (each rank's own), the value a
    `DistMesh` rank would hold in its row."""

    def init(flow, ctx):
        return flow, torch.tensor(float(ctx.mesh.rank))

    def update(flow, state, ctx):
        return flow, state + 10

    counter = fzero.Transform(init, update, "counter")
    tx = stage_chain(2, after=[counter])
    model, mesh = Net(), fzero.SimMesh(2)
    state = fzero.init(model, tx, mesh)
    assert state.tx_state["counter"].tolist() == [0.0, 1.0]
    state, _ = fzero.train_step(model, loss_of(model), tx, mesh)(state, batches(steps=1)[0])
    assert state.tx_state["counter"].tolist() == [10.0, 11.0]


def test_a_replicated_value_that_diverges_is_refused():
    """A per-rank transform that makes the gradient factor differ between ranks (ranks would silently diverge on
    a DistMesh) is refused on a SimMesh, naming the value."""
    bad = fzero.stateless(lambda flow, ctx: flow.with_info(grad_factor=1.0 + ctx.mesh.rank), "bad")
    with pytest.raises(MismatchError, match="grad_factor"):
        _metrics(stage_chain(2, after=[bad]), fzero.SimMesh(2))

"""Overlapped hybrid reductions (`GatherPolicy(overlap_reduce=True)` with `hybrid=True`): each unit's reduce-scatter
over "shard" starts as its gradient completes, its all-reduce over "replicate" once that is done, both while the
backward goes on; the results are bitwise those that wait for each, and those of a `SimMesh` of the same shape."""

from __future__ import annotations

import json

import pytest
import torch

import fzero
from fzero.layout import make_layout
from fzero.mesh.ranks import _DistReduction
from fzero.transforms.collective import _After, _Chained
from tests import overlap_hybrid_worker as worker
from tests.spawn import spawn
from tests.support import differing


def sim_reference() -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """Every case on `SimMesh(shape=(2, 2))` (with overlap on: a SimMesh reduces at once), one thread as the
    workers (matmul's reduction order may depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mesh = fzero.SimMesh(shape=worker.SHAPE)
        return {worker.name(*case): worker.train(mesh, *case, 10**9, None)[:2] for case in worker.CASES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(600)
def test_overlapped_hybrid_on_four_gloo_processes(tmp_path):
    spawn(worker.run, (4, str(tmp_path)), 4)
    sim = sim_reference()
    for rank in range(4):
        results = json.loads((tmp_path / f"results-{rank}.json").read_text())
        for key, r in results["starts"].items():  # the mesh's *_start(axis=): the synchronous values and ledger
            assert r["equal"] and r["same_ledger"], (rank, key)
            assert r["ledger"]  # (something was recorded: under "{collective}:{axis}")
            assert all(k.endswith(":" + key.split("-")[0]) for k in r["ledger"]), (rank, key, r["ledger"])
        # a one-rank shard axis: the replicate all-reduce never writes the caller's gradient
        kept = results["one_rank_shards"]
        assert kept and all(kept.values()), (rank, kept)
        assert results["cases"].keys() == {worker.name(*c) for c in worker.CASES}
        for case in worker.CASES:
            runs = results["cases"][worker.name(*case)]
            stage, micro = case[0], case[1]
            for budget, r in runs.items():
                # the same collectives in the same order, the same sums: bitwise, and the same ledger per axis
                assert r["differ"] == [] and r["same_comm"], (rank, case, budget)
                assert r["comm"] == sim[worker.name(*case)][1], (rank, case, budget)  # (the SimMesh's ledger)
            wait, one, every = runs["wait"], runs["one unit"], runs["all"]
            assert wait["chained"] == 0 and not any(wait["peaks"]), (rank, case)  # (None: no per-unit reduction)
            if stage == 1 and micro > 1:  # accumulated whole, then reduced once after the backward
                continue
            # overlapped: every unit's reduction was a chained handle, left in flight while the backward went on
            assert every["chained"] > 0 and one["chained"] == every["chained"], (rank, case)
            assert all(p > 0 for p in every["peaks"]), (rank, case)
            # (how many were in flight at once depends on timing: a completed reduction lands at the next unit)
            assert every["most_in_flight"] >= 1, (rank, case)
            # a budget of one element: every reduction waits for the one before (both its collectives)
            assert one["most_in_flight"] == 1 and max(one["peaks"]) <= max(every["peaks"]), (rank, case)
    for case in worker.CASES:  # DistMesh (2, 2) == SimMesh (2, 2), bitwise
        got, want = torch.load(tmp_path / f"{worker.name(*case)}.pt"), sim[worker.name(*case)][0]
        assert got.keys() == want.keys() and differing(want, got) == [], case


class FakeWork:
    """A collective in flight that completes when the test says so (`done`); logs its `wait()`."""

    def __init__(self, value: torch.Tensor, log: list, name: tuple) -> None:
        self.value, self.log, self.name, self.done = value, log, name, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> torch.Tensor:
        self.log.append(("wait", *self.name))
        self.done = True
        return self.value


def fake_hybrid(log: list, firsts: dict):
    """A hybrid reduction over fake collectives: this rank's shard is the first half of the unit's gradient, the
    second collective doubles it; `firsts[unit]` is the unit's first collective (the test completes it)."""

    def fn(grads: torch.Tensor, unit: int, place: object = None) -> _Chained:
        firsts[unit] = FakeWork(grads[: grads.numel() // 2].clone(), log, ("rs", unit))

        def then(shard: torch.Tensor) -> FakeWork:
            log.append(("start", unit))
            return FakeWork(shard * 2, log, ("ar", unit))

        return _Chained(firsts[unit], then)

    return fn


def layout(units: int = 4):
    return make_layout([(f"p{u}", (32,), torch.float32) for u in range(units)], world=2, unit_of=lambda n: n)


def started(log: list) -> list[int]:
    return [entry[1] for entry in log if entry[0] == "start"]


def test_second_collectives_start_in_unit_order_without_blocking():
    """`_DistReduction` advances chained handles oldest first, stopping at the first whose first collective is
    still running (a later one that completed first waits its turn: every rank must start the all-reduces in the
    same order), and never waits while the backward goes on."""
    log, firsts = [], {}
    lay = layout()
    reduction = _DistReduction(fake_hybrid(log, firsts), lay, 10**9)
    grads = {u: torch.arange(32.0) + 100 * u for u in range(4)}
    reduction.add(3, 0, grads[3])  # the backward reaches the last unit first
    reduction.add(2, 0, grads[2])
    reduction.add(1, 0, grads[1])
    firsts[1].done = True  # a younger unit's reduce-scatter completes first: it must not overtake 3 and 2
    reduction.add(0, 0, grads[0])
    assert started(log) == [] and not any(entry[0] == "wait" for entry in log)
    firsts[3].done = True
    reduction.add(3, 0, torch.zeros(32))  # (a second backward through unit 3: another piece, in flight too)
    assert started(log) == [3]  # 2 is still running: 1 waits behind it
    firsts[2].done = True
    reduction._advance()
    assert started(log) == [3, 2, 1]
    assert reduction.peak == 5 * 32 and not any(entry[0] == "wait" for entry in log if entry[1] == "ar")
    out = reduction.result()  # waits oldest first; starts the rest (0, then 3's second piece) in order
    assert started(log) == [3, 2, 1, 0, 3]
    want = torch.cat([2 * grads[u][:16] for u in range(4)])
    assert torch.equal(out, want)


def test_the_budget_holds_for_chained_handles():
    """With room for two units, the oldest is waited on (both its collectives) before a third starts."""
    log, firsts = [], {}
    reduction = _DistReduction(fake_hybrid(log, firsts), layout(), 64)
    for unit in (3, 2, 1, 0):
        reduction.add(unit, 0, torch.full((32,), float(unit)))
        assert reduction.elements <= 64
    assert reduction.peak == 64
    assert [e for e in log if e[1] == "ar"] == [("wait", "ar", 3), ("wait", "ar", 2)]
    assert started(log) == [3, 2]
    assert torch.equal(reduction.result(), torch.cat([torch.full((16,), 2.0 * u) for u in range(4)]))
    assert started(log) == [3, 2, 1, 0]


@pytest.mark.parametrize("average", [None, fzero.Average(prescale=True), fzero.Average(predivide=2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_started_unit_reduction_is_the_synchronous_one(average, dtype):
    """`reduce_scatter(axis=, replicate=).unit` with `ctx.overlap`: a chained handle (its average applied on
    waiting) whose result and ledger are the synchronous reduction's, bitwise."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 3})
    tx = fzero.reduce_scatter(dtype, axis="shard", replicate="replicate", average=average)
    grads = torch.randn(6, 48, generator=torch.Generator().manual_seed(0)) * 1e3
    ctx = fzero.Context(mesh, None)
    with mesh.record() as sync:
        want = tx.unit(grads, 0, ctx)
    with mesh.record() as started_:
        handle = tx.unit(grads, 0, ctx._replace(overlap=True))
        assert isinstance(handle, _After if average is not None else _Chained)
        assert handle.progress()  # (a SimMesh's first collective is complete: the second starts)
        got = handle.wait()
    assert got.dtype == dtype and torch.equal(got, want)
    assert sync.as_dict() == started_.as_dict()
    assert set(sync.entries) == {"reduce_scatter:shard", "all_reduce:replicate"}


def test_sim_mesh_starts_over_an_axis():
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    x = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1))
    for axis in (None, "replicate", "shard"):
        with mesh.record() as sync:
            want = (mesh.reduce_scatter(x, "mean", axis=axis), mesh.all_reduce(x, "mean", axis=axis))
        with mesh.record() as started_:
            handles = (mesh.reduce_scatter_start(x, "mean", axis=axis), mesh.all_reduce_start(x, "mean", axis=axis))
            assert all(h.is_completed() for h in handles)
            got = tuple(h.wait() for h in handles)
        assert all(map(torch.equal, want, got)) and sync.as_dict() == started_.as_dict(), axis

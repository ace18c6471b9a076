"""The 4-process half of tests/test_overlap_hybrid.py: hybrid presets on a gloo `DistMesh` of shape (2, 2) with each
unit's two-collective reduction (reduce-scatter over "shard", then all-reduce over "replicate") overlapped with the
backward, at in-flight budgets from one element to all, against the same run waiting for each reduction; and the
mesh's `*_start(axis=)` against the synchronous named-axis collectives."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import fzero
from fzero.host import process_group
from fzero.mesh import ranks as ranks_module
from fzero.transforms import collective
from tests.spawn import init_worker
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

SHAPE = {"replicate": 2, "shard": 2}
BUDGETS = {"wait": None, "one unit": 1, "all": 10**9}  # None: no overlap; 1: each waits for the one before
AVERAGES = {"post": None, "prescale": fzero.Average(prescale=True), "predivide": fzero.Average(predivide=2.0)}
CASES = [(stage, micro, reduce, "post") for stage in (1, 2, 3) for micro in (1, 2) for reduce in ("fp32", "bf16")]
CASES += [(2, 1, "fp32", "prescale"), (3, 2, "bf16", "predivide"), (1, 1, "bf16", "predivide")]
STEPS = 2


def name(stage: int, micro: int, reduce: str, average: str) -> str:
    return f"zero{stage}-{micro}-{reduce}-{average}"


def batches(micro: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's rows (`[4, ...]`): a rank takes its own, a SimMesh all of them."""
    return lm_batches(tiny_gpt(0), 4, micro, 2, STEPS, 5)


def train(mesh, stage: int, micro: int, reduce: str, average: str, budget: int | None, rank: int | None):
    """Hybrid `zero{stage}` with clipping for `STEPS` steps (`rank` None: a SimMesh, batches with every rank's
    rows). Returns the consolidated parameters, the last step's ledger and each step's in-flight peak."""
    model = tiny_gpt(0)
    policy = fzero.Policy(reduce_dtype=torch.bfloat16) if reduce == "bf16" else None
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro, precision=policy, clip=1.0,
                                        hybrid=True, average=AVERAGES[average])  # fmt: skip
    state = fzero.init(model, tx, mesh)
    gather = fzero.GatherPolicy(overlap_reduce=budget is not None, reduce_bucket_elements=budget or 1)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True, gather=gather)
    peaks = []
    for batch in batches(micro):
        state, metrics = step(state, batch if rank is None else {k: v[rank] for k, v in batch.items()})
        peaks.append(metrics.get("reduce_in_flight_peak"))
    return fzero.state_dict(state, mesh), metrics["comm"], peaks


class Watch:
    """Counts, while installed, the chained (two-collective) handles made, their second collectives started by
    `progress()` (during the backward) rather than by `wait()`, and the most reductions in flight at once as a
    unit's gradient arrives (`fzero.mesh.ranks._DistReduction.flight`)."""

    def __init__(self) -> None:
        self.chained = self.started_by_progress = self.most_in_flight = 0
        self._saved = (collective._Chained.__init__, collective._Chained.progress, ranks_module._DistReduction.add)

    def __enter__(self) -> Watch:
        init, progress, add = self._saved
        watch = self

        def counted_init(handle, *args, **kwargs):
            watch.chained += 1
            init(handle, *args, **kwargs)

        def counted_progress(handle):
            before = handle._second is None
            started = progress(handle)
            watch.started_by_progress += before and started
            return started

        def counted_add(reduction, *args, **kwargs):
            add(reduction, *args, **kwargs)
            watch.most_in_flight = max(watch.most_in_flight, len(reduction.flight))

        collective._Chained.__init__ = counted_init
        collective._Chained.progress = counted_progress
        ranks_module._DistReduction.add = counted_add
        return self

    def __exit__(self, *exc: object) -> None:
        collective._Chained.__init__, collective._Chained.progress, ranks_module._DistReduction.add = self._saved

    def counts(self) -> dict[str, int]:
        return {"chained": self.chained, "started_by_progress": self.started_by_progress,
                "most_in_flight": self.most_in_flight}  # fmt: skip


def starts(mesh: fzero.DistMesh, rank: int) -> dict[str, object]:
    """`reduce_scatter_start` / `all_reduce_start` over each axis against the synchronous collectives: values
    (bitwise) and ledgers."""
    x = torch.randn(4, 2, 6, generator=torch.Generator().manual_seed(3))[rank]
    out: dict[str, object] = {}
    for axis in SHAPE:
        for op in ("sum", "mean"):
            with mesh.record() as sync:
                want = (mesh.reduce_scatter(x, op, axis=axis), mesh.all_reduce(x, op, axis=axis))
            with mesh.record() as started:
                handles = (mesh.reduce_scatter_start(x, op, axis=axis), mesh.all_reduce_start(x, op, axis=axis))
                got = tuple(h.wait() for h in handles)
            out[f"{axis}-{op}"] = {
                "equal": all(torch.equal(a, b) for a, b in zip(want, got, strict=True)),
                "same_ledger": sync.as_dict() == started.as_dict(),
                "ledger": started.as_dict(),
            }
    return out


def one_rank_shards(rank: int) -> dict[str, bool]:
    """On a (4, 1) mesh a unit's reduce-scatter over the one-rank `shard` axis returns its input: the all-reduce
    over `replicate` that follows must not reduce in it (it is the caller's gradient). Per average and overlap:
    the input unchanged and the result the mean over the ranks."""
    mesh = fzero.DistMesh(shape={"replicate": 4, "shard": 1})
    rows = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    out = {}
    for average, avg in AVERAGES.items():
        tx = fzero.reduce_scatter(axis="shard", replicate="replicate", average=avg)
        for overlap in (False, True):
            x = rows[rank].clone()
            got = tx.unit(x, 0, fzero.Context(mesh, None, overlap=overlap))  # type: ignore[arg-type]
            got = got if isinstance(got, torch.Tensor) else got.wait()
            out[f"{average}-{overlap}"] = torch.equal(x, rows[rank]) and torch.allclose(got, rows.mean(0))
    return out


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh(shape=SHAPE)
    results: dict[str, object] = {"starts": starts(mesh, rank), "one_rank_shards": one_rank_shards(rank), "cases": {}}
    for case in CASES:
        runs = {}
        for key, budget in BUDGETS.items():
            with Watch() as watch:
                runs[key] = (*train(mesh, *case, budget, rank), watch.counts())
        base, comm, _, _ = runs["wait"]
        results["cases"][name(*case)] = {
            key: {"differ": differing(base, got), "same_comm": c == comm, "comm": c, "peaks": peaks, **counts}
            for key, (got, c, peaks, counts) in runs.items()
        }
        if rank == 0:
            torch.save(base, f"{out_dir}/{name(*case)}.pt")
    with open(f"{out_dir}/results-{rank}.json", "w") as f:  # every rank's: each checks its own replica's values
        json.dump(results, f)
    dist.barrier()
    process_group.shutdown()

"""The two ways a step runs its units through `fzero.sharding.schedule.Gatherer`: every rank of this process in
turn, forward and backward (`sharded_backward`: the functional step, evaluation), or one rank driven imperatively,
its forwards and backwards called by the user (`UnitGathering`: the engine). Both reduce each unit's gradient as
soon as it is complete, with the chain's own reduction.

On a `SimMesh` the ranks run one after another, so a unit's gradient is reduced once every rank's backward is done;
the arithmetic (a rank-ordered sum divided by the world size) and the ledger are those of a real run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..layout import Layout
from ..mesh import CollectiveError, Mesh, RankMesh
from ..mesh.ranks import one_rank, ranks_of
from ..storage import Offloaded, UnitReader
from .gathered_unit import EXACT, GatherSpec, Phase
from .policy import GatherPolicy
from .schedule import Abandoned, Gatherer

__all__ = [
    "Abandoned",
    "GatherPolicy",
    "UnitGathering",
    "compute_device",
    "frozen_shard",
    "on_disk",
    "sharded_backward",
]


def frozen_shard(frozen: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """The frozen shard in the dtype the forward computes in."""
    if frozen is None:
        return None
    return frozen.detach() if dtype is None or frozen.dtype == dtype else frozen.to(dtype)


def _reused_result(reader: UnitReader | None) -> bool:
    """Whether the reduction's result, the gradient (shard), is a buffer kept from one step to the next
    (`_DistReduction`'s `reuse`): wherever the units are in memory. At stage 3 it is then resident through the
    forward too, where a fresh one would be faulted in unit by unit in the backward, every step: 13,300 page faults a
    step for a 27.3M model on 2 ranks (docs/performance.md), for a peak at most its size higher (tests/test_zero3.py's
    bound holds). Units read from disk get a fresh one: that tier is for models that do not fit."""
    return reader is None


def compute_device(model: nn.Module, frozen: Tensor | None = None) -> torch.device:
    """The device a step computes on, for a compute shard on disk (an `Offloaded` has none but the host): the
    frozen shard's (in memory, where the units are gathered), else that of the model's first parameter or buffer
    off the `meta` device (`fzero.init` leaves the model where it is; the engine's module keeps its emptied
    parameters on its device), else the CPU."""
    if frozen is not None:
        return frozen.device
    for t in itertools.chain(model.parameters(), model.buffers()):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def on_disk(
    compute: Any, depth: int, local: bool = False, device: torch.device | None = None
) -> tuple[Tensor, UnitReader | None]:
    """A compute shard offloaded to disk as an empty placeholder of its dtype on `device` (default: the CPU), the
    step's compute device (per rank, or with `local` this rank's alone: the autograd leaf the units hang from; the
    units are gathered into buffers like it), and the reader its units come from, `depth` units ahead, each put on
    `device`; any other shard as it is, and None."""
    if not isinstance(compute, Offloaded):
        return compute, None
    shape = (compute.shape[0], 0) if compute.ndim == 2 and not local else (0,)
    return torch.empty(shape, dtype=compute.dtype, device=device), UnitReader(compute, depth, device)


class UnitGathering:
    """One rank's unit-at-a-time gathering across an imperative forward and backward (for the engine).

    Create it before the forward, run the forward with `params()` bound (the units kept gathered; the others are
    swapped into their modules by hooks), run the backward of the loss one or more times, then `finish()` returns
    this rank's reduced gradient shard and removes the hooks. With `reducer=None` it serves forwards only
    (evaluation under `no_grad`): every unit is freed right after its module ran; `close()` ends it. Real meshes
    only: on a `SimMesh` the ranks run one after another (see `sharded_backward`).

    Args:
      mesh, layout, model: the engine's.
      compute, frozen: this rank's compute and frozen shards.
      policy: prefetch and persistence.
      reducer: the chain's per-unit reduction (`fzero.transforms.unit_reducer`), as `reducer(grads, unit)`.
      frozen_dtype: the dtype frozen parameters are computed in.
      keep: keep gathered units to the end (stages 1-2) rather than free them after their forward (stage 3).
      gather_spec: how freed units travel (`fzero.sharding.gathered_unit.GatherSpec`).
    """

    def __init__(
        self,
        mesh: RankMesh,
        layout: Layout,
        model: nn.Module,
        compute: Tensor,
        frozen: Tensor | None,
        policy: GatherPolicy,
        reducer: Callable[[Tensor, int], Tensor] | None,
        frozen_dtype: torch.dtype | None = None,
        keep: bool = False,
        gather_spec: GatherSpec = EXACT,
    ) -> None:
        ranks = one_rank(mesh)
        device = compute_device(model, frozen)
        compute, self._reader = on_disk(compute, max(1, policy.prefetch), local=True, device=device)
        self.shard = compute.detach().requires_grad_(reducer is not None)
        shards = (self.shard, frozen_shard(frozen, frozen_dtype))
        reuse = _reused_result(self._reader)
        self._reduction = None if reducer is None else ranks.reduction(reducer, layout, policy.reduce_budget, reuse)
        self._g = Gatherer(ranks, ranks.indices[0], layout, model, shards, shards, policy, self._reduction, keep,
                           self._reader, gather_spec)  # fmt: skip
        self._handles = self._g.install()
        self._params = self._g.params()

    def params(self) -> dict[str, Tensor]:
        return self._params

    @property
    def peak(self) -> int:
        """The most gathered elements alive at once so far."""
        return self._g.peak

    @property
    def received(self) -> bool:
        """Whether a backward has reached any unit since the gathering began."""
        return any(r.phase is Phase.DONE for r in self._g.units)

    @property
    def times(self) -> dict[str, list[float]] | None:
        """Per-unit forward and backward seconds, with `GatherPolicy(timings=True)`."""
        return self._g.times

    def complete(self, abandoned: bool = False) -> None:
        """Issue the collectives this rank's forward (and backward) did not reach, in the others' order, so that
        theirs pair with them: the gathers of units an early exit skipped, and after an exception (`abandoned`)
        zero gradients for the units no backward reached (`Gatherer.complete`)."""
        self._g.complete(abandoned)

    def finish(self) -> Tensor:
        """Reduce what no gradient reached, free everything, remove the hooks; this rank's gradient shard."""
        try:
            self._g.finish()
            assert self._reduction is not None, "UnitGathering.finish needs a reducer (without one: close())"
            return self._reduction.result()
        finally:
            self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._g.close()
        self._params = {}
        if self._reader is not None:
            self._reader.close()


def _run_rank(g: Gatherer, run: Callable[[dict[str, Tensor], int], Any], rank: int) -> Any:
    """Rank `rank`'s `run` under the gatherer `g`, then the units it did not reach (`Gatherer.finish`). If `run`
    raises on a real mesh, the step's collectives are completed all the same (the others' pair with them), and
    `Abandoned` carries the exception."""
    try:
        out = run(g.params(), rank)
    except Exception as e:
        mesh = g.ranks.mesh
        if len(mesh.local_ranks) == mesh.world or isinstance(e, CollectiveError):
            raise  # one process runs every rank (nothing to complete) / the collectives themselves failed
        g.complete(abandoned=True)
        raise Abandoned(e) from e
    g.complete()
    return out


def sharded_backward(
    mesh: Mesh,
    layout: Layout,
    model: nn.Module,
    shards: tuple[Tensor, Tensor | None],
    policy: GatherPolicy,
    reducer: Callable[[Tensor, int], Tensor] | None,
    run: Callable[[dict[str, Tensor], int], Any],
    keep: bool = False,
    gather_spec: GatherSpec = EXACT,
) -> tuple[Tensor | None, list[Any], dict[str, Any]]:
    """Every rank's forward and backward (or, without a `reducer`, forward only) with unit-at-a-time gathering and
    each unit's gradient reduced as soon as it is complete (the chain's `reducer`).

    Args:
      mesh, layout, model: the step's.
      shards: the compute parameters and the frozen parameters (in the dtype the forward computes in; None without
        frozen parameters), per rank: shards (`[shard_numel]`, or `[world, shard_numel]` on a SimMesh) gathered
        unit by unit, or full buffers (`FULL`: stage 0, or kept from an earlier micro-step).
      policy: prefetch, persistence, overlap of the reductions.
      keep: keep gathered units to the end (`KEEP`, stages 1-2) rather than free them after their forward.
      gather_spec: how freed units travel (`fzero.sharding.gathered_unit.GatherSpec`).
      reducer: the chain's per-unit reduction, `reducer(grads, unit)` (`fzero.transforms.unit_reducer`); None to
        run forwards without gradients (evaluation).
      run: `run(params, rank) -> out`: rank `rank`'s forward and backward (of its scaled loss) with the named
        tensors given, bound into the model for both (an activation-checkpoint recompute reads them in the
        backward); `out` is returned as is.

    Returns:
      This process's reduced gradients per rank (shards, or full buffers for an all-reduce; None without a
      reducer), each rank's `out`, and metrics: `gathered_peak` (the most gathered elements alive at once on a
      rank), `gathered` (the full compute parameters per rank, where they were given whole or kept; else None),
      with hpZ `secondary_peak` (the most secondary-copy elements a rank held at once) and, with
      `policy.timings`, `unit_times`.
    """
    ranks = ranks_of(mesh)
    compute, reader = on_disk(shards[0], max(1, policy.prefetch), device=compute_device(model, shards[1]))
    reuse = _reused_result(reader)
    reduction = None if reducer is None else ranks.reduction(reducer, layout, policy.reduce_budget, reuse)
    outs, peak, kept, times, gathered = [], 0, 0, None, []
    shards = (compute, shards[1])
    try:
        for rank in ranks.indices:
            mine = ranks.pick(shards[0], rank).detach().requires_grad_(reducer is not None)
            mine_frozen = ranks.pick(shards[1], rank)
            g = Gatherer(ranks, rank, layout, model, (mine, mine_frozen), shards, policy, reduction, keep, reader,
                         gather_spec)  # fmt: skip
            handles = g.install()
            try:
                outs.append(_run_rank(g, run, rank))
                gathered.append(g.gathered())
            finally:
                for h in handles:
                    h.remove()
                g.close()
            peak, times = max(peak, g.peak), times if times is not None else g.times
            kept = max(kept, g.kept_peak)
    finally:
        if reader is not None:
            reader.close()
    info: dict[str, Any] = {"gathered_peak": peak, "gathered": ranks.stack(gathered)}
    if gather_spec.secondary is not None:
        info["secondary_peak"] = kept
    if reduction is not None:
        result = reduction.result()
        info["reduce_in_flight_peak"] = reduction.peak
    if times is not None:
        info["unit_times"] = {k: tuple(v) for k, v in times.items()}
    return (None if reduction is None else result), outs, info

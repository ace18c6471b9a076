"""`GatherPolicy`: how a step schedules its per-unit collectives (prefetch, persistence, the live-element bound,
overlapped reductions and their budget, timings), and the rule an undecided overlap follows (`overlap_pays`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..mesh import Mesh

__all__ = ["GatherPolicy", "overlap_pays"]


@dataclass(frozen=True)
class GatherPolicy:
    """How a step schedules its per-unit collectives: stage 3's gathers, every stage's reductions (DeepSpeed's
    names in brackets).

    Attributes:
      prefetch: units gathered ahead of the one computing [`stage3_prefetch_bucket_size`, in units].
      max_live_elements: the most gathered elements alive at once; a prefetch that would exceed it waits
        [`stage3_max_live_parameters`]. None: no bound beyond `prefetch`.
      persistence_threshold: units with at most this many elements stay gathered for the whole step
        [`stage3_param_persistence_threshold`].
      reuse_distance: a unit stays gathered from its forward into its backward when fewer elements than this are
        gathered between the two, DeepSpeed's count: the later units' forwards and backwards, `2 * sum(size(j) for
        j after i)`. Each unit kept is a gather fewer a step (stage 3 then moves what stage 2 moves) and a buffer
        alive through the forward; 0 keeps only the last unit (its backward comes next) [`stage3_max_reuse_distance`;
        DeepSpeed's default, 1e9, keeps every unit of a model under half a billion elements; the shell's, unset, 0].
      timings: report each gathered-on-demand unit's forward and backward wall time (seconds, rank 0's on a
        SimMesh) in the step's metrics as `unit_times`: `{unit name: (forward, backward)}`.
      overlap_reduce: start each unit's reduction as soon as its gradient is complete and go on with the backward
        without waiting for it (a `DistMesh` backend's threads run it); all are waited on before the optimizer.
        The same arithmetic in the same order: results are bitwise those without overlap [`overlap_comm`]. None
        (the default): decided for the mesh by `on(mesh)` (`overlap_pays`: on for several processes).
      reduce_bucket_elements: with `overlap_reduce`, the most gradient elements whose reduction is in flight at
        once: before starting one that would exceed it, the oldest are waited on. In-flight gradients stay alive,
        so this bounds the memory overlap costs [`reduce_bucket_size`].
    """

    prefetch: int = 1
    max_live_elements: int | None = None
    persistence_threshold: int = 0
    reuse_distance: int = 0
    timings: bool = False
    overlap_reduce: bool | None = None
    reduce_bucket_elements: int = 500_000_000

    @property
    def reduce_budget(self) -> int | None:
        """The in-flight bound the reduction gets: None without overlap (each unit's reduction is waited for; also
        while `overlap_reduce` is undecided: see `on`)."""
        return self.reduce_bucket_elements if self.overlap_reduce else None

    def on(self, mesh: Mesh) -> GatherPolicy:
        """This policy on `mesh`: an undecided `overlap_reduce` (None) decided by `overlap_pays(mesh)`."""
        if self.overlap_reduce is not None:
            return self
        return dataclasses.replace(self, overlap_reduce=overlap_pays(mesh))

    def __post_init__(self) -> None:
        for name in ("prefetch", "persistence_threshold", "reuse_distance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GatherPolicy.{name} must be an int >= 0, got {value!r}")
        if self.overlap_reduce is not None and not isinstance(self.overlap_reduce, bool):
            raise ValueError(f"GatherPolicy.overlap_reduce must be a bool or None (decided per machine), got "
                             f"{self.overlap_reduce!r}")  # fmt: skip
        bucket = self.reduce_bucket_elements
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"GatherPolicy.reduce_bucket_elements must be an int >= 1, got {bucket!r}")
        if self.max_live_elements is not None and (
            isinstance(self.max_live_elements, bool)
            or not isinstance(self.max_live_elements, int)
            or self.max_live_elements < 1
        ):
            got = self.max_live_elements
            raise ValueError(f"GatherPolicy.max_live_elements must be None or an int >= 1, got {got!r}")


def overlap_pays(mesh: Mesh) -> bool:
    """Whether overlapping each unit's reduction with the backward can make a step faster here: the rule an
    undecided `GatherPolicy(overlap_reduce=None)` follows. On every mesh of several processes; off on a `SimMesh`
    (one process reduces every rank's part at once: nothing is in flight) or one rank.

    Measured where it was most in doubt, on 2 CPU cores shared by 2 gloo ranks of 1 thread
    (`benchmarks/compare.py`, docs/performance.md): whether the reduction's threads take the backward's cores or
    not, a rank that need not wait for each unit's reduction does not wait for the other rank either, and the
    overlapped step was as fast or faster at every stage in every paired run. (NCCL reduces on the accelerator's
    own engines: there it pays more.) The cost is memory: each unit's gradient stays alive while its reduction is
    in flight, at most `reduce_bucket_elements` of them.
    """
    return len(mesh.local_ranks) < mesh.world  # (the other ranks run in processes of their own)

"""`Plan`: what a transform chain does to a step, derived once at `fzero.init` and kept in the `TrainState`.

Every run-time decision of the step and the engine (gather the compute parameters unit by unit or at once, keep
them through the backward, reduce each unit in the backward, where the optimizer's state is) reads the plan; none
searches the chain's state for a transform's name or infers a stage from a buffer's shape. The plan is made from
what each transform *declares* (`fzero.Transform.does`, `reduces`, `unit`) and from what its `init` did (whether
the master parameters came out sharded), by `fzero.transforms.plan_of`, which refuses an ambiguous chain there.

The ZeRO stage is a label read off the plan, for people:

    stage 0   the master parameters are whole on every rank (no reduce_scatter)
    stage 1   sharded; full-size gradients accumulated before the reduction (one reduction per update)
    stage 2   sharded; gradients reduced every micro-step; compute parameters kept gathered through the backward
    stage 3   sharded; compute parameters sharded at rest, each unit gathered for its forward and again for its
              backward (`gather(lazy=True)`, or no `gather` at all: the master parameters are what is gathered)

(`zero1(..., accumulate=1)` accumulates nothing, so it is, exactly, stage 2.)

Example:
    >>> import torch, fzero
    >>> state = fzero.init(torch.nn.Linear(4, 4), fzero.zero2(fzero.adamw(), accumulate=2), fzero.SimMesh(2))
    >>> p = state.plan
    >>> p.stage, p.sharded_at_rest, p.keep_gathered, p.accumulate, p.accumulate_before_reduce
    (2, True, True, 2, False)
    >>> dict(p.paths)["update"], int(p.state_of(state.tx_state, "update").count)
    (('shard_update',), 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from ..sharding.gathered_unit import EXACT, GatherSpec

__all__ = ["EXACT", "GatherMode", "GatherSpec", "Plan", "Role"]  # (GatherSpec, EXACT: fzero.sharding's)

GatherMode = Literal["now", "lazy", "keep"]
Role = Literal["accumulate", "scale_loss", "update", "gather"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A chain's effect on the step (static: no tensors; hashable).

    Attributes:
      stacked: per-rank values carry a leading world axis (the state belongs to a `SimMesh`).
      world: the ranks the parameters are sharded over.
      sharded: the master parameters and the optimizer state are this rank's shard (the chain reduce-scatters).
      reduces: the chain averages gradients over ranks.
      per_unit: the chain's reduction can run unit by unit (every transform up to it has a `unit` form), so the
        backward can reduce each unit's gradient as soon as it is complete.
      accumulate: micro-steps per update (1: none).
      accumulate_before_reduce: the accumulation holds full gradients ahead of the reduction (stage 1).
      gather: how the chain makes compute parameters: `"now"` (all-gathered at the end of the step), `"lazy"` (kept
        as the shard; each unit gathered as the forward reaches it and freed after), `"keep"` (lazy, kept through
        the backward and an accumulation window), or None (no gather: the master parameters are computed with).
      sharded_at_rest: between steps the compute (and frozen) parameters are this rank's shard, gathered by the
        step; False at world 1, where a shard is the whole buffer.
      keep_gathered: units gathered for the forward stay gathered to the end of the backward, and the gathered
        buffer through an accumulation window.
      compute_dtype: the dtype the forward computes in.
      paths: where each role's state sits in the chain's state, `(role, keys)` in chain order.
      speculative: the update runs speculatively, unit by unit, during the backward (SuperOffload:
        `fzero.Offload(..., speculate=True)`), validated before it is taken.
      gather_spec: how lazily gathered units travel (`GatherSpec`).
    """

    stacked: bool
    world: int
    sharded: bool
    reduces: bool
    per_unit: bool
    accumulate: int
    accumulate_before_reduce: bool
    gather: GatherMode | None
    sharded_at_rest: bool
    keep_gathered: bool
    compute_dtype: torch.dtype
    paths: tuple[tuple[Role, tuple[str, ...]], ...] = ()
    speculative: bool = False
    gather_spec: GatherSpec = EXACT

    @property
    def stage(self) -> int:
        """The ZeRO stage this plan is (see the module docstring)."""
        if not self.sharded:
            return 0
        if self.gather in (None, "lazy"):
            return 3
        return 1 if self.accumulate > 1 and self.accumulate_before_reduce else 2

    def state_of(self, tx_state: Any, role: Role) -> Any:
        """The state of the transform playing `role` in `tx_state` (the chain's state), or None without one."""
        keys = dict(self.paths).get(role)
        if keys is None:
            return None
        for key in keys:
            tx_state = tx_state[key]
        return tx_state

    def path_of(self, role: Role) -> tuple[str, ...] | None:
        """The keys of `role`'s state in the chain's state (None without one)."""
        return dict(self.paths).get(role)

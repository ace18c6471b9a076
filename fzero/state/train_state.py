"""The training state: one immutable pytree of per-rank flat buffers.

`TrainState` is an optree dataclass in the ``"fzero"`` namespace and is also registered with
`torch.utils._pytree`, so it crosses `torch.func` and `torch.compile` boundaries. Only tensors are leaves; the
`Layout` is static metadata. A state is never modified: every step returns a new one, and a caller holding an old
state keeps seeing its old values (unless it asked for buffer donation).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import Tensor

from ..layout import Layout
from .plan import Plan

__all__ = ["TrainState", "pytree", "pytree_dataclass", "static_field"]

pytree = optree.pytree.reexport(namespace="fzero")


if TYPE_CHECKING:  # (mypy sees no decorator through the re-exported module; optree's is the stdlib's, plus pytrees)
    from dataclasses import dataclass as pytree_dataclass
else:
    pytree_dataclass = pytree.dataclasses.dataclass


def static_field(**kwargs: Any) -> Any:
    """A `pytree_dataclass` field that is part of the tree's structure (static metadata), not one of its leaves."""
    return optree.dataclasses.field(pytree_node=False, **kwargs)  # type: ignore[call-overload]  # optree's stub omits it


@pytree_dataclass(frozen=True)
class TrainState:
    """Everything a step reads and writes.

    Attributes:
      step: micro-steps taken so far (0-d int64).
      params: master parameters per rank: this rank's shard (`[shard_numel]`) or, for stage 0, the full buffer
        (`[numel]`); with a leading world axis on `SimMesh`.
      compute: the compute parameters for the next forward, in the compute dtype: full (`[numel]` per rank), or
        this rank's shard where the stage gathers them at the start of each step (stage 3).
      tx_state: the transform's state (`{name: state}` for a chain; the loss scale is `scale_loss`'s).
      frozen: the parameters with `requires_grad=False`, in their own flat buffer (`layout.frozen_layout`), in
        their own dtype, never updated: full on every rank, or this rank's shard where the stage shards compute
        parameters at rest (stage 3); None when the model has none.
      buffers: module buffers (e.g. BatchNorm statistics), by name, per rank.
      seed: the step's random stream (0-d int64): micro-step `s` of rank `r` draws from `fold(seed, s, r)`
        (`fzero.step`), the same on `SimMesh` and `DistMesh`.
      layout: the static map from names to flat offsets and shards.
      frozen_dtype: the dtype frozen parameters are computed in (static; None: their own). Set from the compute
        dtype the chain casts trainable parameters to, so that a mixed-precision forward sees one dtype.
      plan: what the chain does to a step (`fzero.Plan`, static), derived at `init`; every run-time decision
        reads it.
    """

    step: Tensor
    params: Tensor
    compute: Tensor | None
    tx_state: Any
    frozen: Tensor | None
    buffers: dict[str, Tensor]
    seed: Tensor
    # (optree's `field` takes `pytree_node`; its stubs are dataclasses')
    layout: Layout = static_field()
    frozen_dtype: torch.dtype | None = static_field(default=None)
    # (None only in a hand-made state; `fzero.init` always sets it, and everything that reads it takes it as set)
    plan: Plan = static_field(default=None)

    def replace(self, **changes: Any) -> TrainState:
        """A copy with some fields replaced (the state itself is frozen)."""
        return dataclasses.replace(self, **changes)

    @property
    def simulated(self) -> bool:
        """Whether the state belongs to a `SimMesh` (per-rank values on a leading world axis): `plan.stacked`."""
        return self.plan.stacked if self.plan is not None else self.params.ndim == 2

    @property
    def sharded_at_rest(self) -> bool:
        """Whether the compute parameters are kept as this rank's shard between steps (stages 1-3): the step then
        gathers them, and the frozen parameters, one unit at a time (`plan.sharded_at_rest`)."""
        return self.plan is not None and self.plan.sharded_at_rest


def register_torch_pytree(cls: type) -> type:
    """Register an ``"fzero"`` optree dataclass with `torch.utils._pytree` too, with the same children and static
    metadata, so `torch.func` and `torch.compile` see through it."""
    fields = dataclasses.fields(cls)
    nodes = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    static = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in nodes], tuple(getattr(obj, n) for n in static)

    def unflatten(values: Any, meta: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(nodes, values, strict=True)), **dict(zip(static, meta, strict=True)))

    torch_pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"fzero.{cls.__name__}",
        flatten_with_keys_fn=lambda obj: (
            [(torch_pytree.GetAttrKey(n), getattr(obj, n)) for n in nodes],
            tuple(getattr(obj, n) for n in static),
        ),
    )
    return cls


register_torch_pytree(TrainState)


def count(value: int = 0) -> Tensor:
    """A 0-d int64 counter on the CPU (read on the host without a device sync)."""
    return torch.tensor(value, dtype=torch.int64)

"""`plan_of`: a chain's `fzero.Plan`, from what its transforms declare, at `fzero.init`.

A transform declares its part (`Transform.does`, `reduces`, `unit`); the plan reads the declarations in chain order
(nested chains flattened) and the one fact only `init` knows, whether the master parameters came out sharded. A
chain whose declarations are ambiguous is refused here, naming the transforms: two transforms in one role (two
gathers, two accumulations, two loss scales, two optimizers), or an accumulation after the update.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from ..state.plan import EXACT, GatherMode, Plan, Role
from .base import Transform

__all__ = ["plan_of", "shards", "spill_of", "transform_at"]


def _leaves(tx: Transform, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Transform]]:
    """The chain's transforms in order, with their state's keys (a lone transform's state is its own)."""
    if not tx.children:
        yield path, tx
        return
    for name, child in tx.children:
        yield from _leaves(child, (*path, name))


def shards(tx: Transform) -> bool:
    """Whether chain `tx` has a transform whose `init` shards the parameters and takes them presharded
    (`Does.shards`: `reduce_scatter()`, stages 1-3), so `fzero.init` can construct the shard unit by unit."""
    return any(t.does.shards for _, t in _leaves(tx))


def spill_of(tx: Transform) -> str | os.PathLike[str] | None:
    """The directory a transform of chain `tx` writes the master shard to at init (`Does.spill`: the NVMe tier), so
    `fzero.init` may build the shard in a file there; None where none does."""
    return next((t.does.spill for _, t in _leaves(tx) if t.does.spill is not None), None)


def transform_at(tx: Transform, path: tuple[str, ...] | None) -> Transform:
    """The transform of chain `tx` whose state sits at `path` (a role's, from `Plan.path_of`)."""
    for p, t in _leaves(tx):
        if p == path or (not tx.children and path == ()):
            return t
    raise ValueError(f"the chain has no transform at {path!r}: was it changed after init?")


def _role(tx: Transform) -> Role | None:
    does = tx.does
    if does.accumulates:
        return "accumulate"
    if does.scales_loss:
        return "scale_loss"
    if does.updates:
        return "update"
    if does.gathers is not None:
        return "gather"
    return None


def plan_of(tx: Transform, *, sharded: bool, world: int, stacked: bool, compute_dtype: torch.dtype) -> Plan:
    """The plan of chain `tx`, given what its `init` did.

    Args:
      tx: the transform (a chain, or a lone transform).
      sharded: `init` left the master parameters as this rank's shard.
      world: the ranks they are sharded over (the layout's world).
      stacked: the mesh holds per-rank values on a leading world axis.
      compute_dtype: the dtype of the compute parameters `init` made.

    Raises:
      ValueError: two transforms declare the same role, or the chain accumulates after its update.
    """
    paths: dict[Role, tuple[str, ...]] = {}
    order: list[Role] = []
    reduced_at = None
    accumulate, accumulate_at, gather, speculative, gather_spec = 1, None, None, False, EXACT
    for i, (path, t) in enumerate(_leaves(tx)):
        if t.reduces and reduced_at is None:
            reduced_at = i
        role = _role(t)
        if role is None:
            continue
        if role in paths:
            raise ValueError(f"the chain has two transforms that {_VERB[role]}: {'/'.join(paths[role])!r} and "
                             f"{'/'.join(path)!r}; a step can only do that once")  # fmt: skip
        if role == "accumulate" and "update" in paths:
            raise ValueError(f"the chain accumulates ({'/'.join(path)!r}) after its update "
                             f"({'/'.join(paths['update'])!r}): put accumulate() before the update")  # fmt: skip
        paths[role] = path
        order.append(role)
        if role == "accumulate":
            accumulate, accumulate_at = t.does.accumulates, i
        elif role == "gather":
            gather, gather_spec = t.does.gathers, t.does.gather_spec
        elif role == "update":
            speculative = t.speculate is not None
    mode: GatherMode | None = gather  # type: ignore[assignment]  # (declared as str: checked below)
    if mode not in (None, "now", "lazy", "keep"):
        raise ValueError(f"a transform declares gathers={mode!r}; expected 'now', 'lazy' or 'keep'")
    at_rest = sharded and world > 1 and mode != "now"
    per_unit = tx.reduces and tx.unit is not None
    if speculative and not per_unit:
        raise ValueError(f"{'/'.join(paths['update'])!r} speculates (Offload(speculate=True): SuperOffload), which "
                         "updates each unit as the backward reduces its gradient, but this chain reduces only after "
                         "the backward (stage 1 accumulating full gradients, or a reduction without a unit form): "
                         "use zero2/zero3, or drop speculate")  # fmt: skip
    return Plan(
        stacked=stacked,
        world=world,
        sharded=sharded,
        reduces=tx.reduces,
        per_unit=per_unit,
        accumulate=accumulate,
        accumulate_before_reduce=accumulate_at is not None and (reduced_at is None or accumulate_at < reduced_at),
        gather=mode,
        sharded_at_rest=at_rest,
        keep_gathered=mode == "keep",
        compute_dtype=compute_dtype,
        paths=tuple((r, paths[r]) for r in order),
        speculative=speculative,
        gather_spec=gather_spec,
    )


_VERB: dict[Role, str] = {
    "accumulate": "accumulate gradients",
    "scale_loss": "scale the loss",
    "update": "update the parameters",
    "gather": "gather the compute parameters",
}

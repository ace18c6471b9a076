"""Composing transforms: `chain` and `named_chain`, and what a composed chain gives the step: its per-unit
reduction (`unit_reducer`), its state by name or kind (`lookup`, `find`), and its functions run on every rank
(`apply_init`, `apply_update`: a transform given to `fzero.init` alone, not in a chain, runs as a chain's child
would).
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

from ..layout.pieces import takes_pieces
from ..mesh import Work
from . import per_rank
from .base import Context, Flow, Transform, UnitFn

__all__ = ["apply_init", "apply_update", "chain", "find", "lookup", "named_chain", "unit_reducer"]


def apply_init(tx: Transform, flow: Flow, ctx: Context) -> tuple[Flow, Any]:
    """`tx.init` as the step calls it: on every rank where `tx` is written for one (`Transform.per_rank`). Hand
    `flow` over (keep no reference): a sharding chain frees the full parameters before its state is made."""
    box = [flow]
    del flow
    return per_rank.init(tx, tx.name, box.pop(), ctx)


def apply_update(tx: Transform, flow: Flow, state: Any, ctx: Context) -> tuple[Flow, Any]:
    """`tx.update` as the step calls it: on every rank where `tx` is written for one (`Transform.per_rank`)."""
    return per_rank.update(tx, tx.name, flow, state, ctx)


def _unique(names: list[str]) -> list[str]:
    """Names made unique in order: a repeated name gets `#1`, `#2`, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}#{n}")
    return out


def _compose_units(pairs: tuple[tuple[str, Transform], ...]) -> tuple[UnitFn | None, bool]:
    """The chain's `unit` (the per-unit forms up to and including the first reduction) and whether it reduces."""
    upto = next((i for i, (_, t) in enumerate(pairs) if t.reduces), None)
    if upto is None:
        return None, False
    maybe = [per_rank.unit_form(t, n) for n, t in pairs[: upto + 1]]
    prefix = [u for u in maybe if u is not None]
    if len(prefix) < len(maybe):
        return None, True

    def unit(grads: Tensor, index: int, ctx: Context) -> Tensor | Work:
        for fn in prefix[:-1]:  # before the reduction: no handle, a tensor
            grads = cast(Tensor, fn(grads, index, ctx))
        return prefix[-1](grads, index, ctx)

    unit.takes_pieces = all(takes_pieces(fn) for fn in prefix)  # type: ignore[attr-defined]  # (`fzero.layout.pieces`)
    return unit, True


def named_chain(*pairs: tuple[str, Transform], name: str = "chain") -> Transform:
    """Compose transforms left to right; the state is `{name: state}`, in order.

    A transform that defers the micro-step (`accumulate` before its boundary) stops the chain there: the
    transforms after it do no work and keep their state. Gradients that arrive reduced (stage 3 reduced them unit
    by unit with this chain's `unit`) skip the transforms up to and including the reduction.

    Example:
      >>> import fzero
      >>> tx = fzero.named_chain(("reduce", fzero.reduce_scatter()), ("adam", fzero.shard_update(fzero.adamw())))
      >>> tx.reduces, tx.unit is not None
      (True, True)
    """
    names = [n for n, _ in pairs]
    for i, (n, t) in enumerate(pairs):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} ({n!r}) is a {type(t).__name__}, not a Transform")
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain: names must be unique, got {names}")
    unit, reduces = _compose_units(pairs)
    # where gradients that arrive reduced resume: after the reducing transform, or at it when it is a chain itself
    # (it skips to after its own reduction, and runs what follows the reduction inside it)
    first_after = next((i + (not t.children) for i, (_, t) in enumerate(pairs) if t.reduces), 0)

    def init(flow: Flow, ctx: Context) -> tuple[Flow, dict[str, Any]]:
        states = {}
        for n, t in pairs:
            flow, states[n] = per_rank.init(t, n, flow, ctx)
        return flow, states

    def update(flow: Flow, state: dict[str, Any], ctx: Context) -> tuple[Flow, dict[str, Any]]:
        if not isinstance(state, dict) or list(state) != names:
            got = list(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"chain of transforms {names} got a state for {got}; was the chain changed after init?")
        new = dict(state)
        for n, t in pairs[first_after if flow.info.reduced else 0 :]:
            flow, new[n] = per_rank.update(t, n, flow, state[n], ctx)
            if flow.info.deferred:
                break
        return flow, new

    axis = next((t.axis for _, t in pairs if t.axis is not None), None)
    return Transform(init, update, name, unit, reduces, tuple(pairs), axis, per_rank=False)


def chain(*transforms: Transform) -> Transform:
    """Compose transforms left to right; the state is `{name: state}` under each transform's name (`#1`, `#2` for
    repeats), see `named_chain`.

    Example:
      >>> import fzero
      >>> tx = fzero.chain(fzero.reduce_scatter(), fzero.shard_update(fzero.adamw(1e-3)), fzero.gather())
      >>> [name for name, _ in tx.children]
      ['reduce_scatter', 'shard_update', 'gather']
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"chain: argument {i} is a {type(t).__name__}, not a Transform")
    return named_chain(*zip(_unique([t.name for t in transforms]), transforms, strict=True))


def unit_reducer(tx: Transform) -> UnitFn:
    """The per-unit reduction of a chain (what stage 3 calls for each unit as its gradient completes).

    Raises:
      ValueError: the chain does not reduce, or a transform before its reduction cannot run per unit (it names it).
    """
    if tx.unit is not None and tx.reduces:
        return cast(UnitFn, per_rank.unit_form(tx, tx.name))
    if not tx.reduces:
        raise ValueError(
            f"{tx.name}: stage 3 reduces each unit's gradient in the backward with the chain's reduction, but the "
            "chain has none: put reduce_scatter() (or a transform wrapping it) in it"
        )
    where, reduction = _blocker(tx)
    if reduction:
        raise ValueError(f"stage 3 reduces each unit's gradient in the backward, but {where} is the chain's "
                         "reduction and has no unit form: give it one (fzero.Transform(..., unit=...)), or use it at "
                         "stages 0-2, which reduce the whole gradient after the backward")  # fmt: skip
    raise ValueError(f"stage 3 reduces each unit's gradient in the backward, but {where} comes before the "
                     "reduction and cannot run per unit: put it after reduce_scatter(), or give it a unit function "
                     "(fzero.Transform(..., unit=...))")  # fmt: skip


def _blocker(tx: Transform) -> tuple[str, bool]:
    """The first transform up to the reduction without a per-unit form, named along its chains, and whether it is
    the reduction itself."""
    for name, t in tx.children:
        if t.children and t.reduces and t.unit is None:
            where, reduction = _blocker(t)
            return f"{name}/{where}", reduction
        if t.unit is None:
            return repr(name), t.reduces
        if t.reduces:
            break
    return repr(tx.name), tx.reduces and not tx.children


def lookup(tx_state: Any, name: str) -> Any:
    """The state of the first transform called `name` (searching nested chains in order), or None.

    Example:
      >>> import torch, fzero
      >>> state = fzero.init(torch.nn.Linear(2, 2), fzero.zero2(fzero.adamw()), fzero.SimMesh(1))
      >>> int(lookup(state.tx_state, "shard_update").count)
      0
    """
    if not isinstance(tx_state, dict):
        return None
    if name in tx_state:
        return tx_state[name]
    for sub in tx_state.values():
        found = lookup(sub, name)
        if found is not None:
            return found
    return None


def find(tx_state: Any, kind: type | tuple[type, ...]) -> Any:
    """The first state of type `kind` in a chain's state (searching nested chains in order), or None.

    What a transform *is* shows in the type of the state it keeps (`GatherState`, `AccumulateState`), which a
    user's name for it in `named_chain` does not change; use this, not `lookup`, to ask what a chain does.

    Example:
      >>> import torch, fzero
      >>> from fzero.transforms.collective import GatherState
      >>> tx = fzero.named_chain(("r", fzero.reduce_scatter()), ("u", fzero.shard_update(fzero.adamw())),
      ...                        ("g", fzero.gather(lazy=True, keep=True)))
      >>> find(fzero.init(torch.nn.Linear(2, 2), tx, fzero.SimMesh(2)).tx_state, GatherState).keep
      True
    """
    if isinstance(tx_state, kind):
        return tx_state
    if isinstance(tx_state, dict):
        for sub in tx_state.values():
            found = find(sub, kind)
            if found is not None:
                return found
    return None

"""Per-tensor reductions on a flat buffer: what an optimizer like Lamb needs that no elementwise op gives.

An optimizer runs on one flat buffer: the full buffer (stage 0), or a rank's shard, which holds a piece of some
parameter tensors (stages 1-3). A per-tensor quantity such as `||w||` needs every piece of the tensor. `Tensors`
says where each tensor lies in the buffer (`runs`), and `sums(x, ...)` returns each tensor's sum of squares of `x`:

    partial[r, k] = sum over tensor k's piece in row r of x^2          (float64, one dot product per piece)
    total[k]      = partial[0, k] + partial[1, k] + ... (rank order)     (when the rows are shards of the tensor)

The rows are the ranks' buffers a call sees: one on a `DistMesh` rank, `world` on a `SimMesh` (its `[world, n]`
buffers). Sharded, the partial sums travel in one all-gather of `count` float64 values per rank and summed buffer
(`total`, which `shard_update` builds from the mesh) and every rank adds them in rank order, so a `DistMesh` gives
what a `SimMesh` gives, bitwise, and the collective is in the ledger. Padding is in no tensor: it stays zero.

Example:
    >>> import torch
    >>> from fzero.layout import make_layout
    >>> lay = make_layout([("w", (4,), torch.float32), ("b", (2,), torch.float32)], world=2, align=1)
    >>> t = tensors_of(lay, full=False, ranks=(0, 1), total=lambda partial: partial.sum(0).expand_as(partial))
    >>> t.runs                                   # rank 0 holds w[:3]; rank 1 holds w[3:] and b
    ((0, 3, 0), (3, 4, 0), (4, 6, 1))
    >>> t.sums(torch.arange(1.0, 7.0).view(2, 3))[0].tolist()   # w: 1 + 4 + 9 + 16; b: 25 + 36
    [[30.0, 61.0], [30.0, 61.0]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import Layout

__all__ = ["Tensors", "rank_ordered_total", "tensors_of"]


@dataclass(frozen=True, eq=False)
class Tensors:
    """Where each parameter tensor lies in a flat buffer of `rows` rows end to end.

    Attributes:
      runs: `(start, stop, tensor)` per piece, offsets in the flattened buffer (rows end to end), ascending.
      rows: the number of rows (ranks' buffers) the buffer holds.
      count: the number of tensors.
      total: `[rows, count]` partial sums of each row -> `[rows, count]` every tensor's sums over the ranks that
        hold a piece of it (the identity where each row holds whole tensors).
      names, shapes: each tensor's parameter name and shape.
      ranks: each row's rank along the sharding axis.
      layout: the layout, where the rows hold shards (None: whole tensors), for `whole`'s owner plan.
      exchange: the mesh's all-to-all, `[rows, world * s] -> [rows, world, s]`, for `whole` on shards.
    """

    runs: tuple[tuple[int, int, int], ...]
    rows: int
    count: int
    total: Callable[[Tensor], Tensor]
    names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    ranks: tuple[int, ...] = (0,)
    layout: Layout | None = None
    exchange: Callable[[Tensor], Tensor] | None = None

    def whole(self, x: Tensor, select: Sequence[int], fn: Callable[[int, Tensor], Tensor]) -> Tensor:
        """`fn` applied to each selected tensor of `x` whole, the results back in `x`'s places (zero elsewhere).

        Where the rows hold shards (`layout` is set), tensor `k` is worked on by its owner rank (`owners`: the
        selected tensors spread over the ranks by size): every rank sends the owners its pieces (one all-to-all of
        equal chunks, each as long as the longest), each owner assembles its tensors, applies `fn(k, tensor)`
        (shaped as the parameter), and sends every rank its pieces of the results (a second all-to-all). Where the
        rows hold whole tensors, each row applies `fn` itself.
        """
        flat = x.reshape(-1)
        out = torch.zeros_like(flat)
        chosen = set(select)
        width = flat.numel() // self.rows if self.rows else 0
        if self.layout is None:  # whole tensors in every row
            for a, b, k in self.runs:
                if k in chosen:
                    out[a:b] = fn(k, flat[a:b].view(self.shapes[k])).reshape(-1)
            return out.view_as(x)
        if self.exchange is None:
            raise ValueError("Tensors.whole on shards needs the mesh's all-to-all (exchange=), which a hybrid "
                             "(two-axis) layout does not provide yet")  # fmt: skip
        plan = _plan(self.layout, tuple(sorted(chosen)))
        world, size = plan.world, plan.size
        send = torch.zeros(self.rows, world, size, dtype=x.dtype, device=x.device)
        for row, rank in enumerate(self.ranks):
            for d in range(world):
                for _, a, b, at in plan.pieces[rank][d]:
                    send[row, d, at : at + b - a] = flat[row * width + a : row * width + b]
        got = self.exchange(send.view(self.rows, world * size))  # [rows, world (from), size]
        back = torch.zeros_like(send)
        for row, owner in enumerate(self.ranks):
            for k in plan.owned[owner]:
                parts = [(s, at, b - a) for s in range(world) for kk, a, b, at in plan.pieces[s][owner] if kk == k]
                whole = torch.cat([got[row, s, at : at + n] for s, at, n in parts])
                result = fn(k, whole.view(self.shapes[k])).reshape(-1)
                done = 0
                for s, at, n in parts:
                    back[row, s, at : at + n] = result[done : done + n]
                    done += n
        mine = self.exchange(back.view(self.rows, world * size))  # [rows, world (from owner), size]
        for row, rank in enumerate(self.ranks):
            for d in range(world):
                for _, a, b, at in plan.pieces[rank][d]:
                    out[row * width + a : row * width + b] = mine[row, d, at : at + b - a]
        return out.view_as(x)

    def sums(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """Each tensor's sum of squares of each of `xs` (shaped like the buffer), float64, `[rows, count]` each;
        the pieces of all of them meet in one `total` call (one collective)."""
        k = self.count
        partial = torch.zeros(self.rows, len(xs) * k, dtype=torch.float64, device=xs[0].device if xs else None)
        for j, x in enumerate(xs):
            flat = x.reshape(-1)
            width = flat.numel() // self.rows if self.rows else 0
            for a, b, t in self.runs:
                piece = flat[a:b].double()
                partial[a // width, j * k + t] = torch.dot(piece, piece)
        total = self.total(partial)
        return tuple(total[:, j * k : (j + 1) * k] for j in range(len(xs)))


@dataclass(frozen=True)
class _Plan:
    """Who works on which tensor, and where each rank's pieces travel: `pieces[s][d]` lists `(tensor, start, stop,
    at)` for rank `s`'s pieces (offsets in its shard) of the tensors rank `d` owns, `at` the piece's place in the
    chunk `s` sends `d`; every chunk is `size` elements (the largest), `owned[d]` rank `d`'s tensors."""

    world: int
    size: int
    owned: tuple[tuple[int, ...], ...]
    pieces: tuple[tuple[tuple[tuple[int, int, int, int], ...], ...], ...]


def owners(numels: Sequence[int], world: int) -> tuple[int, ...]:
    """Each tensor's owner rank: the largest first, each to the rank with the fewest elements so far (the lowest
    such rank on a tie), so the ranks' shares differ by at most the largest tensor.

    Example:
        >>> owners([10, 3, 8, 2], 2)   # 10 -> rank 0; 8 -> 1; 3 -> 1 (8 < 10); 2 -> 0 (10 < 11)
        (0, 1, 1, 0)
    """
    load = [0] * world
    out = [0] * len(numels)
    for k in sorted(range(len(numels)), key=lambda k: (-numels[k], k)):
        out[k] = min(range(world), key=lambda r: (load[r], r))
        load[out[k]] += numels[k]
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _plan(layout: Layout, select: tuple[int, ...]) -> _Plan:
    """The plan for the tensors `select` (ascending) of `layout`: only their pieces travel."""
    world = layout.world
    owner = dict(zip(select, owners([layout.leaves[k].numel for k in select], world), strict=True))
    pieces: list[list[list[tuple[int, int, int, int]]]] = [[[] for _ in range(world)] for _ in range(world)]
    for s in range(world):
        fill = [0] * world
        for a, b, k in sorted(_runs(layout, False, (s,)), key=lambda run: run[2]):
            if k not in owner:
                continue
            d = owner[k]
            pieces[s][d].append((k, a, b, fill[d]))
            fill[d] += b - a
    size = max((sum(b - a for _, a, b, _ in chunk) for row in pieces for chunk in row), default=0)
    owned = tuple(tuple(k for k in select if owner[k] == d) for d in range(world))
    return _Plan(world, size, owned, tuple(tuple(tuple(c) for c in row) for row in pieces))


def rank_ordered_total(gather: Callable[[Tensor], Tensor], world: int) -> Callable[[Tensor], Tensor]:
    """The `total` of a sharded buffer: `gather` (the mesh's all-gather over the sharding axis, `[..., k]` ->
    `[..., world * k]`) brings every rank's partial sums, which are then added in rank order."""

    def total(partial: Tensor) -> Tensor:
        got = gather(partial).unflatten(-1, (world, partial.shape[-1]))
        out = got[..., 0, :]
        for r in range(1, world):
            out = out + got[..., r, :]
        return out

    return total


def tensors_of(
    layout: Layout,
    *,
    full: bool,
    ranks: Sequence[int],
    total: Callable[[Tensor], Tensor] | None = None,
    exchange: Callable[[Tensor], Tensor] | None = None,
) -> Tensors:
    """The tensors of the buffer an optimizer updates: the full buffer (`full`) or a shard, of each rank in
    `ranks` end to end (a `SimMesh`'s `[world, n]` buffer is all ranks' buffers end to end).

    Args:
      layout: the parameters' layout.
      full: the buffer holds whole tensors (stage 0) rather than shards.
      ranks: the rows' ranks (their coordinates along the sharding axis).
      total: how partial sums of shards become totals (`rank_ordered_total`); ignored with `full`.
      exchange: the mesh's all-to-all over the sharding axis, `[rows, world * s] -> [rows, world, s]` (row `k` of
        the result from rank `k`), for `Tensors.whole`; ignored with `full`.
    """
    runs = _runs(layout, full, tuple(ranks))
    identity: Callable[[Tensor], Tensor] = lambda partial: partial  # noqa: E731
    sharded = not full and layout.world > 1
    return Tensors(
        runs,
        len(ranks),
        len(layout.leaves),
        total if sharded and total is not None else identity,
        tuple(leaf.name for leaf in layout.leaves),
        tuple(leaf.shape for leaf in layout.leaves),
        tuple(ranks),
        layout if sharded else None,
        exchange if sharded else None,
    )


@functools.lru_cache(maxsize=64)
def _runs(layout: Layout, full: bool, ranks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    runs: list[tuple[int, int, int]] = []
    width = layout.numel if full else layout.shard_numel
    for row, rank in enumerate(ranks):
        base = row * width
        for k, leaf in enumerate(layout.leaves):
            lo, hi = leaf.offset, leaf.offset + leaf.numel
            if full:
                if hi > lo:
                    runs.append((base + lo, base + hi, k))
                continue
            unit = layout.units[leaf.unit]
            c = unit.size // layout.world
            a, b = max(lo, unit.start + rank * c), min(hi, unit.start + (rank + 1) * c)
            if b > a:  # the piece's place in the shard: the unit's chunk starts at shard_start
                start = base + unit.shard_start + a - (unit.start + rank * c)
                runs.append((start, start + b - a, k))
    return tuple(sorted(runs))

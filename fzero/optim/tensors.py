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
    """

    runs: tuple[tuple[int, int, int], ...]
    rows: int
    count: int
    total: Callable[[Tensor], Tensor]

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
    layout: Layout, *, full: bool, ranks: Sequence[int], total: Callable[[Tensor], Tensor] | None = None
) -> Tensors:
    """The tensors of the buffer an optimizer updates: the full buffer (`full`) or a shard, of each rank in
    `ranks` end to end (a `SimMesh`'s `[world, n]` buffer is all ranks' buffers end to end).

    Args:
      layout: the parameters' layout.
      full: the buffer holds whole tensors (stage 0) rather than shards.
      ranks: the rows' ranks (their coordinates along the sharding axis).
      total: how partial sums of shards become totals (`rank_ordered_total`); ignored with `full`.
    """
    runs = _runs(layout, full, tuple(ranks))
    identity: Callable[[Tensor], Tensor] = lambda partial: partial  # noqa: E731
    return Tensors(runs, len(ranks), len(layout.leaves), identity if full or total is None else total)


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

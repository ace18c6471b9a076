"""A unit's gradient as its parameters' gradients, not yet in one buffer (`Pieces`).

A unit's parameters are views of one flat buffer; autograd hands the unit's backward one gradient per view
(`fzero.sharding.gathered_unit`). `split`'s backward would concatenate them into a new buffer, which the reduction then
reads again to copy (or divide) it into its place in the step's gradient: two passes over the unit's gradient.
`Pieces.into` writes each parameter's gradient straight into the place, the division included: one pass. It is
elementwise, so the result is bitwise the concatenation's (divided).

A reduction that can use the pieces says so with a `takes_pieces = True` attribute on its function
(`fzero.transforms.all_reduce` writes them into the step's gradient, `reduce_scatter` into the buffer gloo sends
from, cast and divided in the same pass); every other one is handed `Pieces.whole()`, the concatenation.

Example:
    >>> import torch
    >>> g = Pieces((2, 1, 3), (torch.tensor([1.0, 2.0]), None, torch.tensor([[4.0, 6.0, 8.0]])))
    >>> g.whole()
    tensor([1., 2., 0., 4., 6., 8.])
    >>> g.into(torch.empty(6), divisor=2)
    tensor([0.5000, 1.0000, 0.0000, 2.0000, 3.0000, 4.0000])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Pieces", "exact_division", "into", "takes_pieces", "whole"]


@dataclass(frozen=True)
class Pieces:
    """A flat gradient of `sum(sizes)` elements as consecutive pieces.

    Attributes:
      sizes: each piece's element count, in the flat buffer's order (padding included).
      grads: each piece's gradient, any shape and strides of `size` elements, or None for zeros (padding, or a
        parameter the loss does not reach); at least one is a tensor, and all of one dtype and device.
    """

    sizes: tuple[int, ...]
    grads: tuple[Tensor | None, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.grads):
            raise ValueError(f"Pieces: {len(self.sizes)} sizes for {len(self.grads)} gradients")
        if not any(g is not None for g in self.grads):
            raise ValueError("Pieces: every piece is None (a gradient with no tensor has no dtype or device)")

    @property
    def like(self) -> Tensor:
        """One of the pieces' tensors (their dtype and device)."""
        return next(g for g in self.grads if g is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.like.dtype

    @property
    def shape(self) -> tuple[int]:
        return (self.numel(),)

    def numel(self) -> int:
        return sum(self.sizes)

    def into(self, out: Tensor, divisor: int | None = None) -> Tensor:
        """Write the pieces into `out` (contiguous, 1-D, `numel()` elements; cast to its dtype), each divided by
        `divisor` if given, zeros for the None ones; returns `out`."""
        if out.shape != (self.numel(),) or not out.is_contiguous():
            raise ValueError(f"Pieces.into: expected a contiguous buffer of shape ({self.numel()},), got "
                             f"{tuple(out.shape)}")  # fmt: skip
        pos = 0
        for size, g in zip(self.sizes, self.grads, strict=True):
            place = out[pos : pos + size]
            pos += size
            if g is None:
                place.zero_()
            elif divisor is None:
                place.view(g.shape).copy_(g)
            else:
                torch.div(g, divisor, out=place.view(g.shape))
        return out

    def whole(self) -> Tensor:
        """The concatenation (a new tensor): what `split`'s backward makes."""
        like = self.like
        return self.into(torch.empty(self.numel(), dtype=like.dtype, device=like.device))


def whole(grads: Tensor | Pieces) -> Tensor:
    """`grads` as one tensor (the concatenation of `Pieces`)."""
    return grads.whole() if isinstance(grads, Pieces) else grads


def into(grads: Tensor | Pieces, out: Tensor, divisor: int | None = None) -> Tensor:
    """`grads` (divided by `divisor` if given) written into `out`: one pass from `Pieces`; returns `out`."""
    if isinstance(grads, Pieces):
        return grads.into(out, divisor)
    return out.copy_(grads) if divisor is None else torch.div(grads, divisor, out=out)


def exact_division(world: int, dtype: torch.dtype) -> bool:
    """Whether dividing each rank's gradient by `world` before the sum gives the mean bitwise: for a power of two
    the division only moves the exponent, so `sum_r (g_r / world)` is `(sum_r g_r) / world` in any order of the
    sum wherever no value falls below the smallest normal number (~1.2e-38 in float32 and bfloat16: there the two
    round differently; float16's is 6.1e-5, within a gradient's range: excluded) and no sum overflows (there the
    division first keeps it finite). DDP multiplies by `1 / world` in its copy to the bucket for every world size;
    here it saves a pass where the gradient is copied anyway."""
    return world > 1 and world & (world - 1) == 0 and dtype != torch.float16


def takes_pieces(fn: object) -> bool:
    """Whether the reduction function `fn` takes `Pieces` (its `takes_pieces` attribute)."""
    return bool(getattr(fn, "takes_pieces", False))

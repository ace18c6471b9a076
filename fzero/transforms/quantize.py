"""Quantized collectives (ZeRO++'s qgZ and qwZ) as opt-in transforms: communicate int8 with blockwise scales.

Blockwise symmetric int8 (`fzero.layout.int8`): a buffer's chunk is cut into blocks of `block` elements (the last one
zero-padded); block `b` is sent as `q = round(x / s_b)` in [-127, 127] with `s_b = max|x_b| / 127` (fp32), and read
back as `q * s_b`. Per element the error is at most `s_b / 2 = max|x_b| / 254`. A block costs `block + 4` bytes
instead of `4 block`: 3.9x fewer at block 256.

- `quantized_reduce_scatter()` (qgZ): every rank quantizes the chunk of its gradient bound for each rank, an
  `all_to_all` delivers them, and each rank dequantizes its `n` chunks and averages them in fp32, in rank order.
  With `levels` (ZeRO++'s hierarchical form, over nodes): fp32 within a node, int8 only across nodes.
- `quantized_gather()` (qwZ): the updated master shards are quantized, all-gathered as int8 with their scales, and
  dequantized into the compute parameters of the next forward (the master parameters stay exact).

Both act on the mesh's `axis` (None: every rank); both are lossy, and their error is the bound above (see each).

Example:
    >>> import torch, fzero
    >>> q, s = quantize(torch.tensor([[1.0, -2.0, 0.5, 0.0]]), block=2)   # blocks [1, -2] and [0.5, 0]
    >>> q, dequantize(q, s, 2)      # 1.0 is off by 2 / 254: half a step of its block's scale, 2 / 127
    (tensor([[  64, -127,  127,    0]], dtype=torch.int8), tensor([[ 1.0079, -2.0000,  0.5000,  0.0000]]))
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import to_rank_major, to_unit_major
from ..layout.int8 import dequantize, quantize
from ..mesh import Mesh
from .base import Context, Does, EmptyState, Flow, Transform
from .collective import _require_full

__all__ = ["dequantize", "quantize", "quantized_gather", "quantized_reduce_scatter"]


def _quantized_mean(mesh: Mesh, x: Tensor, block: int, axis: str | None) -> Tensor:
    """qgZ on a per-rank `[..., n * s]` (n: the axis's size): this rank's chunk of the mean over the axis's ranks,
    `[..., s]` fp32: each rank quantizes the chunk bound for each rank, an all-to-all delivers them, and each rank
    adds its `n` dequantized chunks in rank order and divides by n."""
    n = mesh.size(axis)
    s = x.shape[-1] // n
    q, scales = quantize(x.unflatten(-1, (n, s)), block)  # [..., n, s_pad], [..., n, nb]
    kw = {} if axis is None else {"axis": axis}
    received = dequantize(mesh.all_to_all(q.flatten(-2), **kw), mesh.all_to_all(scales.flatten(-2), **kw), block, s)
    return mesh.map(_rank_mean, received)  # received: [n (from), ..., s] per rank


def _quantized_all_reduce(mesh: Mesh, x: Tensor, block: int, axis: str) -> Tensor:
    """The mean of a per-rank `[..., m]` over `axis` with int8 both ways: qgZ to each rank's chunk of the mean (the
    buffer zero-padded to a multiple of n), then a quantized all-gather of the chunks."""
    n, m = mesh.size(axis), x.shape[-1]
    x = torch.nn.functional.pad(x, (0, -m % n))
    mine = _quantized_mean(mesh, x, block, axis)  # [..., s]
    q, scales = quantize(mine, block)
    gq, gs = mesh.all_gather(q, axis=axis), mesh.all_gather(scales, axis=axis)
    full = dequantize(gq.unflatten(-1, (n, -1)), gs.unflatten(-1, (n, -1)), block, mine.shape[-1]).flatten(-2)
    return full[..., :m]


def _rank_mean(received: Tensor) -> Tensor:
    total = received[0]
    for k in range(1, received.shape[0]):  # rank order, as the fp32 reduction
        total = total + received[k]
    return total / received.shape[0] if received.shape[0] > 1 else total


def _two_level_mean(mesh: Mesh, x: Tensor, block: int, levels: tuple[str, str]) -> Tensor:
    """qgZ over every rank of a 2-D mesh in two exchanges, inner axis first (ZeRO++'s hierarchical all-to-all, 0.19.8
    `runtime/comm/coalesced_collectives.py` `all_to_all_quant_reduce`): this rank's 1-D chunk (rank `i S + j`'s is
    chunk `i S + j`) of the mean over all `W = R S` ranks. The chunks are reordered first so that the inner exchange,
    a full-precision (fp32) reduce-scatter within the node, hands rank `j` of each node the node's mean of the `R`
    chunks `i S + j`, and the outer one, int8 across nodes, hands rank `i` its own of those: only `1/S` of the buffer
    crosses the outer axis, and only there is it quantized."""
    outer, inner = levels
    r, s = mesh.size(outer), mesh.size(inner)
    y = x.unflatten(-1, (r, s, -1)).transpose(-3, -2).flatten(-3).float()  # chunks in (j, i) order
    if s > 1:
        y = mesh.reduce_scatter(y, "mean", axis=inner)
    # (one node: nothing crosses, nothing is quantized: the plain fp32 reduce-scatter)
    return _quantized_mean(mesh, y, block, outer) if r > 1 else y


def quantized_reduce_scatter(
    block: int = 256,
    axis: str | None = None,
    replicate: str | None = None,
    quantize_replicate: bool = True,
    levels: tuple[str, str] | None = None,
) -> Transform:
    """qgZ: average full gradients over ranks, keeping this rank's shard, communicating int8 with blockwise scales;
    shards the parameters at init, as `reduce_scatter` (it replaces it in a chain).

    Error bound, per element of the averaged shard against the exact mean of the ranks' gradients. One quantized
    exchange: each rank's chunk is dequantized with error at most `max|x_{k,b}| / 254` (`x_{k,b}`: rank k's block
    holding the element; module docstring) and the mean of `n` such values errs by at most their mean error,
    `e1 = (1/n) sum_k max|x_{k,b}| / 254`; the fp32 sum adds at most `n u sum_k |x_k| / n` (u = 2^-24), negligible
    beside it. With `replicate` (hybrid) and `quantize_replicate`, the shard is then averaged over `replicate` by
    a second quantized exchange and a quantized all-gather, each adding at most `M' / 254` where `M'` bounds the
    values quantized (`M' <= M (1 + 1/254)`, `M` the largest `|x|` on any rank), so the total error is at most
    `e1 + 2 M (1 + 1/254) / 254 <= 3.01 M / 254`. With `quantize_replicate=False` the replicate all-reduce is
    fp32 and averages the groups' errors: `e1`'s bound with the max over every rank. With `levels`, one quantized
    exchange, across `outer`, of the inner groups' fp32 means `y_i`: `(1/R) sum_i max|y_{i,b}| / 254` (at most
    `M / 254`), plus fp32's rounding of the two means; with one outer group (one node) the result is bitwise the
    plain fp32 `reduce_scatter()`.

    Args:
      block: elements per scale.
      axis, replicate: as for `reduce_scatter` (hybrid sharding).
      quantize_replicate: communicate the replicate all-reduce in int8 too (default), else fp32.
      levels: `(outer, inner)` axes of a 2-D mesh (`outer` the nodes, `inner` a node's ranks), for parameters
        sharded over every rank (`axis=None`): reduce in two exchanges, in fp32 within `inner` first, then int8
        across `outer`, so that only `1/size(inner)` of the gradient crosses `outer`, and only that is quantized
        (ZeRO++'s hierarchical qgZ: `fzero.zero3(..., qgz=("replicate", "shard"))`, or `qgz=True` with hpZ).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"quantized_reduce_scatter(block=...) needs an int >= 1, got {block!r}")
    if levels is not None and (axis is not None or replicate is not None):
        raise ValueError(f"quantized_reduce_scatter(levels={levels!r}) reduces over every rank in two steps: it takes "
                         "no axis or replicate")  # fmt: skip
    base = _reduce_scatter(axis, replicate)

    def init(flow: Flow, ctx: Context) -> tuple[Flow, EmptyState]:
        axes = tuple(getattr(ctx.mesh, "axes", ()))
        if levels is not None and axes != tuple(levels):
            raise ValueError(f"quantized_reduce_scatter(levels={levels!r}) needs a mesh whose axes are exactly "
                             f"{list(levels)} (outer first), got {ctx.mesh!r}")  # fmt: skip
        return base.init(flow, ctx)

    def reduce(x: Tensor, ctx: Context) -> Tensor:
        if ctx.layout.world == 1:
            out = x.float()
        elif levels is not None:
            out = _two_level_mean(ctx.mesh, x, block, levels)
        else:
            out = _quantized_mean(ctx.mesh, x, block, axis)
        if replicate is not None and ctx.mesh.size(replicate) > 1:
            if quantize_replicate:
                out = _quantized_all_reduce(ctx.mesh, out, block, replicate)
            else:
                out = ctx.mesh.all_reduce(out, "mean", axis=replicate)
        return out.to(x.dtype)

    def update(flow: Flow, state: EmptyState, ctx: Context) -> tuple[Flow, EmptyState]:
        _require_full(flow, "quantized_reduce_scatter")
        grads = reduce(to_rank_major(ctx.layout, flow.gradients("quantized_reduce_scatter")), ctx)
        return flow._replace(grads=grads, sharded=True).with_info(reduced=True), state

    def unit(grads: Tensor, index: int, ctx: Context) -> Tensor:
        return reduce(grads, ctx)

    return Transform(init, update, "quantized_reduce_scatter", unit, reduces=True, axis=axis,
                     does=Does(shards=True), per_rank=False)  # fmt: skip


def _reduce_scatter(axis: str | None, replicate: str | None) -> Transform:
    from .collective import reduce_scatter

    return reduce_scatter(None, axis, replicate)


def quantized_gather(block: int | None = None, dtype: torch.dtype | None = None) -> Transform:
    """qwZ: the compute parameters gathered from the updated master shards as int8 with blockwise scales (at the
    end of each step, not lazily), then cast to `dtype` (default the master dtype). The master parameters stay
    exact; each compute element differs from its master value by at most `max|w_b| / 254` (its block's).

    Args:
      block: elements per scale; default the layout's `align` (16): parameters start at multiples of it in every
        shard, so no block straddles two parameters and a LayerNorm gain (~1) never sets the scale of small
        weights (~0.02), which at 256 cost the small GPT 13% of its loss after 300 steps (benchmarks/quantized.py:
        +1.9% at 16). 1.25 bytes per element instead of 4.
      dtype: the compute dtype.
    """
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"quantized_gather(block=...) needs an int >= 1, got {block!r}")

    def apply(flow: Flow, ctx: Context) -> Flow:
        params, layout = flow.params, ctx.layout
        size = block or layout.align
        out_dtype = dtype or params.dtype
        if not flow.sharded or layout.world == 1:  # nothing to gather (stage 0, or world 1)
            return flow._replace(compute=params.to(out_dtype))
        s = params.shape[-1]
        q, scales = quantize(params, size)
        kw = {} if layout.axis is None else {"axis": layout.axis}
        gq, gs = ctx.mesh.all_gather(q, **kw), ctx.mesh.all_gather(scales, **kw)
        n = gq.shape[-1] // q.shape[-1]
        full = dequantize(gq.unflatten(-1, (n, -1)), gs.unflatten(-1, (n, -1)), size, s).flatten(-2)
        return flow._replace(compute=to_unit_major(layout, full).to(out_dtype))

    return Transform(lambda flow, ctx: (apply(flow, ctx), EmptyState()),
                     lambda flow, state, ctx: (apply(flow, ctx), state), "quantized_gather",
                     does=Does(gathers="now"), per_rank=False)  # fmt: skip

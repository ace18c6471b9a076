"""Blockwise symmetric int8, the wire format of ZeRO++'s quantized collectives (`fzero.transforms.quantize`, and
the quantized unit gathers of `fzero.mesh.ranks`).

A tensor's last dimension is cut into blocks of `block` elements (the last one zero-padded); block `b` travels as
`q = round(x / s_b)` in [-127, 127] with `s_b = max|x_b| / 127` (fp32), and is read back as `q * s_b`. Per element
the error is at most `s_b / 2 = max|x_b| / 254` (rounding to the nearest integer; `x / s_b` is in [-127, 127], so
nothing clips). A block costs `block + 4` bytes instead of `4 block`.

Example:
    >>> import torch
    >>> q, s = quantize(torch.tensor([[1.0, -2.0, 0.5, 0.0]]), block=2)   # blocks [1, -2] and [0.5, 0]
    >>> q, dequantize(q, s, 2)      # 1.0 is off by 2 / 254: half a step of its block's scale, 2 / 127
    (tensor([[  64, -127,  127,    0]], dtype=torch.int8), tensor([[ 1.0079, -2.0000,  0.5000,  0.0000]]))
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dequantize", "quantize"]


def quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Blockwise int8 of `x` along its last dimension (zero-padded to a multiple of `block`).

    Returns:
      `(q, scales)`: int8 `[..., nb * block]` and fp32 `[..., nb]`, `nb = ceil(n / block)`.
    """
    n = x.shape[-1]
    pad = -n % block
    xb = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, block))
    scales = xb.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(xb / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.flatten(-2), scales


def dequantize(q: Tensor, scales: Tensor, block: int, n: int | None = None) -> Tensor:
    """fp32 `q * scale` per block, the first `n` elements of the last dimension (default all)."""
    x = (q.float().unflatten(-1, (-1, block)) * scales.unsqueeze(-1)).flatten(-2)
    return x if n is None else x[..., :n]

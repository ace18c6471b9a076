"""`deepspeed.ops.random_ltd.dropping_utils`: DeepSpeed 0.19.8's random-LTD token ops, in torch.

DeepSpeed's kernels (`token_sort_`, `token_gather`, `token_scatter_`) sort each row of kept positions and copy the
kept tokens out of and back into the hidden states; here `Tensor.sort`, `torch.gather` and `Tensor.scatter` do
the same copies, on any device. The indices are int32, as DeepSpeed returns them; the draws are DeepSpeed's (one
`torch.multinomial`), so the same generator state gives the same tokens. The gradients are DeepSpeed's:
`GatherTokens`' input gradient is the passed-through gradient with the kept positions replaced by the layer's,
`ScatterTokens` passes the output gradient through whole and gathers the kept positions' for the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fzero.optim import random_ltd as ltd

__all__ = ["GatherTokens", "ScatterTokens", "bert_sample_tokens", "gpt_sample_tokens"]


def gpt_sample_tokens(
    reserved_length: int,
    seq_length: int,
    batch_size: int,
    layers: int = 1,
    device: Any = "cpu",
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A decoder's kept tokens for `layers` layers and their mask.

    Returns:
      int32 indices `[layers, batch_size, reserved_length]` (sorted) and the mask's leading
      `reserved_length x reserved_length` block (None without a mask).
    """
    indices = ltd.sample_tokens(reserved_length, seq_length, batch_size, layers, device=device)
    return indices.to(torch.int32), ltd.causal_mask(attn_mask, reserved_length)


def bert_sample_tokens(
    reserved_length: int,
    seq_length: int,
    batch_size: int,
    layers: int = 1,
    device: Any = "cpu",
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """An encoder's kept tokens for `layers` layers and, per layer, the mask's kept rows and columns.

    Returns:
      int32 indices `[layers, batch_size, reserved_length]` (sorted) and a list of `layers` masks
      `[batch_size, heads, reserved_length, reserved_length]`.

    Raises:
      ValueError: no `attn_mask` (an encoder's mask is gathered per sequence; DeepSpeed asserts it).
    """
    if attn_mask is None:
        raise ValueError("bert_sample_tokens needs attn_mask (the encoder's [batch, heads, seq, seq] mask)")
    indices = ltd.sample_tokens(reserved_length, seq_length, batch_size, layers, device=device)
    return indices.to(torch.int32), [ltd.gather_mask(attn_mask, indices[i]) for i in range(layers)]


class GatherTokens(torch.autograd.Function):
    """`(activations, kept tokens) = GatherTokens.apply(activations, sorted_indices [batch, kept], batch_first)`."""

    @staticmethod
    def forward(ctx: Any, activations: Tensor, sorted_indices: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first, ctx.shape = batch_first, activations.shape
        return activations, ltd.gather_tokens(activations, sorted_indices, batch_first=batch_first)

    @staticmethod
    def backward(ctx: Any, a_gradients: Tensor | None, g_gradients: Tensor | None) -> tuple[Tensor | None, None, None]:
        (sorted_indices,) = ctx.saved_tensors
        if g_gradients is None:
            return a_gradients, None, None
        if a_gradients is None:  # (the passed-through activations were not used: their gradient is zero)
            a_gradients = g_gradients.new_zeros(ctx.shape)
        return ltd.scatter_tokens(a_gradients, g_gradients, sorted_indices, batch_first=ctx.batch_first), None, None


class ScatterTokens(torch.autograd.Function):
    """`ScatterTokens.apply(all_activations, layer_activations, sorted_indices, batch_first)`: `all_activations`
    with the kept positions replaced by `layer_activations` (a new tensor)."""

    @staticmethod
    def forward(
        ctx: Any, all_activations: Tensor, layer_activations: Tensor, sorted_indices: Tensor, batch_first: bool
    ) -> Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        return ltd.scatter_tokens(all_activations, layer_activations, sorted_indices, batch_first=batch_first)

    @staticmethod
    def backward(ctx: Any, out_gradients: Tensor) -> tuple[Tensor, Tensor, None, None]:
        (sorted_indices,) = ctx.saved_tensors
        out_gradients = out_gradients.contiguous()
        layer = ltd.gather_tokens(out_gradients, sorted_indices, batch_first=ctx.batch_first)
        return out_gradients, layer, None, None

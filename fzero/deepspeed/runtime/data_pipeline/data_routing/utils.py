"""`deepspeed.runtime.data_pipeline.data_routing.utils`: DeepSpeed's reference gather and scatter of a decoder's kept
tokens (`[batch, seq, hidden]`), one sequence at a time (`torch.randperm` per sequence, as DeepSpeed's)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["bsh_decoder_gather", "bsh_decoder_scatter"]


def bsh_decoder_gather(
    reserved_length: int, hidden_states: Tensor, mask: Tensor
) -> tuple[Tensor, list[Tensor], Tensor]:
    """`reserved_length` random tokens of each sequence, in order.

    Args:
      reserved_length: tokens kept per sequence.
      hidden_states: `[batch, seq, hidden]`.
      mask: the decoder's attention mask `[batch, heads, seq, seq]`.

    Returns:
      The kept hidden states `[batch, reserved_length, hidden]`, each sequence's kept positions, and the mask's
      leading `reserved_length` block.
    """
    rand_list = []
    part_hidden_states = []
    for k in range(hidden_states.size(0)):
        kept = torch.randperm(hidden_states.size(1), device=hidden_states.device)[:reserved_length].sort()[0]
        rand_list.append(kept)
        part_hidden_states.append(hidden_states[k : k + 1, kept, :])
    return torch.cat(part_hidden_states, dim=0), rand_list, mask[:, :, :reserved_length, :reserved_length]


def bsh_decoder_scatter(hidden_states: Tensor, part_hidden_states: Tensor, rand_list: list[Tensor]) -> Tensor:
    """Write each sequence's kept tokens back into `hidden_states` (in place, as DeepSpeed's) and return it."""
    for k in range(hidden_states.size(0)):
        hidden_states[k, rand_list[k], :] = part_hidden_states[k, :, :]
    return hidden_states

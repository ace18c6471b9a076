"""Random layerwise token dropping (random-LTD, DeepSpeed's "data routing"): its schedule and token selection as
pure functions a researcher composes.

Random-LTD (Yao et al., https://arxiv.org/abs/2211.11586) runs some of a transformer's middle layers on a random
subset of each sequence's tokens; the other tokens skip those layers unchanged. The number of kept tokens grows with
the training step until the whole sequence is kept. Two pieces, neither of which knows an engine or a config (the
schedule sits beside the LR and curriculum schedules; the selection is what it drives):

- the schedule, a pure function of the step: `fixed_linear(min_value, max_value, require_steps, seq_per_step)`
  returns `FixedLinear`, whose `(step)` is the kept length DeepSpeed 0.19.8's `RandomLTDScheduler` computes
  (its arithmetic, in its order: `floor((step / require_steps) * (max - min) + min)`, rounded down to a multiple of
  `seq_per_step`, at most `max_value`); `layer_tokens` is the layer-tokens one step consumes;
- the token selection: `sample_tokens` draws the kept positions (sorted, the same draws as DeepSpeed's
  `gpt_sample_tokens` from the same generator state: one `torch.multinomial` over uniform weights),
  `gather_tokens` / `scatter_tokens` take the kept tokens out of the hidden states and put a layer's outputs back,
  `drop_tokens(layer, hidden, indices)` is the three composed, and `causal_mask` / `gather_mask` cut an attention
  mask down to the kept tokens (decoder / encoder).

Everything is plain torch indexing (`torch.gather`, `Tensor.scatter`): differentiable by autograd and `torch.func`,
exact (a gather and a scatter copy values), on any device. The gradient of the hidden states is the layer's gradient
at the kept positions and the output's at the others, as DeepSpeed's `GatherTokens` / `ScatterTokens` give. The
engine's random-LTD (`fzero.engine.random_ltd`: DeepSpeed's `convert_to_random_ltd`, `RandomLayerTokenDrop` and
`RandomLTDScheduler`) wraps these functions.

Example:
    >>> import torch
    >>> schedule = fixed_linear(min_value=4, max_value=16, require_steps=10, seq_per_step=2)
    >>> [schedule(step) for step in (0, 1, 5, 9, 10, 50)]
    [4, 4, 10, 14, 16, 16]
    >>> hidden = torch.arange(12.0).reshape(1, 6, 2)          # batch 1, 6 tokens, width 2
    >>> idx = torch.tensor([[1, 4]])                          # keep tokens 1 and 4
    >>> drop_tokens(lambda h: h * 10, hidden, idx)[0, :, 0]
    tensor([ 0., 20.,  4.,  6., 80., 10.])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "FixedLinear",
    "causal_mask",
    "drop_tokens",
    "fixed_linear",
    "gather_mask",
    "gather_tokens",
    "layer_tokens",
    "sample_tokens",
    "scatter_tokens",
]


# -------------------------------------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class FixedLinear:
    """DeepSpeed's `fixed_linear` random-LTD schedule: the kept sequence length at a step (see `fixed_linear`)."""

    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int

    def __call__(self, step: int) -> int:
        """The kept length at `step` (DeepSpeed's `__fixed_root_get_value` with root degree 1, bitwise)."""
        # DeepSpeed's float operations in its order: (step / require) ** (1 / 1), then * (max - min) + min, floored
        fraction = (float(step) / self.require_steps) ** (1.0 / 1)
        kept = math.floor(fraction * (self.max_value - self.min_value) + self.min_value)
        kept -= kept % self.seq_per_step
        return min(kept, self.max_value)


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def fixed_linear(min_value: int, max_value: int, require_steps: int, seq_per_step: int) -> FixedLinear:
    """The kept length rising linearly from `min_value` at step 0 to `max_value` at `require_steps`, in multiples of
    `seq_per_step` (DeepSpeed's `random_ltd_schedule` with `schedule_type` "fixed_linear").

    Args:
      min_value: the kept length at step 0.
      max_value: the full length, reached at `require_steps` and kept after.
      require_steps: the steps the rise takes.
      seq_per_step: the kept length is rounded down to a multiple of it (DeepSpeed's `seq_per_step`).

    Returns:
      The schedule, a function of the step.

    Raises:
      ValueError: a value that is not a positive integer, or `min_value > max_value`.
    """
    for name, value in (("min_value", min_value), ("max_value", max_value), ("require_steps", require_steps),
                        ("seq_per_step", seq_per_step)):  # fmt: skip
        _positive(name, value)
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must not exceed max_value ({max_value})")
    return FixedLinear(min_value, max_value, require_steps, seq_per_step)


def layer_tokens(kept: int, *, max_value: int, total_layers: int, dropping_layers: int, batch: int) -> int:
    """The layer-tokens one step consumes (DeepSpeed's `consumed_layer_tokens` increment): `batch` sequences, each
    through `dropping_layers` layers at `kept` tokens and the other layers at `max_value`."""
    return batch * (kept * dropping_layers + max_value * (total_layers - dropping_layers))


# ------------------------------------------------------------------------------------------------ token selection
def sample_tokens(
    kept: int,
    seq_len: int,
    batch: int,
    layers: int = 1,
    *,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Which tokens each layer keeps: for every layer and sequence, `kept` distinct positions of `seq_len`, uniformly
    at random, in increasing order (so a causal mask over the kept tokens stays causal).

    The draw is DeepSpeed's (`gpt_sample_tokens`): one `torch.multinomial` of `kept` over uniform weights of shape
    `[layers * batch, seq_len]`, sorted; from the same generator state it gives DeepSpeed's indices.

    Args:
      kept: tokens kept per sequence (at most `seq_len`).
      seq_len, batch, layers: the shape of what is drawn.
      device: where the weights and hence the indices live.
      generator: the random generator (default: torch's global one for `device`).

    Returns:
      int64 indices `[layers, batch, kept]`.

    Raises:
      ValueError: `kept` outside `[1, seq_len]`.
    """
    if not 1 <= kept <= seq_len:
        raise ValueError(f"kept must be in [1, seq_len={seq_len}], got {kept}")
    weights = torch.ones((layers * batch, seq_len), device=device)
    drawn = torch.multinomial(weights, kept, generator=generator)
    return drawn.reshape(layers, batch, kept).sort(dim=-1).values


def _index(indices: Tensor, hidden: Tensor, batch_first: bool) -> Tensor:
    """`indices` `[batch, kept]` as an index for `torch.gather` / `scatter` on the sequence dimension of `hidden`."""
    if indices.dim() != 2:
        raise ValueError(f"token indices must be [batch, kept], got shape {tuple(indices.shape)}")
    index = indices.to(device=hidden.device, dtype=torch.int64)
    if not batch_first:
        index = index.t()  # [kept, batch], as the hidden states are [seq, batch, ...]
    return index.reshape(*index.shape, *(1,) * (hidden.dim() - 2)).expand(*index.shape, *hidden.shape[2:])


def gather_tokens(hidden: Tensor, indices: Tensor, *, batch_first: bool = True) -> Tensor:
    """The kept tokens of `hidden`.

    Args:
      hidden: `[batch, seq, ...]` (or `[seq, batch, ...]` with `batch_first=False`).
      indices: `[batch, kept]` positions (one layer's row of `sample_tokens`).
      batch_first: the layout of `hidden`.

    Returns:
      `[batch, kept, ...]` (or `[kept, batch, ...]`).
    """
    return torch.gather(hidden, 1 if batch_first else 0, _index(indices, hidden, batch_first))


def scatter_tokens(hidden: Tensor, part: Tensor, indices: Tensor, *, batch_first: bool = True) -> Tensor:
    """`hidden` with the kept positions replaced by `part` (out of place).

    Args:
      hidden: the full hidden states (as `gather_tokens`).
      part: the layer's outputs for the kept tokens, shaped as `gather_tokens` returns.
      indices: the `[batch, kept]` positions `part` came from.
      batch_first: the layout of both.

    Returns:
      A new tensor shaped as `hidden`.
    """
    return hidden.scatter(1 if batch_first else 0, _index(indices, hidden, batch_first), part.to(hidden.dtype))


def drop_tokens(
    layer: Callable[[Tensor], Tensor], hidden: Tensor, indices: Tensor, *, batch_first: bool = True
) -> Tensor:
    """`layer` run on the kept tokens only; the others pass through unchanged.

    Args:
      layer: maps `[batch, kept, ...]` hidden states to the same shape (e.g. a transformer block with its mask
        bound: `functools.partial(block, attention_mask=causal_mask(mask, kept))`).
      hidden, indices, batch_first: as `gather_tokens`.

    Returns:
      The hidden states after the layer, shaped as `hidden`.
    """
    return scatter_tokens(hidden, layer(gather_tokens(hidden, indices, batch_first=batch_first)), indices,
                          batch_first=batch_first)  # fmt: skip


def causal_mask(mask: Tensor | None, kept: int) -> Tensor | None:
    """A decoder's attention mask `[batch, heads, seq, seq]` for the kept tokens: its leading `kept x kept` block
    (the kept tokens are in increasing order, so causal order is kept; DeepSpeed's `gpt_sample_tokens`)."""
    return None if mask is None else mask[:, :, :kept, :kept]


def gather_mask(mask: Tensor, indices: Tensor) -> Tensor:
    """An encoder's attention mask `[batch, heads, seq, seq]` restricted to each sequence's kept tokens, rows and
    columns (DeepSpeed's `bert_sample_tokens`, per layer).

    Args:
      mask: `[batch, heads, seq, seq]` (heads may be 1).
      indices: `[batch, kept]` (one layer's row of `sample_tokens`).

    Returns:
      `[batch, heads, kept, kept]`.
    """
    if mask.dim() != 4:
        raise ValueError(f"attention mask must be [batch, heads, seq, seq], got shape {tuple(mask.shape)}")
    index = indices.to(device=mask.device, dtype=torch.int64)
    b, h, _, s = mask.shape
    k = index.shape[1]
    rows = torch.gather(mask, 2, index[:, None, :, None].expand(b, h, k, s))
    return torch.gather(rows, 3, index[:, None, None, :].expand(b, h, k, k))

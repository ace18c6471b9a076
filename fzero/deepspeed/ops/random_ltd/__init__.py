"""`deepspeed.ops.random_ltd`: the token sampling, gather and scatter of random-LTD, DeepSpeed's names over torch
indexing (`fzero.optim.random_ltd`) where DeepSpeed loads a CUDA kernel (`RandomLTDBuilder`, which its CPU
accelerator cannot build)."""

from __future__ import annotations

from .dropping_utils import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

__all__ = ["GatherTokens", "ScatterTokens", "bert_sample_tokens", "gpt_sample_tokens"]

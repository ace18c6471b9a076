"""A small GPT-style decoder (pre-LayerNorm, causal attention, GELU MLP, tied embeddings) and a byte-level corpus.

The corpus is `fzero/data/corpus.txt` (see `fzero/data/SOURCE.txt`): 258 KiB of the Python Language Reference,
tokenised as bytes (vocabulary 256).

Example:
    >>> import torch
    >>> model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16))
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..sharding.bind import call

__all__ = ["GPT", "GPTConfig", "corpus_tokens", "gpt_loss", "sample_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks in an `nn.ModuleList` (one fzero unit each), a final
    LayerNorm and an output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)
        for block in self.blocks:  # GPT-2's scaled init of the residual projections
            for lin in (block.proj, block.out):
                assert isinstance(lin, nn.Linear)
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 N + 12 L d T (forward and backward, attention included)."""
        n = sum(p.numel() for p in self.parameters())
        c = self.cfg
        return 6 * n + 12 * c.n_layer * c.d_model * c.seq_len


def gpt_loss(model: GPT):
    """`loss_fn(params, batch)` for fzero: next-byte cross entropy, batch `{"x": [B, T], "y": [B, T]}`."""

    def loss_fn(params: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        logits = call(model, params, batch["x"])  # (functional_call, without its swaps inside a step)
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    return loss_fn


def corpus_tokens() -> Tensor:
    """The bundled corpus as a 1-D int64 tensor of bytes."""
    data = resources.files("fzero").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample_batch(tokens: Tensor, batch: int, seq_len: int, generator: torch.Generator) -> dict[str, Tensor]:
    """`batch` random windows of `seq_len + 1` bytes: inputs `x` and next-byte targets `y`."""
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return {"x": windows[:, :-1], "y": windows[:, 1:]}

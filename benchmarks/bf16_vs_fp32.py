"""bf16 against fp32: the small GPT trained the same way in both precisions; prints the loss curves' ends.

    .venv/bin/python benchmarks/bf16_vs_fp32.py [--steps 300]

ZeRO-2 on a 2-rank SimMesh, AdamW 3e-3, clip 1.0, 2 x 8 sequences of 32 bytes per step from the bundled corpus,
the same batches for both. bf16 keeps fp32 master weights, fp32 reductions and fp32 accumulation (the default
policy), so the difference is bf16's rounding in the forward and backward only.
"""

from __future__ import annotations

import argparse

import torch

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike


def train(precision: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, n_layer=2, d_model=64, n_head=2))
    mesh = fzero.SimMesh(2)
    tx = fzero.zero2(fzero.adamw(3e-3), precision=precision, clip=1.0)
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, gpt_loss(model), tx, mesh)
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = [sample_batch(tokens, 8, 32, gen) for _ in range(2)]
        state, metrics = step(state, {k: torch.stack([b[k] for b in batch]) for k in ("x", "y")})
        losses.append(float(metrics["loss"]))
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    curves = {precision: train(precision, args.steps) for precision in ("fp32", "bf16")}
    for n in sorted({10, args.steps // 4, args.steps // 2, args.steps}):
        window = {k: sum(v[max(0, n - 10) : n]) / len(v[max(0, n - 10) : n]) for k, v in curves.items()}
        print(f"steps {n - 9:4d}-{n:4d}: fp32 {window['fp32']:.4f}  bf16 {window['bf16']:.4f}  "
              f"difference {window['bf16'] - window['fp32']:+.4f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Quantized collectives (ZeRO++'s qgZ and qwZ) against fp32 communication: the small GPT's loss curves and the
bytes each axis moved.

    .venv/bin/python benchmarks/quantized.py [--steps 300]

Hybrid ZeRO-2 (`hybrid=True`) on `SimMesh(shape={"replicate": 2, "shard": 2})`, AdamW 3e-3, clip 1.0, 4 x 8
sequences of 32 bytes per step from the bundled corpus, the same batches and initial weights for every variant:
fp32 communication; `qgz=True` (gradients reduced as int8 with a scale per 256 elements, over both axes); and
`qgz=True, qwz=True` (the compute weights also gathered as int8, a scale per 16 elements). Prints the loss averaged
over windows of 10 steps, the final window's relative difference, and the bytes per optimizer step per axis
(payload: elements times element size, the ledger's `bytes`; an all-reduce also counted twice, the ZeRO paper's
accounting, in `ring-accounted`). `--only NAME` runs some variants (the runs are deterministic: the same numbers).
"""

from __future__ import annotations

import argparse

import torch

import fzero
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike

VARIANTS = {"fp32": {}, "qgZ": {"qgz": True}, "qgZ+qwZ": {"qgz": True, "qwz": True}}


def train(options: dict, steps: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, n_layer=2, d_model=64, n_head=2))
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})
    tx = fzero.zero2(fzero.adamw(3e-3), clip=1.0, hybrid=True, **options)
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, gpt_loss(model), tx, mesh)
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(1)
    losses, comm = [], {}
    for _ in range(steps):
        batch = [sample_batch(tokens, 8, 32, gen) for _ in range(mesh.world)]
        state, metrics = step(state, {k: torch.stack([b[k] for b in batch]) for k in ("x", "y")})
        losses.append(float(metrics["loss"]))
        comm = metrics["comm"]
    return losses, comm


def per_axis(comm: dict) -> dict[str, tuple[int, int]]:
    """`{axis: (payload bytes, ring-accounted bytes)}` of one step's ledger (named axes only)."""
    out: dict[str, list[int]] = {}
    for key, entry in comm.items():
        if ":" not in key:
            continue
        kind, axis = key.split(":")
        tally = out.setdefault(axis, [0, 0])
        tally[0] += entry["bytes"]
        tally[1] += entry["bytes"] * (2 if kind == "all_reduce" else 1)
    return {k: (v[0], v[1]) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", choices=sorted(VARIANTS), action="append", help="run only these variants")
    args = p.parse_args()
    runs = {name: train(options, args.steps) for name, options in VARIANTS.items() if name in (args.only or VARIANTS)}
    for n in sorted({10, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps}):
        window = {k: sum(v[0][max(0, n - 10) : n]) / len(v[0][max(0, n - 10) : n]) for k, v in runs.items()}
        print(f"steps {max(1, n - 9):4d}-{n:4d}: " + "  ".join(f"{k} {w:.4f}" for k, w in window.items()))
    base = sum(runs["fp32"][0][-10:]) / 10 if "fp32" in runs else float("nan")
    for name, (losses, _) in runs.items():
        final = sum(losses[-10:]) / 10
        print(f"{name:8s} final loss {final:.4f} ({(final - base) / base:+.2%} vs fp32)")
    print("bytes per optimizer step (the last one), per axis: payload / ring-accounted")
    for name, (_, comm) in runs.items():
        axes = per_axis(comm)
        print(f"{name:8s} " + "  ".join(f"{axis}: {a:,} / {b:,}" for axis, (a, b) in sorted(axes.items())))


if __name__ == "__main__":
    main()

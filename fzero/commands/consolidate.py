"""`fzero consolidate CKPT OUT [--dtype bf16]`: a checkpoint's parameters, frozen parameters and buffers as one
safetensors file that `model.load_state_dict(safetensors.torch.load_file(OUT))` accepts.

CKPT is a checkpoint directory, or a root of them (its ``latest``, or ``--tag``). The file is written streaming,
one unit in memory at a time, and appears atomically.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT", help="checkpoint directory, or a root holding tagged checkpoints")
    parser.add_argument("out", metavar="OUT", help="output .safetensors file (or a directory: OUT/model.safetensors)")
    parser.add_argument("--tag", default=None, help="checkpoint of the root to use (default: the one 'latest' names)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as saved, fp32 masters)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shard files")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, read_manifest, resolve, write_consolidated

    out = Path(args.out)
    if out.is_dir():
        out = out / "model.safetensors"
    start = time.perf_counter()
    try:
        path = resolve(args.ckpt, args.tag)
        manifest = read_manifest(path)
        written = write_consolidated(path, out, dtype=DTYPES.get(args.dtype), verify=not args.no_verify)
    except (CheckpointError, OSError) as e:
        print(f"fzero consolidate: error: {e}", file=sys.stderr)
        return 1
    lay = manifest.layout
    size = written.stat().st_size
    print(
        f"{written}: {len(lay.leaves)} parameters ({lay.real_numel:,} elements), {len(lay.frozen)} frozen, "
        f"{len(lay.buffers)} buffers from {path} (step {manifest.step}, world {manifest.world}); "
        f"{size / 2**20:.1f} MiB in {time.perf_counter() - start:.2f}s"
    )
    return 0

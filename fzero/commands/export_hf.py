"""`fzero export-hf CKPT OUT --config DIR [--dtype bf16] [--max-shard-size 5GB]`: a checkpoint as the model folder
Hugging Face's `save_pretrained` writes, for `AutoModelForCausalLM.from_pretrained(OUT)`.

CKPT is a checkpoint directory, or a root of them (its ``latest``, or ``--tag``). DIR holds the model's
``config.json`` (and optionally ``generation_config.json`` and tokenizer files, copied too). The folder is written
streaming, one unit in memory at a time, and appears atomically (see `fzero.interop.export_hf`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .consolidate import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..interop.hf import DEFAULT_MAX_SHARD_SIZE

    parser.add_argument("ckpt", metavar="CKPT", help="checkpoint directory, or a root holding tagged checkpoints")
    parser.add_argument("out", metavar="OUT", help="the model folder to write (must not exist, or be empty)")
    parser.add_argument(
        "--config", required=True, metavar="DIR", help="directory holding the model's config.json (and optionally "
        "generation_config.json and tokenizer files, copied too)"
    )  # fmt: skip
    parser.add_argument("--tag", default=None, help="checkpoint of the root to use (default: the one 'latest' names)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as saved, fp32 masters)"
    )
    parser.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE", help="largest safetensors file before "
        f"splitting, e.g. 5GB, 500MB (decimal units; default {DEFAULT_MAX_SHARD_SIZE}, save_pretrained's)"
    )  # fmt: skip
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shard files")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    parser.add_argument(
        "--model-class", default=None, metavar="NAME", help="transformers class to export for (default: the "
        "config's architectures[0], else its AutoModelForCausalLM class)"
    )  # fmt: skip
    parser.add_argument(
        "--no-tokenizer-files", action="store_true", help="do not copy the tokenizer files found beside config.json"
    )
    parser.add_argument(
        "--no-original-format", action="store_true", help="for classes whose save_pretrained converts weights (MoE "
        "experts): write them as the model holds them instead of refusing"
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, read_manifest, resolve
    from ..interop.hf import export_hf

    start = time.perf_counter()
    try:
        path = resolve(args.ckpt, args.tag)
        manifest = read_manifest(path)
        out = export_hf(
            path, args.out, config=args.config, dtype=DTYPES.get(args.dtype), max_shard_size=args.max_shard_size,
            verify=not args.no_verify, overwrite=args.overwrite, model_class=args.model_class,
            tokenizer_files=not args.no_tokenizer_files, original_format=not args.no_original_format,
        )  # fmt: skip
    except (CheckpointError, OSError, ValueError, TypeError, ImportError) as e:
        print(f"fzero export-hf: error: {e}", file=sys.stderr)
        return 1
    weights = sorted(Path(out).glob("*.safetensors"))
    size = sum(p.stat().st_size for p in weights)
    print(
        f"{out}: {len(weights)} safetensors file(s), {size / 2**20:.1f} MiB, from {path} (step {manifest.step}, "
        f"world {manifest.world}) in {time.perf_counter() - start:.2f}s"
    )
    return 0

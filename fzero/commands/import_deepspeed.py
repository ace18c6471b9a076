"""`fzero import-deepspeed CKPT_DIR OUT [--tag TAG]`: a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any world size)
as an fzero checkpoint that `engine.load_checkpoint(OUT)` / `fzero.load` resume at any world size and stage.

Nothing in the DeepSpeed files is executed: they are read with `torch.load(weights_only=True)` and an allowlist of
the few non-tensor types DeepSpeed stores (`fzero.interop.ds_files`); a file needing more is refused, naming it.
"""

from __future__ import annotations

import argparse

from . import run_import


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT_DIR", help="the directory DeepSpeed's engine.save_checkpoint wrote")
    parser.add_argument("out", metavar="OUT", help="the fzero checkpoint directory to write (OUT/<tag>, OUT/latest)")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: the one DeepSpeed's 'latest' names)")
    parser.add_argument(
        "--config", default=None, metavar="JSON", help="the DeepSpeed config to build the state with (default: the "
        "one saved in the checkpoint; needed when the run used a client optimizer)"
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..interop import import_deepspeed

    return run_import(
        "import-deepspeed", args.ckpt, args.config,
        lambda config: import_deepspeed(args.ckpt, args.out, tag=args.tag, config=config),
    )  # fmt: skip

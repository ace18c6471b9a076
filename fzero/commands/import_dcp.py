"""`fzero import-dcp DCP_DIR OUT [--tag TAG] [--config JSON]`: a PyTorch Distributed Checkpoint (an FSDP2 run's,
any world size: model and torch Adam/AdamW state) as an fzero checkpoint that `engine.load_checkpoint(OUT)` /
`fzero.load` resume at any world size and stage.

Without the model's code the model is rebuilt from the checkpoint's names and shapes (parameters with optimizer
state trainable, the other model tensors buffers); from Python, `fzero.interop.import_dcp(..., model)` checks every
key against the module. Nothing in the DCP files runs: see `fzero.interop.dcp_files`.
"""

from __future__ import annotations

import argparse

from . import run_import


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dcp", metavar="DCP_DIR", help="the directory torch.distributed.checkpoint.save wrote")
    parser.add_argument("out", metavar="OUT", help="the fzero checkpoint root to write (OUT/<tag>, OUT/latest)")
    parser.add_argument("--tag", default=None, help="the checkpoint's tag (default: global_step<N>)")
    parser.add_argument(
        "--config", default=None, metavar="JSON", help="a DeepSpeed-style config to build the state with (default: "
        "AdamW or Adam with the checkpoint's param-group values, torch's arithmetic)"
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..interop.dcp import import_dcp

    return run_import(
        "import-dcp", args.dcp, args.config, lambda config: import_dcp(args.dcp, args.out, config=config, tag=args.tag)
    )

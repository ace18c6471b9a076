"""`fzero export-dcp CKPT OUT [--tag TAG] [--lr LR --betas B1 B2 --eps EPS --weight-decay WD --adam]`: an fzero
checkpoint (any world size and stage, Adam/AdamW state) as a PyTorch Distributed Checkpoint that an FSDP2 run loads
at any world size with `get_state_dict`, `dcp.load({"model": msd, "optim": osd}, checkpoint_id=OUT)` and
`set_state_dict`.

The optimizer's hyper-parameters come from the checkpoint when an engine saved it (its config and current lr); a
plain `fzero.save` records none: then give them (at least `--lr`; the others default to torch.optim.AdamW's).
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt", metavar="CKPT", help="an fzero checkpoint directory, or a root of them")
    parser.add_argument("out", metavar="OUT", help="the DCP directory to create (absent or empty)")
    parser.add_argument("--tag", default=None, help="checkpoint of the root to use (default: the one 'latest' names)")
    parser.add_argument("--lr", type=float, default=None, help="the learning rate of the next step")
    parser.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"), help="Adam's betas")
    parser.add_argument("--eps", type=float, default=None, help="Adam's eps")
    parser.add_argument("--weight-decay", type=float, default=None, help="the weight decay")
    parser.add_argument("--adam", action="store_true", help="torch.optim.Adam (L2 weight decay), not AdamW")
    parser.add_argument("--amsgrad", action="store_true", help="the state has AMSGrad's max_exp_avg_sq")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the shard files")


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    given = [f for f in ("betas", "eps", "weight_decay") if getattr(args, f) is not None] + (["adam"] * args.adam)
    if given and args.lr is None:
        parser.error(f"--{given[0].replace('_', '-')} needs --lr (the hyper-parameters are given together)")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError
    from ..interop.dcp import export_dcp

    hypers = None
    if args.lr is not None:
        hypers = {"lr": args.lr, "decoupled_weight_decay": not args.adam, "amsgrad": args.amsgrad}
        hypers.update({f: getattr(args, f) for f in ("betas", "eps", "weight_decay") if getattr(args, f) is not None})
    start = time.perf_counter()
    try:
        path = export_dcp(args.ckpt, args.out, tag=args.tag, hypers=hypers, verify=not args.no_verify)
    except (CheckpointError, OSError) as e:
        print(f"fzero export-dcp: error: {e}", file=sys.stderr)
        return 1
    print(f"{path}: exported from {args.ckpt} in {time.perf_counter() - start:.2f}s")
    return 0

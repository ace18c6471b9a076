#!/usr/bin/env python
"""fzero's `zero_to_fp32.py`, which `engine.save_checkpoint` writes beside the checkpoints as DeepSpeed writes its
own: a checkpoint's consolidated fp32 parameters (and buffers), with `fzero.consolidate`, as one safetensors file.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--exclude_frozen_parameters]

DeepSpeed's command line: CHECKPOINT_DIR is the directory `save_checkpoint` wrote into (its ``latest`` picks the
checkpoint, or ``-t TAG``), or one checkpoint; OUTPUT_DIR/model.safetensors is written (fzero never pickles:
DeepSpeed's default ``pytorch_model.bin`` is its `--safe_serialization` ``model.safetensors`` here). Its other
options are accepted: `--safe_serialization` is always on, `--max_shard_size` writes one file all the same (streamed,
one unit in memory at a time), `--debug` changes nothing. `model.load_state_dict(safetensors.torch.load_file(...))`
takes the result; tied parameters are under each name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch import Tensor

from fzero.checkpoint import consolidate, read_manifest, resolve, write_consolidated
from fzero.checkpoint.safetensors_io import TensorSpec, write_safetensors

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint", "main"]

SAFE_WEIGHTS_NAME = "model.safetensors"


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """DeepSpeed's function of the same name, writing ``output_dir/model.safetensors`` (see the module docstring).

    Args:
      checkpoint_dir: the root `save_checkpoint` wrote, or one checkpoint directory.
      output_dir: where the file goes (created if needed).
      max_shard_size, safe_serialization: DeepSpeed's; accepted (one safetensors file is written).
      tag: the checkpoint of the root (default: the one ``latest`` names).
      exclude_frozen_parameters: leave out the parameters that were frozen (`requires_grad=False`).

    Returns:
      The file written.
    """
    path = resolve(checkpoint_dir, tag)
    out = Path(output_dir) / SAFE_WEIGHTS_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    if not exclude_frozen_parameters:
        return write_consolidated(path, out)
    tensors = get_fp32_state_dict_from_zero_checkpoint(path, exclude_frozen_parameters=True)
    names = list(tensors)
    specs = [TensorSpec(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        write_safetensors(tmp, specs, lambda i: tensors[names[i]], {"format": "pt"})
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Tensor]:  # fmt: skip
    """DeepSpeed's function of the same name: the checkpoint's consolidated parameters (and buffers), by name, in
    memory (`fzero.consolidate`).

    Args:
      checkpoint_dir, tag: as `convert_zero_checkpoint_to_fp32_state_dict`.
      exclude_frozen_parameters: leave out the parameters that were frozen (`requires_grad=False`).
      lazy_mode: DeepSpeed's tensors loaded on access; refused (`fzero.consolidate` streams the files already).
    """
    if lazy_mode:
        raise NotImplementedError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not supported by "
                                  "fzero: the state dict is built in memory (fzero.consolidate streams the files "
                                  "one unit at a time on the way)")  # fmt: skip
    path = resolve(checkpoint_dir, tag)
    state = consolidate(path)
    if exclude_frozen_parameters:
        layout = read_manifest(path).layout
        frozen = {spec.name for spec in layout.frozen}
        frozen |= {alias for alias, name in layout.aliases if name in frozen}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def main(argv: list[str] | None = None) -> int:
    """The command line (DeepSpeed's); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="zero_to_fp32.py")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote into, or one checkpoint in it")
    parser.add_argument("output_dir", help="where model.safetensors is written")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; fzero writes one file")
    parser.add_argument("--safe_serialization", action="store_true", help="accepted; fzero always writes safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint of CHECKPOINT_DIR (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    args = parser.parse_args(argv)
    from fzero.checkpoint import CheckpointError

    try:
        out = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, tag=args.tag, exclude_frozen_parameters=args.exclude_frozen_parameters
        )
    except (CheckpointError, OSError) as e:
        print(f"zero_to_fp32.py: error: {e}", file=sys.stderr)
        return 1
    print(f"Saved the fp32 state dict of {resolve(args.checkpoint_dir, args.tag)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

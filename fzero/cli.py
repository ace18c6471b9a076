"""`fzero COMMAND ...`: one entry point; each command lives in `fzero.commands.<name>` with
`add_arguments(parser)`, optionally `check_arguments(args, parser)` (checks across flags, ending in
`parser.error`), and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "train": "train the small GPT on the bundled corpus (the main job)",
    "consolidate": "write a checkpoint's consolidated parameters to one safetensors file",
    "import-deepspeed": "convert a DeepSpeed ZeRO checkpoint (stage 1-3, any world size) to an fzero checkpoint",
    "export-hf": "write a checkpoint as a Hugging Face model folder (save_pretrained's files) for from_pretrained",
    "import-dcp": "convert a PyTorch DCP checkpoint (FSDP2, any world size: model and Adam/AdamW state) to fzero's",
    "export-dcp": "write an fzero checkpoint (any world size and stage) as a PyTorch DCP checkpoint FSDP2 loads",
    "report": "what this installation can run: versions, the C kernel, CPU, distributed backends (exit 1 if broken)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fzero", description="ZeRO stages 0-3 as a functional library")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules, parsers = {}, {}
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"fzero.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name != f"fzero.commands.{name.replace('-', '_')}":
                raise
            continue  # not built yet
        modules[name] = module
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(parsers[name])
    args = parser.parse_args(argv)
    module = modules[args.command]
    if hasattr(module, "check_arguments"):
        module.check_arguments(args, parsers[args.command])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Memory per rank while a model is constructed under `zero.Init` (`fzero.deepspeed.zero`), against a normal
construction, on `--world` gloo processes; and what `deepspeed.initialize` (stage 3) then holds.

    .venv/bin/python benchmarks/zero_init.py [--layers 16] [--d-model 512] [--world 2]

The model: `--layers` blocks of `fzero.examples.gpt` (12 d^2 parameters each, in an `nn.ModuleList`) between an
embedding and a head. Each variant runs in fresh processes (a freed heap is not given back to the system at once, so
a second variant in the same process would start from the first's high-water mark). A rank's figures are its
resident set's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` before each phase) and resident set,
minus its resident set before the construction. The bound the construction should keep: this rank's partitions
(`ceil(numel / world)` elements of every parameter) plus one submodule's own parameters (the largest, `fc`: 4 d^2),
which exist whole from its `__init__` until they are cut, a few times over on the way.

Measured (2 gloo processes on the 2-core CPU machine; 16 layers, d 512: 50.7M parameters, 193 MiB; a rank's
partitions 97 MiB, `fc` 4 MiB), per rank, over its resident set before construction: under `zero.Init` the
construction peaked at 111 MiB (its partitions plus 14 MiB; the bound, partitions plus `fc`, is 101: the module's own
tensors, one parameter's received copy and its cut account for 2.5 `fc`, the rest is not accounted for; it was 113
while a module's parameters were broadcast as one concatenated copy) and held 103 MiB after it; a normal
construction 196 MiB. `initialize` (stage 3: master,
compute copy and Adam's moments, sharded) then peaked at 395 MiB from the partitions (they are dropped once the state
holds the values) and 496 MiB from the normal model; both runs hold 297-298 MiB after it.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MiB = 2**20


class Model(nn.Module):
    def __init__(self, layers: int, d_model: int) -> None:
        from fzero.examples.gpt import Block, GPTConfig

        super().__init__()
        cfg = GPTConfig(n_layer=layers, d_model=d_model, n_head=8)
        self.wte = nn.Embedding(cfg.vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(layers))
        self.head = nn.Linear(d_model, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"{key}:\s+(\d+) kB", f.read())
    assert found is not None
    return int(found.group(1)) * 1024


def _reset_peak() -> int:
    """Reset the high-water mark; the resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def worker(rank: int, world: int, store: str, args: argparse.Namespace, variant: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import fzero.deepspeed as deepspeed

    torch.manual_seed(0)
    row: dict[str, float] = {}
    before = _reset_peak()
    if variant == "zero.Init":
        with deepspeed.zero.Init():
            model = Model(args.layers, args.d_model)
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
        row["partitions held"] = held / MiB
    else:
        model = Model(args.layers, args.d_model)
    row["construction peak"] = (_status("VmHWM") - before) / MiB
    row["after construction"] = (_status("VmRSS") - before) / MiB
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    _reset_peak()
    engine = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(),
                                  printer=lambda _: None)[0]  # fmt: skip
    row["initialize peak"] = (_status("VmHWM") - before) / MiB
    row["after initialize"] = (_status("VmRSS") - before) / MiB
    del engine
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.update(enumerate(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    # every tensor of 64 KiB or more in pages of its own, handed back when freed: glibc's default raises that
    # threshold as blocks are freed and keeps later ones in its heap, so the resident set would show what the
    # allocator keeps, not what the program holds (the workers are new interpreters: they read it at start)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    d = args.d_model
    numel = sum(p.numel() for p in Model(args.layers, d).parameters())
    print(f"model: {numel / 1e6:.1f}M parameters = {numel * 4 / MiB:.0f} MiB fp32; world {args.world}: "
          f"a rank's partitions {-(-numel // args.world) * 4 / MiB:.0f} MiB; the largest submodule's own "
          f"parameters (fc) {(4 * d * d + 4 * d) * 4 / MiB:.1f} MiB")  # fmt: skip
    for variant in ("zero.Init", "normal"):
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
            out = manager.dict()
            mp.spawn(worker, args=(args.world, f"{tmp}/store", args, variant, out), nprocs=args.world)
            for rank, row in sorted(out.items()):
                shown = ", ".join(f"{k} {v:.0f} MiB" for k, v in row.items())
                print(f"{variant:>9}, rank {rank}: {shown}")


if __name__ == "__main__":
    main()

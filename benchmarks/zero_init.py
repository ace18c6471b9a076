"""Memory per rank while a model is constructed under `zero.Init` (`fzero.deepspeed.zero`), against a normal
construction, on `--world` gloo processes; and what `deepspeed.initialize` (stage 3) then holds.

    .venv/bin/python benchmarks/zero_init.py [--layers 16] [--d-model 512] [--world 2] [--mmap-threshold BYTES]

The model: `--layers` blocks of `fzero.examples.gpt` (12 d^2 parameters each, in an `nn.ModuleList`) between an
embedding and a head. Each variant runs in fresh processes (a freed heap is not given back to the system at once, so
a second variant in the same process would start from the first's high-water mark), which first build and
initialize a 1-layer, d 64 model the same way: the code a construction runs is paged in from torch's library on its
first use and counts in the resident set (5.1-5.3 MiB of `RssFile` for the construction alone), though it is not
memory the construction holds. A rank's figures are its resident set's high-water mark (`VmHWM`, reset through
`/proc/self/clear_refs` before each phase) and resident set, minus its resident set before the construction. glibc
runs with its default settings (fzero must not need any: issue 53), or with `--mmap-threshold` as its
`MALLOC_MMAP_THRESHOLD_`. The bound the construction should keep: this rank's partitions (`ceil(numel / world)`
elements of every parameter) plus one submodule's own parameters (the largest, `fc`: 4 d^2), which exist whole from
its `__init__` until they are cut.

Measured (2-core AMD EPYC Zen 3 VM, AVX2; 2 gloo processes; 16 layers, d 512: 50.7M parameters, 193 MiB; a rank's
partitions 96.7 MiB, `fc` 4.0 MiB: the bound 100.7 MiB), per rank, over its resident set before construction: under
`zero.Init` the construction peaks at 101.9-102.2 MiB (with `--mmap-threshold 65536`: 102.5-102.8) and holds
97.9-98.0 after it; a normal construction 193.4. The 1-1.5 MiB over the bound is held, not transient (the peak is
what remains after the construction plus less than one `fc`): the model's own objects (0.3 MiB, the model built on
`meta`), torch.distributed's record of each collective (0.6-0.9 KiB each, for ~800 broadcasts), the partitions'
and stand-ins' objects. Before (each parameter's values broadcast whole, glibc's heap left as it was): 109.4 and
120.7 MiB on the two ranks, held after it too (fragmentation: `fzero.host.heap`); with `MALLOC_MMAP_THRESHOLD_=65536`
104.9 (the bound plus the whole received copy of `fc`), and 5.1-5.3 MiB more in each without the warm-up (the 111 MiB
of earlier runs). `initialize` (stage 3: master, compute copy and Adam's moments, sharded) then peaks at 388 MiB from
the partitions (400-407 before) and 483 from the normal model; after it, 291.8-291.9 MiB either way.

`from_pretrained` (a Hugging Face GPT-2 of the same 16 layers and width, vocabulary 8192: 54.6M parameters; a rank's
partitions 104.3 MiB; its largest submodule, the embedding `wte`, 16 MiB), built under fzero's `HfDeepSpeedConfig`:
anonymous memory peaks at 128.1 MiB on rank 1 and 131.4 on rank 0 (which reads the checkpoint's values: 3 MiB more),
when the embedding is gathered to take its values: the partitions held then (104.3, and 8 MiB of the head's own
weight, which transformers ties to the embedding only after loading) plus the embedding, 128.3; 168-171 before
`GatheredParameters` wrote a modifier's values a chunk at a time. Rank 0's resident high-water mark (335 MiB) counts
the checkpoint file's pages, mapped by safetensors: not anonymous memory.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from procmem import PeakRss, proc_status  # (this directory: benchmarks/procmem.py)
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


def _reset_peak() -> int:
    """Reset the high-water mark; the resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def worker(rank: int, world: int, store: str, args: argparse.Namespace, variant: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import fzero.deepspeed as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "steps_per_print": 10**9,
    }

    def build(layers: int, d_model: int) -> nn.Module:
        if variant == "from_pretrained":  # transformers builds it under zero.Init and loads into the partitions
            from transformers import GPT2LMHeadModel

            dschf = deepspeed.zero.HfDeepSpeedConfig(config)  # (alive while the model loads)
            model = GPT2LMHeadModel.from_pretrained(os.path.join(args.saved, f"gpt2-{layers}-{d_model}"))
            del dschf
            return model
        if variant != "zero.Init":
            return Model(layers, d_model)
        with deepspeed.zero.Init():
            return Model(layers, d_model)

    def initialize(model: nn.Module) -> object:
        return deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(),
                                    printer=lambda _: None)[0]  # fmt: skip

    # first a small model the same way: torch's code runs from pages of its library mapped in on first use (5 MiB
    # of the resident set for the construction alone), which are not memory the construction holds
    initialize(build(1, 64))
    torch.manual_seed(0)
    row: dict[str, float] = {}
    before, anon = _reset_peak(), PeakRss()
    anon_before = anon.peak
    model = build(args.layers, args.d_model)
    if variant != "normal":
        held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
        row["partitions held"] = held / MiB
    row["construction peak"] = (proc_status("VmHWM") - before) / MiB
    row["anonymous peak"] = (anon.stop() - anon_before) / MiB  # (from_pretrained maps the file too: not anonymous)
    row["after construction"] = (proc_status("VmRSS") - before) / MiB
    _reset_peak()
    engine = initialize(model)
    row["initialize peak"] = (proc_status("VmHWM") - before) / MiB
    row["after initialize"] = (proc_status("VmRSS") - before) / MiB
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
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for the workers (default: glibc's own)")  # fmt: skip
    args = parser.parse_args()
    if args.mmap_threshold is not None:  # (the workers are new interpreters: glibc reads it at their start)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    d = args.d_model
    numel = sum(p.numel() for p in Model(args.layers, d).parameters())
    print(f"model: {numel / 1e6:.1f}M parameters = {numel * 4 / MiB:.0f} MiB fp32; world {args.world}: "
          f"a rank's partitions {-(-numel // args.world) * 4 / MiB:.0f} MiB; the largest submodule's own "
          f"parameters (fc) {(4 * d * d + 4 * d) * 4 / MiB:.1f} MiB")  # fmt: skip
    print(f"from_pretrained: a Hugging Face GPT-2 of {args.layers} layers, width {d}, vocabulary 8192, saved with "
          f"save_pretrained; its largest submodule (wte) {8192 * d * 4 / MiB:.1f} MiB")  # fmt: skip
    with tempfile.TemporaryDirectory() as saved:
        args.saved = saved
        _save_gpt2(saved, [(1, 64), (args.layers, d)])
        for variant in ("zero.Init", "from_pretrained", "normal"):
            run(variant, args)


def _save_gpt2(directory: str, sizes: list[tuple[int, int]]) -> None:
    """Hugging Face GPT-2s of `(layers, width)` (vocabulary 8192, 64 positions) saved with `save_pretrained`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    for layers, width in sizes:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=8, vocab_size=8192, n_positions=64)
        GPT2LMHeadModel(config).save_pretrained(os.path.join(directory, f"gpt2-{layers}-{width}"))


def run(variant: str, args: argparse.Namespace) -> None:
    """`variant` in fresh processes; prints each rank's row."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.spawn(worker, args=(args.world, f"{tmp}/store", args, variant, out), nprocs=args.world)
        for rank, row in sorted(out.items()):
            shown = ", ".join(f"{k} {v:.1f} MiB" for k, v in row.items())
            print(f"{variant:>15}, rank {rank}: {shown}")


if __name__ == "__main__":
    main()

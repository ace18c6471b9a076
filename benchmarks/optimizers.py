"""Every optimizer's update against the memory bound, Muon's update time and its communication, in one run.

    .venv/bin/python benchmarks/optimizers.py [--elements 4194304] [--rounds 7] [--threads 1 [2 ...]]
                                              [--isa scalar|avx2|avx512] [--muon-layers 4]
                                              [--parts update muon comm]

`--threads`: `torch.set_num_threads` for each timed part in turn (the native kernels and torch's ops follow it);
one by default (on a shared machine two threads wait on the scheduler). `--isa`: the native kernels' path
(`fzero.native.set_isa`; torch's own ops are unaffected).

- `update`: one in-place update (`donate=True`) of a flat float32 buffer of `--elements` elements by each of
  `fzero.adamw`, `fzero.cpu_adamw`, `fzero.lion`, `fzero.cpu_lion`, `fzero.adagrad`, `fzero.cpu_adagrad`,
  `fzero.sgd(momentum=0.9)`, `fzero.lamb` (64 tensors, whole: `tensors_of(layout, full=True)`) and
  `torch.optim.AdamW(foreach=True)` / `(fused=True)`, with `fzero.native.ceiling` (Adam's memory traffic, fused
  multiply-adds only) in the same rounds. The ceiling's time gives this round's bandwidth (28 bytes per element:
  read p, g, m, v; write p, m, v); an optimizer's bound is the bytes it must move per element (below) at that
  bandwidth. All of them update the same four buffers (`p`, `g`, and `m`, `v` as their states: Lion's and SGD's
  momentum is `m`, Adagrad's sum is `v`), so placement in physical memory does not differ between them.
- `muon`: `fzero.muon` (world 1) on a GPT-like set of tensors (`--muon-layers` blocks of width 256: qkv 768x256,
  proj 256x256, fc 1024x256, out 256x1024 and their vectors), its Newton-Schulz iterations alone on the same
  matrices (the rest is the difference), and `fzero.adamw` / `fzero.cpu_adamw` on the same buffer.
- `comm`: the ledger (`metrics["comm"]` of `fzero.train_step`) of one step of `zero2` on `fzero.SimMesh(W)`,
  W = 2 and 4, of `fzero.examples.gpt`'s GPT (its default config) with `fzero.muon` against `fzero.adamw`: the
  all-to-all elements (the matrices' pieces to their owners and back) relative to the reduce-scatter's. Muon's
  default rule (`deepspeed_use_muon`) puts the GPT's `wte` and `wpe` on Muon (their names hold no "embed"); the
  "blocks only" row keeps them on Adam.

Bytes per element each update must move at least (float32): Adam/AdamW 28 (read p, g, m, v; write p, m, v);
Lion 20 (read p, g, m; write p, m); Adagrad 20 (read p, g, s; write p, s); SGD with momentum 20 (read p, g, b;
write p, b); Lamb 40 (two passes: the trust ratio needs every tensor's norm of the update before any parameter is
written; first read p, g, m, v and write m, v, then read p, m, v and write p).

Rounds visit the variants in a shuffled order (so machine noise hits all alike), one call each, after a warm-up
call; times are medians over rounds, and each ratio to the bound is the median of the per-round ratios (the bound
from the same round's ceiling). The ratios to the bound say how far each update is from what memory allows; the
ceiling has four read and three write streams, the others fewer, so an update can land a little under 1.00. The
ceiling measures memory only where it runs at memory speed: on a vector path (`--isa scalar` is compute-bound) and
on buffers beyond the last-level cache. No timing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from adam import measure  # (run as a script: benchmarks/ is on the path) the same interleaved timing

import fzero
from fzero import native
from fzero.examples.gpt import GPT, GPTConfig, corpus_tokens, gpt_loss, sample_batch
from fzero.layout import Layout, make_layout
from fzero.optim.base import AdagradState, AdamState, LionState
from fzero.optim.muon import deepspeed_use_muon, newton_schulz
from fzero.optim.sgd import SGDState
from fzero.optim.tensors import owners, tensors_of

LR, WD = 1e-3, 0.01
CEILING_BYTES = 28  # fz_ceiling: read p, g, m, v; write p, m, v
BYTES = {  # the least traffic per element of each update, float32
    "fzero.adamw": 28,
    "fzero.cpu_adamw": 28,
    "fzero.lion": 20,
    "fzero.cpu_lion": 20,
    "fzero.adagrad": 20,
    "fzero.cpu_adagrad": 20,
    "fzero.sgd(momentum=0.9)": 20,
    "fzero.lamb (64 tensors)": 40,
    "torch AdamW foreach": 28,
    "torch AdamW fused": 28,
    "ceiling": CEILING_BYTES,
}


def buffers(n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return p, g, g * 0.1, g.square() * 0.01


def fzero_variant(opt: fzero.optim.Optimizer, state, p: torch.Tensor, g: torch.Tensor, **kw) -> Callable[[], None]:
    """`opt.update(g, state, p, donate=True)`, the returned state carried to the next call; the first call checks
    the update ran in place (the same parameter and state buffers came back)."""
    box = [state, True]
    buffers_in = [p.data_ptr()] + [t.data_ptr() for t in state[1:]]

    def run() -> None:
        new_p, box[0] = opt.update(g, box[0], p, donate=True, **kw)
        if box[1]:
            out = [new_p.data_ptr()] + [t.data_ptr() for t in box[0][1:]]
            assert out == buffers_in, "donate=True did not update in place"
            box[1] = False

    return run


def torch_variant(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, **kind) -> Callable[[], None]:
    """`torch.optim.AdamW(...).step()` on `p` with gradient `g`, its state pointed at `m`, `v` after a first step."""
    param = torch.nn.Parameter(p, requires_grad=True)  # shares p's storage
    param.grad = g
    opt = torch.optim.AdamW([param], lr=LR, weight_decay=WD, **kind)
    opt.step()
    state = opt.state[param]
    state["exp_avg"], state["exp_avg_sq"] = m, v
    return opt.step


def lamb_tensors(n: int, count: int = 64):
    """`Tensors` of a layout of `count` 1-D tensors filling `n` elements (the last one takes the remainder)."""
    size = n // count
    shapes = [(size,)] * (count - 1) + [(n - size * (count - 1),)]
    layout = make_layout([(f"t{i}", s, torch.float32) for i, s in enumerate(shapes)], world=1, align=1)
    assert layout.numel == n, (layout.numel, n)
    return tensors_of(layout, full=True, ranks=(0,))


def update_variants(p, g, m, v) -> dict[str, Callable[[], None]]:
    def count():
        return torch.tensor(0, dtype=torch.int64)

    adam_state, lion_state, adagrad_state = AdamState(count(), m, v), LionState(count(), m), AdagradState(count(), v)
    variants = {
        "fzero.adamw": fzero_variant(fzero.adamw(LR, weight_decay=WD), adam_state, p, g),
        "fzero.cpu_adamw": fzero_variant(fzero.cpu_adamw(LR, weight_decay=WD), adam_state, p, g),
        "fzero.lion": fzero_variant(fzero.lion(LR, weight_decay=WD), lion_state, p, g),
        "fzero.cpu_lion": fzero_variant(fzero.optim.cpu_lion(LR, weight_decay=WD), lion_state, p, g),
        "fzero.adagrad": fzero_variant(fzero.adagrad(LR), adagrad_state, p, g),
        "fzero.cpu_adagrad": fzero_variant(fzero.optim.cpu_adagrad(LR), adagrad_state, p, g),
        "fzero.sgd(momentum=0.9)": fzero_variant(fzero.sgd(LR, momentum=0.9), SGDState(count(), m), p, g),
        "fzero.lamb (64 tensors)": fzero_variant(
            fzero.lamb(LR, weight_decay=WD), adam_state, p, g, tensors=lamb_tensors(p.numel())
        ),
        "torch AdamW foreach": torch_variant(p, g, m, v, foreach=True),
        "ceiling": lambda: native.ceiling(p, g, m, v, 0.0),
    }
    try:
        variants["torch AdamW fused"] = torch_variant(p, g, m, v, fused=True)
    except (RuntimeError, ValueError) as e:  # no fused AdamW on this build's CPU
        print(f"  (torch AdamW fused unavailable: {e})")
    return variants


def report_updates(n: int, times: dict[str, list[float]]) -> None:
    ceiling = times["ceiling"]
    bandwidth = CEILING_BYTES * n / statistics.median(ceiling) / 1e9
    print(f"  bandwidth (ceiling kernel, {CEILING_BYTES} B/element): {bandwidth:.2f} GB/s")
    print(f"  {'optimizer':26s} {'B/elem':>6s} {'ms/update':>10s} {'GB/s':>7s} {'bound ms':>9s} {'x bound':>8s}")
    for name, t in times.items():
        nbytes = BYTES[name]
        med = statistics.median(t)
        bound = statistics.median(c * nbytes / CEILING_BYTES for c in ceiling)
        ratio = statistics.median(ti / (c * nbytes / CEILING_BYTES) for ti, c in zip(t, ceiling, strict=True))
        print(f"  {name:26s} {nbytes:6d} {med * 1e3:10.2f} {nbytes * n / med / 1e9:7.2f} {bound * 1e3:9.2f} "
              f"{ratio:8.2f}")  # fmt: skip


def gpt_like(layers: int, d: int = 256) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT block's tensors (`fzero.examples.gpt`'s names and shapes, width `d`), `layers` times."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        b = f"blocks.{i}."
        out += [(b + "ln1.weight", (d,)), (b + "ln1.bias", (d,)), (b + "qkv.weight", (3 * d, d)),
                (b + "qkv.bias", (3 * d,)), (b + "proj.weight", (d, d)), (b + "proj.bias", (d,)),
                (b + "ln2.weight", (d,)), (b + "ln2.bias", (d,)), (b + "fc.weight", (4 * d, d)),
                (b + "fc.bias", (4 * d,)), (b + "out.weight", (d, 4 * d)), (b + "out.bias", (d,))]  # fmt: skip
    return out


def muon_variants(layers: int) -> tuple[dict[str, Callable[[], None]], int, int]:
    """Muon's update, its Newton-Schulz iterations alone, and AdamW on the same buffer; also the buffer's size and
    the number of matrices."""
    spec = gpt_like(layers)
    layout = make_layout([(name, shape, torch.float32) for name, shape in spec], world=1)
    tensors = tensors_of(layout, full=True, ranks=(0,))
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(layout.numel, generator=gen) * 0.02, torch.randn(layout.numel, generator=gen)
    mats = [
        (leaf.offset, leaf.numel, leaf.shape) for leaf in layout.leaves if deepspeed_use_muon(leaf.name, leaf.shape)
    ]
    opt = fzero.muon()

    def ns_alone() -> None:
        for a, k, shape in mats:
            newton_schulz(g[a : a + k].view(shape))  # fzero.muon's defaults: 5 steps, "gram", float32

    variants = {
        "fzero.muon update": fzero_variant(opt, opt.init(p), p, g, tensors=tensors),
        "Newton-Schulz alone": ns_alone,
        "fzero.adamw": fzero_variant(fzero.adamw(LR), fzero.adamw(LR).init(p), p, g),
        "fzero.cpu_adamw": fzero_variant(fzero.cpu_adamw(LR), fzero.cpu_adamw(LR).init(p), p, g),
    }
    return variants, layout.numel, len(mats)


def report_muon(times: dict[str, list[float]], n: int, matrices: int) -> None:
    print(f"  GPT-like tensors: {n} elements, {matrices} matrices on Muon")
    for name, t in times.items():
        print(f"  {name:32s} {statistics.median(t) * 1e3:9.2f} ms")
    rest = [a - b for a, b in zip(times["fzero.muon update"], times["Newton-Schulz alone"], strict=True)]
    print(f"  {'muon rest (update - NS, paired)':32s} {statistics.median(rest) * 1e3:9.2f} ms")
    for base in ("fzero.adamw", "fzero.cpu_adamw"):
        r = statistics.median(a / b for a, b in zip(times["fzero.muon update"], times[base], strict=True))
        print(f"  ratio muon / {base}: {r:.1f}")


def comm_row(world: int, opt: fzero.optim.Optimizer) -> tuple[dict[str, dict[str, int]], Layout]:
    """One zero2 step's ledger on `SimMesh(world)` with the default GPT, and the parameters' layout."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    mesh = fzero.SimMesh(world)
    tx = fzero.zero2(opt)
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, gpt_loss(model), tx, mesh)
    tokens, gen = corpus_tokens(), torch.Generator().manual_seed(1)
    batch = [sample_batch(tokens, 2, model.cfg.seq_len, gen) for _ in range(world)]
    _, metrics = step(state, {k: torch.stack([b[k] for b in batch]) for k in ("x", "y")})
    return metrics["comm"], state.layout


def muon_needs(layout: Layout, use_muon: Callable[[str, tuple[int, ...]], bool]) -> tuple[int, float]:
    """The Muon tensors' elements, and what the exchange must move per rank and step at least (the mean over
    ranks of the elements of its pieces of Muon tensors another rank owns, there and back)."""
    leaves = layout.leaves
    chosen = {k for k, leaf in enumerate(leaves) if use_muon(leaf.name, leaf.shape)}
    owner = owners([leaf.numel for leaf in leaves], layout.world)
    away = 0
    for rank in range(layout.world):
        runs = tensors_of(layout, full=False, ranks=(rank,)).runs
        away += sum(b - a for a, b, k in runs if k in chosen and owner[k] != rank)
    return sum(leaves[k].numel for k in chosen), 2 * away / layout.world


def report_comm() -> None:
    def blocks_only(name: str, shape: tuple[int, ...]) -> bool:
        return deepspeed_use_muon(name, shape) and name.startswith("blocks.")

    rules = {"adamw": None, "muon (default rule)": deepspeed_use_muon, "muon (blocks only)": blocks_only}
    print(f"  {'W':>2s} {'optimizer':20s} {'Muon/Psi':>8s} {'reduce_scatter':>14s} {'all_gather':>10s} "
          f"{'all_to_all':>10s} {'calls':>5s} {'a2a/RS':>6s} {'a2a/RS sent':>11s} {'least/RS sent':>13s}")  # fmt: skip
    for world in (2, 4):
        for name, rule in rules.items():
            opt = fzero.adamw(1e-3) if rule is None else fzero.muon(use_muon=rule)
            comm, layout = comm_row(world, opt)
            rs, ag = comm["reduce_scatter"], comm.get("all_gather", {"elements": 0})
            a2a = comm.get("all_to_all", {"calls": 0, "elements": 0, "sent": 0})
            mu, least = muon_needs(layout, rule) if rule is not None else (0, 0.0)
            print(f"  {world:2d} {name:20s} {mu / layout.real_numel:8.3f} {rs['elements']:14,d} "
                  f"{ag['elements']:10,d} {a2a['elements']:10,d} {a2a['calls']:5d} "
                  f"{a2a['elements'] / rs['elements']:6.3f} {a2a['sent'] / rs['sent']:11.3f} "
                  f"{least / rs['sent']:13.3f}")  # fmt: skip
            other = sorted(set(comm) - {"reduce_scatter", "all_gather", "all_to_all"})
            if other:
                print("     also: " + ", ".join(f"{k} {comm[k]['elements']:,d}" for k in other))
    print(
        f"  (elements per rank and step, Psi = {layout.real_numel:,d} parameters; 'sent' counts the elements "
        "leaving a rank, x (W-1)/W; 'least': the Muon pieces a rank must send their owners and get back)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=2**22)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="torch.set_num_threads, each in turn")
    ap.add_argument("--isa", choices=["scalar", "avx2", "avx512"], help="the native kernels' path (default: best)")
    ap.add_argument("--muon-layers", type=int, default=4)
    ap.add_argument("--parts", nargs="+", default=["update", "muon", "comm"], choices=["update", "muon", "comm"])
    args = ap.parse_args()
    if args.isa:
        native.set_isa(args.isa)
    print(f"fzero.native: path {native.isa()}, OpenMP {native.openmp()}; torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    for threads in args.threads:
        torch.set_num_threads(threads)
        if "update" in args.parts:
            n = args.elements
            print(f"\none update of {n} float32 elements, {threads} thread(s), median of {args.rounds} rounds")
            report_updates(n, measure(update_variants(*buffers(n)), args.rounds))
        if "muon" in args.parts:
            print(f"\nMuon, world 1, {threads} thread(s), median of {args.rounds} rounds")
            variants, n, matrices = muon_variants(args.muon_layers)
            report_muon(measure(variants, args.rounds), n, matrices)
    if "comm" in args.parts:
        torch.set_num_threads(args.threads[0])
        print("\ncommunication per step, zero2 on SimMesh(W), GPT(GPTConfig()), one step's ledger")
        report_comm()


if __name__ == "__main__":
    main()

"""CPU Adam, side by side in one run: fzero's native kernel, torch's AdamW (fused, foreach), DeepSpeed's
`DeepSpeedCPUAdam` (when installed) and a bandwidth ceiling; then the whole offload update; then the gradient
statistics; then parameter groups (the kernel with two groups against one).

    .venv/bin/python benchmarks/adam.py [--log2-sizes 24 26] [--threads 1 2] [--rounds 7]
                                        [--parts plain offload stats groups bf16]

For each size (float32 elements) and thread count (`torch.set_num_threads`, which the kernel follows):

- plain AdamW update, in place: `fzero.native.adam_step`; `torch.optim.AdamW(fused=True)` and `(foreach=True)`
  `.step()`; `DeepSpeedCPUAdam.step()`; the update as `torch.compile` fuses it (`compiled_variant`: what fusing
  the update into a compiled step would give); and `fzero.native.ceiling`, a kernel with Adam's exact memory traffic
  (read p, g, m, v; write p, m, v) and fused multiply-adds only: what memory bandwidth allows any Adam kernel;
- the full offload update (the gradient factor 1/loss-scale x clip coefficient, AdamW, a bfloat16 copy of the new
  parameters): the kernel in one pass, against torch's fastest composition of the same work, the best of
  `grad.mul_(f)` + fused AdamW + `out.copy_(p)`, `torch._fused_adamw_(..., grad_scale=1/f)` + `out.copy_(p)`, and
  the foreach equivalent, and the compiled fusion of all three;
- the gradient statistics (sum of squares in float64, non-finite flag): `fzero.native.grad_stats` against
  `torch.linalg.vector_norm(g, dtype=float64) ** 2` (what `grad_stats` in fzero/transforms/base.py did before);
- parameter groups: `adam_step(..., segments=...)` with two groups (different lr and weight decay) against the
  ungrouped call, on the plain update and on the offload update, for a realistic segmentation (the groups
  alternate every 2048-8192 elements: a decay / no-decay split of a model's parameters) and a worst case (a
  segment every 16-64 elements). The whole Python call is timed. The ungrouped call also runs twice under two
  names: the ratio of the two is this run's noise floor;
- `bf16` (not run by default): the offload update (factor, AdamW, bfloat16 copy) on the `avx512bf16` path (the
  copy by VCVTNEPS2BF16) against the `avx512` path (the copy by integer rounding), and the `avx512` path again
  under another name (the noise floor); the paths this CPU lacks are left out.

All variants of a size update the same four buffers (placement in physical memory moves a memory-bound kernel by
several percent). Rounds alternate between the variants in a shuffled order (so machine noise hits all alike);
each round times one call of each after a warm-up; the script prints the median elements/s, and each ratio as
the median of the per-round (paired) ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from fzero import native

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
FACTOR = 0.37  # a gradient factor that is not a power of two (1 / loss scale x clip coefficient)


def buffers(n: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return p, g, g.square() * 0.1, g.square() * 0.01


def share_state(opt: torch.optim.Optimizer, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """After a first step created it, point the optimizer's state at the shared moments."""
    state = opt.state[p]
    state["exp_avg"], state["exp_avg_sq"] = m, v


def torch_optimizer(p, g, m, v, **kind) -> torch.optim.Optimizer:
    p.requires_grad_()
    p.grad = g
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind)
    opt.step()  # create the state
    share_state(opt, p, m, v)
    return opt


def deepspeed_variant(p, g, m, v) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        opt.step()
    except Exception:  # not installed, or its JIT build failed: reported as absent
        return None
    share_state(opt, p, m, v)
    return opt.step


def compiled_variant(p, g, m, v, out: torch.Tensor | None = None) -> Callable[[], None]:
    """AdamW (with the gradient factor and the bfloat16 copy where `out` is given) as `torch.compile` fuses it: one
    inductor loop over the buffers. The bias corrections enter as 0-d tensors set before each call (computed in
    the graph they cost two `pow`s per vector of elements, 3x slower here; as Python floats, a recompilation per
    step): what fusing the update into a compiled step could be at best."""
    beta1, beta2 = BETAS
    scalars = torch.zeros(2)  # LR / (1 - beta1^t), sqrt(1 - beta2^t)

    def update(p, g, m, v, scalars, out):
        if out is not None:
            g = g * FACTOR
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.mul_(1 - LR * WD).sub_(m / (v.sqrt() / scalars[1] + EPS) * scalars[0])
        if out is not None:
            out.copy_(p)

    torch.compiler.reset()  # (a graph per size and thread count: dynamo's recompile limit would be reached)
    fused = torch.compile(update, fullgraph=True, dynamic=False)
    step = [1]

    def run():
        step[0] += 1
        scalars[0], scalars[1] = LR / (1 - beta1 ** step[0]), (1 - beta2 ** step[0]) ** 0.5
        fused(p.detach(), g, m, v, scalars, out)

    return run


# Every variant updates the same buffers in place: where four 2^26-element buffers land in physical memory
# changes a memory-bound kernel's speed by several percent, so separate buffers would measure placement.
# The ceiling runs with a = 0 (no value changes) on them too.


def plain_variants(p, g, m, v) -> dict[str, Callable[[], None]]:
    step = [1]

    def kernel():
        step[0] += 1
        native.adam_step(p.detach(), g, m, v, step=step[0], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    variants = {
        "native": kernel,
        "torch fused": torch_optimizer(p, g, m, v, fused=True).step,
        "torch foreach": torch_optimizer(p, g, m, v, foreach=True).step,
        "torch compiled": compiled_variant(p, g, m, v),
        "ceiling": lambda: native.ceiling(p.detach(), g, m, v, 0.0),
    }
    ds = deepspeed_variant(p, g, m, v)
    if ds is not None:
        variants["deepspeed"] = ds
    return variants


def offload_variants(p, g, m, v) -> dict[str, Callable[[], None]]:
    n = p.numel()
    out = torch.empty(n, dtype=torch.bfloat16)
    step = [1]

    def kernel():
        step[0] += 1
        native.adam_step(p.detach(), g, m, v, step=step[0], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         grad_scale=FACTOR, out=out)  # fmt: skip

    scaled = torch.empty_like(g)  # the torch compositions write the scaled gradients somewhere: their grad
    fused = torch_optimizer(p, scaled, m, v, fused=True)
    foreach = torch_optimizer(p, scaled, m, v, foreach=True)

    def mul_then(opt):
        def run():
            torch.mul(g, FACTOR, out=scaled)
            opt.step()
            out.copy_(p.detach())

        return run

    gs_step, gs_scale = torch.tensor(1.0), torch.tensor(1 / FACTOR)

    def fused_grad_scale_cast():
        gs_step.add_(1)
        torch._fused_adamw_([p.detach()], [g], [m], [v], [], [gs_step], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                            weight_decay=WD, eps=EPS, amsgrad=False, maximize=False, grad_scale=gs_scale)  # fmt: skip
        out.copy_(p.detach())

    return {
        "native fused": kernel,
        "torch mul+fused+cast": mul_then(fused),
        "torch _fused_adamw_(grad_scale)+cast": fused_grad_scale_cast,
        "torch foreach mul+step+cast": mul_then(foreach),
        "torch compiled": compiled_variant(p, g, m, v, out),
    }


def stats_variants(g: torch.Tensor) -> dict[str, Callable[[], None]]:
    return {
        "native grad_stats": lambda: native.grad_stats(g),
        "torch vector_norm(float64)**2": lambda: float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2),
    }


def segment_table(n: int, low: int, high: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments of random lengths in [low, high], multiples of 16 (fzero's parameter alignment), groups 0 and 1
    alternating: `(ends, group)` as int64 tensors, built once (as an optimizer would at init)."""
    rng = random.Random(seed)
    ends, end = [], 0
    while end < n:
        end = min(n, end + rng.randrange(low, high + 1, 16))
        ends.append(end)
    return torch.tensor(ends), torch.arange(len(ends)) % 2


def group_variants(p, g, m, v) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """One group (the ungrouped call) against two groups on two segmentations, plain and offload update; also
    returns the segment count of each segmentation."""
    n = p.numel()
    out = torch.empty(n, dtype=torch.bfloat16)
    tables = {"realistic": segment_table(n, 2048, 8192), "worst case": segment_table(n, 16, 64)}
    one = {"lr": LR, "weight_decay": WD}
    two = {"lr": [LR, 2 * LR], "weight_decay": [WD, 0.0]}  # decay / no decay, and a second learning rate
    step = [1]

    def call(segments, hyper, offload):
        def run():
            step[0] += 1
            extra = {"grad_scale": FACTOR, "out": out} if offload else {}
            native.adam_step(p.detach(), g, m, v, step=step[0], betas=BETAS, eps=EPS, segments=segments, **hyper,
                             **extra)  # fmt: skip

        return run

    # the same call twice: their ratio is the noise floor of this run, which the other ratios must be read against
    variants = {"1 group": call(None, one, False), "1 group (control: the same call again)": call(None, one, False)}
    for name, table in tables.items():
        variants[f"2 groups, {name}"] = call(table, two, False)
    variants["offload: 1 group"] = call(None, one, True)
    variants["offload: 2 groups, realistic"] = call(tables["realistic"], two, True)
    return variants, {name: len(table[0]) for name, table in tables.items()}


def bf16_variants(p, g, m, v) -> dict[str, Callable[[], None]]:
    """The offload update on each AVX-512 path (`fzero.native.set_isa` before each call: a few microseconds)."""
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    step = [1]

    def on(isa: str) -> Callable[[], None]:
        def run():
            native.set_isa(isa)
            step[0] += 1
            native.adam_step(p.detach(), g, m, v, step=step[0], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             grad_scale=FACTOR, out=out)  # fmt: skip

        return run

    paths = [isa for isa in ("avx512", "avx512bf16") if isa in native.supported_isas()]
    variants = {isa: on(isa) for isa in paths}
    if "avx512" in variants:
        variants["avx512 (control)"] = on("avx512")
    return variants


def measure(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one per round; rounds visit the variants in a shuffled order."""
    for f in variants.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def report(title: str, n: int, times: dict[str, list[float]], ratios: list[tuple[str, str]]) -> None:
    """Median elements/s of each variant; each ratio is the median over rounds of the paired per-round ratios
    (variants measured in the same round share its machine noise)."""
    print(f"  {title}")
    for name, t in times.items():
        s = statistics.median(t)
        print(f"    {name:40s} {n / s / 1e9:7.3f} Gelem/s  {s * 1e3:9.2f} ms")
    for a, b in ratios:
        if a in times and b in times:
            paired = statistics.median(tb / ta for ta, tb in zip(times[a], times[b], strict=True))
            print(f"    ratio {a} / {b}: {paired:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2-sizes", type=int, nargs="+", default=[24, 26])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--parts", nargs="+", default=["plain", "offload", "stats", "groups"],
                    choices=["plain", "offload", "stats", "groups", "bf16"])  # fmt: skip
    args = ap.parse_args()
    print(f"fzero.native: path {native.isa()}, OpenMP {native.openmp()}, torch {torch.__version__}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for log2 in args.log2_sizes:
            n = 2**log2
            print(f"\n2^{log2} = {n} float32 elements, {threads} thread(s)")
            p, g, m, v = buffers(n)
            if "plain" in args.parts:
                plain = measure(plain_variants(p, g, m, v), args.rounds)
                pairs = [("native", other) for other in ("torch fused", "torch foreach", "torch compiled", "deepspeed",
                                                         "ceiling")]  # fmt: skip
                report("plain AdamW update", n, plain, pairs)
            if "offload" in args.parts:
                full = measure(offload_variants(p, g, m, v), args.rounds)
                best = min((k for k in full if k.startswith("torch")), key=lambda k: statistics.median(full[k]))
                full["torch fastest"] = full[best]
                report(f"offload update: factor + AdamW + bf16 copy (torch fastest: {best})", n, full,
                       [("native fused", "torch fastest"), ("native fused", "torch compiled")])  # fmt: skip
            if "stats" in args.parts:
                stats = measure(stats_variants(g), args.rounds)
                report("gradient statistics", n, stats, [("native grad_stats", "torch vector_norm(float64)**2")])
            if "groups" in args.parts:
                variants, counts = group_variants(p, g, m, v)
                groups = measure(variants, args.rounds)
                segs = ", ".join(f"{k}: {c} segments" for k, c in counts.items())
                report(f"parameter groups, speed relative to one group ({segs})", n, groups,
                       [("1 group (control: the same call again)", "1 group"),
                        ("2 groups, realistic", "1 group"), ("2 groups, worst case", "1 group"),
                        ("offload: 2 groups, realistic", "offload: 1 group")])  # fmt: skip
            if "bf16" in args.parts:
                before = native.isa()
                paths = measure(bf16_variants(p, g, m, v), args.rounds)
                native.set_isa(before)
                report("offload update (factor + AdamW + bf16 copy) by path: above 1 is faster than avx512", n,
                       paths, [("avx512 (control)", "avx512"), ("avx512bf16", "avx512")])  # fmt: skip


if __name__ == "__main__":
    main()

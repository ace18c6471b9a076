"""gloo's own reduce-scatter and all-gather against the exchanges `DistMesh` runs on gloo instead.

    .venv/bin/python benchmarks/collectives.py [--world 2] [--rounds 15] [--sizes 0.4 1.6 3.4 8.4 27.4]

`DistMesh` on gloo reduce-scatters with one `all_to_all_single` of the chunks followed by a sum in rank order (the
same value as `SimMesh`, bitwise; the first and the last rank leave their own chunk out of it), and all-gathers with
one async `broadcast` per rank straight into the output. This prints, per size (millions of elements of the full
buffer) and dtype, the median time of gloo's `reduce_scatter_tensor` / `all_gather_into_tensor` and of `DistMesh`'s
path, and their ratio. One thread per rank; every variant runs in the same processes, timed after a barrier.

Then, per size, stage 0's gradient statistics (`fzero.transforms.grad_stats` on a gradient every rank holds whole
after its all-reduce): one rank's float64 sum of squares over the whole, against its 1/world of it and the
one-element all-reduce that adds the ranks' parts (what stage 0 runs), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fzero
from fzero import native
from fzero.host import process_group
from fzero.transforms.stats import _own_sumsq

fzero.hostmem.enable_huge_pages()  # before the first tensor: fzero's steps and DDP's alike


def _median(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _times(mesh: fzero.DistMesh, n: int, dtype: torch.dtype, rounds: int) -> tuple[float, ...]:
    """Median seconds of gloo's reduce-scatter, the mesh's, gloo's all-gather, the mesh's, on `n` elements."""
    world = mesh.world
    full, shard = torch.randn(n).to(dtype), torch.randn(n // world).to(dtype)
    out_shard, out_full = torch.empty(n // world, dtype=dtype), torch.empty(n, dtype=dtype)
    return (
        _median(lambda: dist.reduce_scatter_tensor(out_shard, full), rounds),
        _median(lambda: mesh.reduce_scatter(full), rounds),
        _median(lambda: dist.all_gather_into_tensor(out_full, shard), rounds),
        _median(lambda: mesh.all_gather_into(out_full, shard), rounds),
    )


def _stats_times(mesh: fzero.DistMesh, n: int, rounds: int) -> tuple[float, float]:
    """Median seconds of the sum of squares of `n` float32 elements, whole and as stage 0 sums them."""
    g = torch.randn(n)
    return (
        _median(lambda: native.sumsq(g), rounds),
        _median(lambda: mesh.all_reduce(_own_sumsq(mesh, g), "sum"), rounds),
    )


def worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = fzero.DistMesh()
    if rank == 0:
        print(f"{world} gloo ranks x 1 thread, median of {args.rounds}; ms (ratio gloo / DistMesh)")
        print(f"{'dtype':9s} {'size':>6s}  {'RS gloo':>8s} {'RS mesh':>8s} {'ratio':>6s}  "
              f"{'AG gloo':>8s} {'AG mesh':>8s} {'ratio':>6s}")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        for size in args.sizes:
            n = int(size * 1e6) // (16 * world) * 16 * world
            rs_gloo, rs_mesh, ag_gloo, ag_mesh = _times(mesh, n, dtype, args.rounds)
            if rank == 0:
                print(f"{str(dtype).removeprefix('torch.'):9s} {n / 1e6:5.1f}M  {rs_gloo * 1e3:8.2f} "
                      f"{rs_mesh * 1e3:8.2f} {rs_gloo / rs_mesh:5.2f}x  {ag_gloo * 1e3:8.2f} {ag_mesh * 1e3:8.2f} "
                      f"{ag_gloo / ag_mesh:5.2f}x", flush=True)  # fmt: skip
    if rank == 0:
        print(f"stage 0's gradient statistics, float32; ms (ratio whole / parts)\n{'size':>6s}  {'whole':>8s} "
              f"{'parts':>8s} {'ratio':>6s}")  # fmt: skip
    for size in args.sizes:
        n = int(size * 1e6) // (16 * world) * 16 * world
        whole, parts = _stats_times(mesh, n, args.rounds)
        if rank == 0:
            print(f"{n / 1e6:5.1f}M  {whole * 1e3:8.2f} {parts * 1e3:8.2f} {whole / parts:5.2f}x", flush=True)
    process_group.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.4, 1.6, 3.4, 8.4, 27.4])
    args = p.parse_args()
    mp.spawn(worker, args=(args.world, tempfile.mktemp(), args), nprocs=args.world)


if __name__ == "__main__":
    main()

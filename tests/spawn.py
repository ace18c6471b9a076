"""Running a test's ranks as real processes over gloo, so that a hang can never outlive its test.

Two watchdogs: each worker's process group has a timeout (`WORKER_TIMEOUT`: a collective that waits longer for
another rank fails, and the worker exits with `fzero.CollectiveError`), and `spawn` kills every worker still running
when the test ends for any reason, including the `pytest.mark.timeout` that every multi-process test carries.
Workers end with `fzero.host.process_group.shutdown()`, so their gloo group is freed before the interpreter exits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fzero.host import process_group

__all__ = ["WORKER_TIMEOUT", "init_deepspeed_worker", "init_worker", "report", "spawn"]

WORKER_TIMEOUT = 180.0  # seconds; far above any collective's wait in these tests, even on a loaded 2-core machine


def init_worker(rank: int, world: int, store: str, timeout: float = WORKER_TIMEOUT) -> None:
    """Join the gloo group of `world` ranks that rendezvous at the file `store`, with a collective `timeout`."""
    process_group.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout
    )


def init_deepspeed_worker(rank: int, world: int, store: str) -> tuple[Any, Any]:
    """`init_worker` for a worker that runs DeepSpeed itself (on its CPU accelerator, with the environment its
    launcher sets) beside fzero's shell: returns `(deepspeed, fzero.deepspeed)`, each trainer's module."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_worker(rank, world, store)
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU collectives would compile a C++ shared-memory kernel first (minutes on this machine); without
    # it they are torch.distributed's gloo ones, the same sums for two ranks
    deepspeed.ops.__compatible_ops__ = {}
    import fzero.deepspeed

    return deepspeed, fzero.deepspeed


def report(rank: int, out_dir: str, results: Any) -> None:
    """Rank 0 writes `results` as `out_dir/results.json` (what the test reads back); every rank waits until it has."""
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` new processes; returns when all succeeded, raises when one failed (the others
    are then stopped), and kills those still running if anything interrupts the wait."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, daemon=True, start_method="spawn")
    try:
        while not ctx.join():
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()

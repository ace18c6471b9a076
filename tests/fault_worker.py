"""Worker for `tests/test_faults.py`: two ranks over gloo that train (or all-gather) until the test stops or kills
one of them; the other must end with `fzero.CollectiveError`, uncaught, as a user's script would.

    python -m tests.fault_worker train|gather RANK WORLD STORE TIMEOUT

Each rank prints ``ready`` once it has finished a few collectives with the other.
"""

from __future__ import annotations

import sys

import torch

import fzero
from fzero.host import process_group
from tests.spawn import init_worker
from tests.support import lm_batches, lm_loss, tiny_gpt


def train(mesh: fzero.DistMesh, rank: int) -> None:
    """ZeRO-3 steps (synchronous and prefetched all-gathers, reduce-scatters, all-reduces) forever."""
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.adamw(1e-3))
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    batches = lm_batches(model, mesh.world, 1, 2, 4, 0)
    i = 0
    while True:
        state, _ = step(state, {k: v[rank] for k, v in batches[i % len(batches)].items()})
        i += 1
        if i == 2:
            print("ready", flush=True)


def gather(mesh: fzero.DistMesh, rank: int) -> None:
    """Async all-gathers, each waited on, forever."""
    x = torch.full((1000,), float(rank))
    out = torch.empty(1000 * mesh.world)
    i = 0
    while True:
        mesh.all_gather_into(out, x, async_op=True).wait()
        i += 1
        if i == 2:
            print("ready", flush=True)


if __name__ == "__main__":
    mode, rank, world, store, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    init_worker(rank, world, store)  # the group's own timeout: the tests' generous default
    mesh = fzero.DistMesh(timeout=float(timeout))  # set on the existing group
    try:
        {"train": train, "gather": gather}[mode](mesh, rank)
    finally:
        process_group.shutdown()

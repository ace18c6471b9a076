"""The step's random stream: one rule that `SimMesh` and `DistMesh` follow alike.

Dropout and other randomness in a forward draw from torch's global generator. A script that seeds every process
alike would draw the same masks on every rank, while ranks simulated one after another in one process would draw
different ones: the simulation would not be the real run. fzero's step instead draws, on micro-step `s` of rank
`r`, from a generator seeded with

    fold(seed, s, r)        (JAX's fold_in: splitmix64 of each value, in turn, mixed into the seed)

where `seed` is part of the training state. The global generator is left as it was (the step stays pure), a
`SimMesh` run is bitwise a `DistMesh` run with dropout on, and a resumed run draws what the uninterrupted one would.

Example:
    >>> fold(0, 1, 2) == fold(0, 1, 2) != fold(0, 2, 1)
    True
    >>> import torch
    >>> with stream(fold(7, 0, 0)):
    ...     a = torch.rand(2)
    >>> with stream(fold(7, 0, 0)):
    ...     b = torch.rand(2)
    >>> torch.equal(a, b)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["fold", "stream"]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def fold(seed: int, *data: int) -> int:
    """A new 63-bit seed from `seed` and the integers `data` (order matters); deterministic everywhere."""
    x = int(seed) & _MASK
    for d in data:
        x = _splitmix64(x ^ _splitmix64(int(d) & _MASK))
    return x >> 1  # torch.manual_seed takes a non-negative int64


@contextlib.contextmanager
def stream(seed: int) -> Iterator[None]:
    """Run the block with torch's generators (CPU, and the current accelerator's) seeded with `seed`, and restore
    their states afterwards."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        # only the generators forked: `torch.manual_seed` would also reseed every other device for good, and on a
        # machine without CUDA format a traceback for its deferred CUDA seeding, about 0.4 ms every micro-step
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield

"""Model-state bytes per rank, read off real states, equal the ZeRO formulas (fzero/memory.py)."""

from __future__ import annotations

import pytest

import fzero
from fzero.state.memory import state_bytes
from tests.support import tiny_gpt


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("micro", [1, 2])
def test_state_bytes_follow_the_zero_formulas(world, precision, micro):
    model = tiny_gpt(0)
    half = precision is not None
    for stage, preset in enumerate((fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3)):
        state = fzero.init(model, preset(fzero.adamw(), accumulate=micro, precision=precision), fzero.SimMesh(world))
        n = state.layout.numel
        sharded_state = n // world if stage else n
        b = state_bytes(state)
        assert b["master"] == 4 * sharded_state
        assert b["optimizer"] == 8 * sharded_state
        compute = (n // world if stage else n) * 2 if half else 0  # fp32: the copy is the master tensor itself
        assert b["compute"] == compute
        acc = 0 if micro == 1 else 4 * (n // world if stage >= 2 else n)
        assert b["accumulator"] == acc
        assert b["total"] == b["master"] + b["optimizer"] + b["compute"] + b["accumulator"] + b["frozen"] + b["other"]
        assert b["other"] < 64 + 8 * len(state.buffers)  # counters and the loss scale: a few bytes


def test_state_bytes_ignore_non_tensor_leaves():
    model = tiny_gpt(0)
    counter = fzero.Transform(lambda flow, ctx: (flow, 7), lambda flow, state, ctx: (flow, state))
    tx = fzero.chain(counter, fzero.reduce_scatter(), fzero.shard_update(fzero.adamw()))
    b = state_bytes(fzero.init(model, tx, fzero.SimMesh(2)))
    assert b["master"] > 0 and b["other"] == 24  # three int64 counters (steps, Adam updates, seed); the int holds none

"""What a step reads back on the host. On a GPU each read of a tensor's value (`.item()`, `float()`, `bool()`) waits
for all the work queued before it, so the engine must read no more than the functional step it runs: the loss it
reports is read when a line is printed or written, or when the user asks (`engine.last_record`), not every step.

The reads are counted as aten's `_local_scalar_dense`, what every such read dispatches to, on floating-point tensors
(the gradients' sum of squares, the loss: on a GPU they live there; the step counters and seeds are integer tensors
that stay on the CPU)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero.metrics import log as metrics
from tests.engine_worker import case_config
from tests.support import lm_batches, tiny_gpt


class FloatReads(TorchDispatchMode):
    """Counts host reads of floating-point values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_floating_point():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _criterion(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _runs(stage: int, precision: str, gas: int, steps: int, printer=None, **extra):
    """The engine and `train_step` under the config's preset on the same batches: per optimizer step, the floating
    reads of each, and each micro-step's loss (read by the test, outside the counting)."""
    model = tiny_gpt(3)
    policy = fzero.get_policy(None if precision == "fp32" else precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on config keys
        engine, *_ = fzero.initialize(model=copy.deepcopy(model), config={**case_config(stage, precision, gas, 3),
                                      **extra}, printer=printer or (lambda *a: None))  # fmt: skip
    reference = copy.deepcopy(model)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2, weight_decay=0.01, fused=True), accumulate=gas,
                                        precision=policy, clip=1.0)  # fmt: skip

    def loss_fn(params, batch):
        return _criterion(torch.func.functional_call(reference, params, (policy.cast_to_compute(batch["x"]),)),
                          batch["y"])  # fmt: skip

    mesh = fzero.SimMesh(1)
    state, step = fzero.init(reference, tx, mesh), fzero.train_step(reference, loss_fn, tx, mesh)
    core, engine_reads, losses = [], [], []
    batches = lm_batches(model, 1, gas, 3, steps, 11)
    for b in range(steps):
        reads = [FloatReads(), FloatReads()]
        for micro in range(gas):
            batch = batches[b * gas + micro]
            with reads[0]:
                state, _ = step(state, batch)
            with reads[1]:
                loss = _criterion(engine(policy.cast_to_compute(batch["x"][0])), batch["y"][0])
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        core.append(reads[0].count)
        engine_reads.append(reads[1].count)
    return engine, core, engine_reads, losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_reads_no_more_than_the_core(stage, precision):
    _, core, engine, _ = _runs(stage, precision, 2, 3)
    assert min(core) >= 1  # the core reads the gradients' sum of squares (clipping, the non-finite check)
    assert engine == core


def test_the_reported_losses_are_read_late_and_exact(monkeypatch):
    """Every step's loss in the records, the printed lines and the summary: the mean of its micro-steps' losses
    (float64, in order), whether the records wait for a line (every 4 steps), for the bound on waiting records
    (monkeypatched to 3) or for `last_record`."""
    monkeypatch.setattr(metrics, "_UNREAD", 3)
    lines: list[str] = []
    engine, _, _, losses = _runs(1, "bf16", 2, 9, printer=lines.append, steps_per_print=4)
    want = [(losses[2 * i] + losses[2 * i + 1]) / 2 for i in range(9)]
    assert engine.last_record["loss"] == want[-1]
    assert engine.monitor.losses == want
    assert engine.summary()["first_loss"] == want[0]
    printed = [line for line in lines if "loss" in line]
    assert len(printed) == 2 and f"{want[3]:.4f}" in printed[0] and f"{want[7]:.4f}" in printed[1], printed

"""SuperOffload (`fzero.Offload(..., speculate=True)`, DeepSpeed's `offload_optimizer.super_offload`): each unit's
update runs as the backward reduces its gradient, before the step's checks are known, and is validated after.

What is bitwise and why: a speculative update runs the same optimizer on the same values as the plain update, unit
by unit (the optimizer is elementwise: any cut of the shard gives the values of one update of the whole, as the
NVMe tier's chunks already rely on), and it is taken only where the step's checks changed nothing (the factor is
exactly `1 / loss scale`, no step skipped, the gradients the chain hands the update are the ones it used). Where
they did (a clipped step, a skipped step, a second backward) it is dropped and the plain update runs. So every
run below equals the plain one bit for bit, hit or miss: no tolerance in this file. The outcome of each step is
predicted from the plain run's own metrics and checked too, so that a speculation that always missed (and so
could never be wrong) fails. Two gloo processes, core and engine: tests/nvme_worker.py (`_speculation`).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fzero
from fzero.config import ConfigError, UnsupportedConfigError, parse_config
from tests.nvme_worker import CLIP, PRESETS, optimizer
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

POISON = 1  # the micro-step whose loss is inf (a skipped step: the speculation misses)


def _run(tx: fzero.Transform, micro: int, steps: int = 3, poison: int | None = None):
    """`steps` updates of the tiny GPT on a `SimMesh(2)`; the losses, each update's metrics, the state."""
    model, mesh = tiny_gpt(0), fzero.SimMesh(2)
    state, base, calls = fzero.init(model, tx, mesh), lm_loss(model), [0]

    def loss_fn(params, batch):
        calls[0] += 1
        loss = base(params, batch)
        return loss * math.inf if (calls[0] - 1) // 2 == poison else loss  # (two simulated ranks per micro-step)

    step = fzero.train_step(model, loss_fn, tx, mesh)
    losses, metrics = [], []
    for batch in lm_batches(tiny_gpt(0), 2, micro, 2, steps, 7):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append(m)
    return losses, metrics, state


@given(
    stage=st.sampled_from([0, 2, 3]),
    device=st.sampled_from(["cpu", "nvme"]),
    params=st.booleans(),
    precision=st.sampled_from([None, "bf16", "fp16"]),
    micro=st.sampled_from([1, 2]),
    clip=st.sampled_from([None, CLIP, 1e-3, 1e9]),
    poison=st.sampled_from([None, POISON]),
    groups=st.booleans(),
)
def test_speculation_equals_plain_bitwise(tmp_path_factory, stage, device, params, precision, micro, clip, poison,
                                          groups):  # fmt: skip
    assume(stage > 0 or micro == 1)  # (stage 0 with accumulation reduces after the backward: test_refused)
    assume(not params or (device == "nvme" and stage == 3))
    d = str(tmp_path_factory.mktemp("speculate"))

    def tx(speculate: bool) -> fzero.Transform:
        off = fzero.Offload(device, path=d if device == "nvme" else None, params="nvme" if params else None,
                            chunk=4096, speculate=speculate)  # fmt: skip
        return PRESETS[stage](optimizer(groups), accumulate=micro, precision=precision, clip=clip, offload=off)

    ref_losses, ref_metrics, ref = _run(tx(False), micro, poison=poison)
    losses, metrics, got = _run(tx(True), micro, poison=poison)
    assert losses == ref_losses
    assert differing(fzero.state_dict(ref), fzero.state_dict(got)) == []
    ends = [(m, r) for m, r in zip(metrics, ref_metrics, strict=True) if m["applied"] or m["skipped"]]
    assert len(ends) == 3 and all("speculation" in m for m, _ in ends)
    assert all("speculation" not in m for m in metrics if not (m["applied"] or m["skipped"]))
    for m, r in ends:  # hit exactly where the plain step's checks changed nothing
        unclipped = clip is None or clip / (r["grad_norm"] + 1e-6) >= 1.0
        assert m["speculation"]["hit"] == (r["applied"] and unclipped), (m["speculation"], r)
        assert m["speculation"]["units"] == len(got.layout.units)
    if poison is not None and stage > 0:
        assert not ends[POISON // micro][0]["speculation"]["hit"]


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_hybrid_mesh(tmp_path, device):
    """Hybrid sharding (`SimMesh(shape={"replicate": 2, "shard": 2})`: each unit's reduction is a reduce-scatter over
    `shard` then an all-reduce over `replicate`): bitwise the plain hybrid run, hits after the clipped first step."""
    runs = []
    for speculate in (False, True):
        off = fzero.Offload(device, path=str(tmp_path) if device == "nvme" else None, chunk=4096, speculate=speculate)
        tx = fzero.zero3(optimizer(True), hybrid=True, offload=off, clip=CLIP, precision="bf16")
        model, mesh = tiny_gpt(0), fzero.SimMesh(shape={"replicate": 2, "shard": 2})
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
        hits = []
        for batch in lm_batches(tiny_gpt(0), 4, 1, 2, 4, 7):
            state, m = step(state, batch)
            hits.append(m.get("speculation", {}).get("hit"))
        runs.append((fzero.state_dict(state), hits))
    assert differing(runs[0][0], runs[1][0]) == []
    assert runs[0][1] == [None] * 4 and runs[1][1] == [False, True, True, True]


def test_rollback_keeps_the_input_state_readable(tmp_path):
    """A missed speculation wrote only the new version: the step's input state is intact (the pure step's
    guarantee, which is what makes the rollback free)."""
    off = fzero.Offload("nvme", params="nvme", path=str(tmp_path), chunk=4096, speculate=True)
    tx = fzero.zero3(optimizer(False), clip=1e-3, offload=off)  # every step clipped: every speculation misses
    model, mesh = tiny_gpt(0), fzero.SimMesh(2)
    state = fzero.init(model, tx, mesh)
    before = {k: v.clone() for k, v in fzero.state_dict(state).items()}
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    new, m = step(state, lm_batches(tiny_gpt(0), 2, 1, 2, 1, 7)[0])
    assert m["speculation"] == {"hit": False, "units": 3}
    assert differing(before, fzero.state_dict(state)) == []
    assert differing(before, fzero.state_dict(new)) != []


def test_speculative_failure_is_raised_and_joined(tmp_path):
    """An error in the speculative update (here the optimizer's, on the worker thread) is the step's error: never
    swallowed into a silent replay; the worker thread is gone after it, and the input state still trains."""
    calls = [0]
    opt = optimizer(False)

    def update(*args, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected failure in unit update")
        return opt.update(*args, **kw)

    tx = fzero.zero3(opt._replace(update=update), offload=fzero.Offload("cpu", speculate=True))
    model, mesh = tiny_gpt(0), fzero.SimMesh(2)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    batch = lm_batches(tiny_gpt(0), 2, 1, 2, 1, 7)[0]
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="injected failure"):
        step(state, batch)
    assert threading.active_count() == threads
    _, m = step(state, batch)
    assert m["applied"] and m["speculation"]["hit"]


def test_refused(tmp_path):
    with pytest.raises(ValueError, match="needs optimizer='cpu' or 'nvme'"):
        fzero.Offload(speculate=True)
    off = fzero.Offload("cpu", speculate=True)
    with pytest.raises(ValueError, match="reduces only after the backward"):  # stage 1: full gradients accumulated
        fzero.init(tiny_gpt(0), fzero.zero1(fzero.cpu_adamw(), accumulate=2, offload=off), fzero.SimMesh(2))
    with pytest.raises(ValueError, match="Lamb"):
        fzero.zero3(fzero.lamb(), offload=off)


def _cfg(stage: int, **offload) -> dict:
    return {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload}}  # fmt: skip


def test_config_super_offload(tmp_path):
    cfg = parse_config(_cfg(3, device="cpu", super_offload=True, cpuadam_cores_perc=0.5), world=2)
    assert cfg.offload_policy == fzero.Offload("cpu", speculate=True)
    cfg = parse_config(_cfg(2, device="nvme", nvme_path=str(tmp_path), super_offload=True), world=2)
    assert cfg.offload_policy.speculate and cfg.offload_policy.optimizer == "nvme"
    assert parse_config(_cfg(3, device="cpu"), world=2).offload_policy == "cpu"
    with pytest.raises(ConfigError, match="super_offload: true needs offload_optimizer.device"):
        parse_config(_cfg(3, super_offload=True), world=2)
    with pytest.raises(UnsupportedConfigError, match="super_offload: true at stage 1 is not supported"):
        parse_config(_cfg(1, device="cpu", super_offload=True), world=2)


def test_engine_reports_speculation(tmp_path):
    """The engine on one process (its rank of a one-rank `SimMesh`) speculates as the core does on one rank: each
    unit's update runs as its gradient lands; without clipping every step's speculation holds (fp32: nothing
    overflows), with DeepSpeed's clipping at 1.0 it misses where the norm is above it and is redone; the metrics
    say so, and it trains bitwise as without `super_offload` either way."""
    torch.manual_seed(0)
    runs = []
    for speculate, clip in ((False, 0.0), (True, 0.0), (False, 1.0), (True, 1.0)):
        model = tiny_gpt(0)
        config = _cfg(3, device="cpu", super_offload=speculate)
        config["train_batch_size"], config["gradient_clipping"] = 2, clip
        engine, *_ = fzero.initialize(model=model, config=config, model_parameters=model.parameters())
        for batch in lm_batches(tiny_gpt(0), 1, 1, 2, 2, 7):
            logits = engine(batch["x"][0])
            engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"][0].flatten()))
            engine.step()
        if speculate:
            assert engine.step_metrics["speculation"] == {"hit": clip == 0.0, "units": 3}, engine.step_metrics
        else:
            assert "speculation" not in engine.step_metrics
        runs.append({k: v.clone() for k, v in engine.module.state_dict().items()})
    assert differing(*runs[:2]) == [] and differing(*runs[2:]) == [] and differing(runs[0], runs[2])

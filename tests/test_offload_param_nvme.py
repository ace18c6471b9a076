"""ZeRO-Infinity's `offload_param: {"device": "nvme"}` without the optimizer on NVMe: `fzero.Offload(None | "cpu",
params="nvme", path=...)`, and the DeepSpeed config that builds it.

The master parameters and the optimizer's state stay in memory; stage 3's compute shard lives in a store of its own
(one leaf, the compute copy), written by each update chunk by chunk and read one unit ahead by the gathering. What
is bitwise and why: the update is the in-memory one (range by range in the copy's write pipeline when donated: the
optimizer is elementwise, docs/native.md), and the copy is the new master cast (`.to`'s bytes, which the kernel's
fused copy-out equals), checked by crc32 on every read. So every run below equals the run with everything in
memory bit for bit: no tolerance anywhere in this file.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero.storage import in_memory
from tests.nvme_worker import optimizer, train
from tests.support import differing, lm_batches, tiny_gpt

CLIP = 1.0  # the first step's gradient norm is 1.54, the next ones below 1: one miss, then hits


def run(**kw):
    """`nvme_worker.train` (the tiny GPT on a `SimMesh`, AdamW with parameter groups unless `opt`): the state, the
    losses, each step's metrics."""
    metrics: list = []
    state, losses, _ = train(groups=True, metrics=metrics, **kw)
    return state, losses, metrics


def leaves(state) -> list[torch.Tensor]:
    """Every tensor of the state (the master, the compute copy, the optimizer's state, ...), offloaded ones read."""
    return [in_memory(x) for x in optree.tree_leaves(state, namespace="fzero")]


def assert_bitwise(a, b) -> None:
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


CASES = {  # optimizer device, precision, accumulation, donated, optimizer, speculate, stage
    "memory fp32 donated": (None, None, 1, True, None, False, 3),
    "memory bf16 pure accumulation": (None, "bf16", 2, False, None, False, 3),
    "cpu bf16 donated accumulation": ("cpu", "bf16", 2, True, None, False, 3),
    "cpu fp32 pure": ("cpu", None, 1, False, None, False, 3),
    "memory bf16 donated torch adamw": (None, "bf16", 1, True, "adamw", False, 3),
    "cpu bf16 donated lamb": ("cpu", "bf16", 1, True, "lamb", False, 3),
    "cpu bf16 speculate clipped": ("cpu", "bf16", 1, True, None, True, 3),
    "memory bf16 donated stage 2": (None, "bf16", 1, True, None, False, 2),  # (without accumulation: see below)
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_memory_bitwise(tmp_path, case):
    device, precision, micro, donate, opt_name, speculate, stage = CASES[case]
    opt = {None: None, "adamw": fzero.adamw(1e-2, weight_decay=0.1), "lamb": fzero.lamb(1e-2)}[opt_name]
    clip = CLIP if speculate else None
    kw = dict(
        precision=precision, micro=micro, donate=donate, opt=opt, clip=clip, steps=3 if speculate else 2, stage=stage
    )
    ref, ref_losses, _ = run(**kw)
    offload = fzero.Offload(device, params="nvme", path=str(tmp_path), chunk=4096, speculate=speculate)
    got, losses, metrics = run(offload=offload, **kw)
    assert losses == ref_losses
    assert_bitwise(ref, got)
    assert type(got.compute).__name__ == "Offloaded" and type(got.params).__name__ == "Tensor"
    assert got.compute.dtype == (torch.bfloat16 if precision else torch.float32)
    # each update writes the compute copy once per rank, no more (the master and the state stay in memory)
    shard = got.params.shape[-1]
    updates = [m["io"]["nvme"] for m in metrics if m["applied"]]
    assert len(updates) == kw["steps"]
    assert all(x["written"] == shard * got.compute.element_size() for x in updates), updates
    if speculate:  # hits and misses (clipped steps), each bitwise the plain run's
        hits = [m["speculation"]["hit"] for m in metrics]
        assert any(hits) and not all(hits), hits


def test_state_bytes_and_the_stores_memory(tmp_path):
    state, _, _ = run(offload=fzero.Offload("cpu", params="nvme", path=str(tmp_path), chunk=4096), steps=1,
                      precision="bf16")  # fmt: skip
    b, shard = fzero.state_bytes(state), state.params.shape[-1]
    assert b["master"] == 4 * shard and b["optimizer"] > 0 and b["compute"] == 0
    assert b["offloaded"] == 2 * shard  # the bf16 compute shard, on disk
    # the store's staging: buffers x chunk x the copy's bytes per element, for both ranks of the SimMesh
    assert b["staging"] * 2 == 4 * 4096 * 2
    assert state.compute.store.leaves == {"compute": torch.bfloat16}


def test_checkpoint_round_trip(tmp_path):
    """Saved with the compute copy on disk, loaded into the same policy and into memory (and a checkpoint made in
    memory into this policy): each resumed run equals the uninterrupted in-memory run, bitwise."""
    kw = dict(precision="bf16", donate=True)
    full, full_losses, _ = run(steps=3, **kw)
    offload = fzero.Offload("cpu", params="nvme", path=str(tmp_path), chunk=4096)
    disk, _, _ = run(steps=2, offload=offload, **kw)
    mem, _, _ = run(steps=2, **kw)
    fzero.save(disk, tmp_path / "ck-disk")
    fzero.save(mem, tmp_path / "ck-mem")
    for source, target in (("ck-disk", offload), ("ck-disk", None), ("ck-mem", offload)):
        tx = fzero.zero3(optimizer(groups=True), precision="bf16", offload=target)
        like = fzero.init(tiny_gpt(0), tx, fzero.SimMesh(2))
        state, extra = fzero.load(tmp_path / source, like)
        assert extra["step"] == 2
        assert type(state.compute).__name__ == ("Offloaded" if target else "Tensor")
        state, losses, _ = run(steps=1, start=2, offload=target, state=state, **kw)
        assert losses == full_losses[2:], (source, target)
        assert_bitwise(full, state)


def _engine_run(tmp_path, precision: str, optimizer: str | None, param: str | None, steps: int = 2):
    """The DeepSpeed engine on one process (a one-rank SimMesh) from a config dict."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if optimizer is not None:
        config["zero_optimization"]["offload_optimizer"] = {"device": optimizer}
    if param is not None:
        config["zero_optimization"]["offload_param"] = {"device": param, "nvme_path": str(tmp_path)}
    model = tiny_gpt(0)
    engine, *_ = fzero.initialize(model=model, config=config, model_parameters=model.parameters())
    losses = []
    for batch in lm_batches(model, 1, 2, 2, steps, 7):
        loss = F.cross_entropy(engine(batch["x"][0]).float().flatten(0, 1), batch["y"][0].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return engine, losses


@pytest.mark.parametrize(("precision", "optimizer"), [("fp32", None), ("bf16", "cpu")])
def test_engine_from_a_deepspeed_config(tmp_path, precision, optimizer):
    """`offload_param: nvme` with the optimizer in memory (no `offload_optimizer`) and on the CPU, bitwise the
    in-memory engine; its checkpoint loads into a new engine bitwise, and the two go on alike."""
    ref, ref_losses = _engine_run(tmp_path, precision, None, None)
    engine, losses = _engine_run(tmp_path, precision, optimizer, "nvme")
    assert type(engine.state.compute).__name__ == "Offloaded"
    assert type(engine.state.params).__name__ == "Tensor"
    assert losses == ref_losses
    assert differing(ref.module_state_dict(), engine.module_state_dict()) == []
    assert_bitwise(ref.state, engine.state)
    engine.save_checkpoint(str(tmp_path / "ck"), tag="t")
    resumed, _ = _engine_run(tmp_path, precision, optimizer, "nvme", steps=0)
    resumed.load_checkpoint(str(tmp_path / "ck"), tag="t")
    assert type(resumed.state.compute).__name__ == "Offloaded"
    assert_bitwise(engine.state, resumed.state)
    batch = lm_batches(tiny_gpt(0), 1, 1, 2, 3, 9)[-1]
    for e in (engine, resumed):  # (a forward and a step from the loaded copy on disk)
        e.backward(F.cross_entropy(e(batch["x"][0]).float().flatten(0, 1), batch["y"][0].flatten()))
        e.step()
    assert_bitwise(engine.state, resumed.state)


def test_config_builds_the_policy(tmp_path):
    from fzero.config import ConfigError, parse_config

    def cfg(optimizer=None, stage=3, super_offload=False, **param):
        zero = {"stage": stage, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), **param}}
        if optimizer is not None:
            zero["offload_optimizer"] = {"device": optimizer, "nvme_path": str(tmp_path / "opt"),
                                         "super_offload": super_offload}  # fmt: skip
        return parse_config({"train_batch_size": 8, "zero_optimization": zero,
                             "aio": {"block_size": 1 << 16, "intra_op_parallelism": 2}}, world=2)  # fmt: skip

    path, aio = str(tmp_path), dict(threads=2, block_size=1 << 16)
    assert cfg().offload_policy == fzero.Offload(None, params="nvme", path=path, buffers=5, **aio)
    assert cfg("none", buffer_count=3).offload_policy == fzero.Offload(None, params="nvme", path=path, buffers=3, **aio)
    assert cfg("cpu").offload_policy == fzero.Offload("cpu", params="nvme", path=path, buffers=5, **aio)
    speculative = cfg("cpu", super_offload=True).offload_policy
    assert speculative == fzero.Offload("cpu", params="nvme", path=path, buffers=5, speculate=True, **aio)
    # with the optimizer on NVMe the compute copy goes in the optimizer's files (its path and buffers)
    assert cfg("nvme").offload_policy == fzero.Offload("nvme", params="nvme", path=str(tmp_path / "opt"), **aio)
    assert cfg("cpu", stage=2).offload_policy == "cpu"  # DeepSpeed reads offload_param at stage 3 only
    assert cfg(stage=2).offload_policy is None
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_count"):
        cfg(buffer_count=2)
    with pytest.raises(ConfigError, match=r"offload_param\.device: 'nvme' needs nvme_path"):
        parse_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})


def test_bad_policies_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"Offload\(params='nvme'\) needs a directory"):
        fzero.Offload("cpu", params="nvme")
    with pytest.raises(ValueError, match=r"Offload\(params='nvme'\) .* \(stage 0\): use stages 1-3"):
        tx = fzero.zero0(fzero.cpu_adamw(), offload=fzero.Offload(None, params="nvme", path=str(tmp_path)))
        fzero.init(tiny_gpt(0), tx, fzero.SimMesh(2))
    with pytest.raises(ValueError, match="speculate=True"):
        fzero.Offload(None, params="nvme", path=str(tmp_path), speculate=True)
    # stages 1-2 keep the gathered parameters through an accumulation window: in memory, where the handle was
    with pytest.raises(ValueError, match=r"zero1, zero2 with accumulate > 1"):
        run(stage=2, micro=2, steps=1, offload=fzero.Offload(None, params="nvme", path=str(tmp_path)))
    # a state made in memory, stepped by a chain that keeps the compute copy on disk
    state, _, _ = run(steps=0)
    with pytest.raises(ValueError, match="this state's compute parameters are a Tensor"):
        run(steps=1, state=state, offload=fzero.Offload(None, params="nvme", path=str(tmp_path)))

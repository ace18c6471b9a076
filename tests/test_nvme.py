"""The NVMe tier (`fzero.Offload("nvme", path=...)`, issue 24): the master parameters and the optimizer's
per-element state in swap files, updated through the store's pipeline.

What is bitwise and why: the optimizer runs on each chunk of the shard as on the whole (it is elementwise, and the
native kernel's results are bitwise the same on any piece: docs/native.md), the gradients and the compute copy
are the in-memory run's, and the files hold exact bytes (checked by crc32 per block). So every configuration
below equals the in-memory run bit for bit: no tolerance anywhere in this file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fzero
from fzero.storage import StaleStateError, StorageFullError, StoragePathError, SwapCorruptError
from tests import nvme_worker
from tests.nvme_worker import train
from tests.spawn import spawn
from tests.support import differing, lm_batches, lm_loss, tiny_gpt


def direct_io(path) -> bool:
    """Whether the filesystem of `path` takes O_DIRECT (a tmpfs before Linux 6.6 does not)."""
    probe = os.path.join(path, ".direct-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def nvme(path, **kw) -> fzero.Offload:
    return fzero.Offload("nvme", path=str(path), chunk=kw.pop("chunk", 4096), **kw)


@given(
    stage=st.sampled_from([0, 1, 2, 3]),
    precision=st.sampled_from([None, "bf16"]),
    micro=st.sampled_from([1, 2]),
    threads=st.sampled_from([1, 4]),
    direct=st.sampled_from([False, True]),
    buffers=st.sampled_from([3, 5]),
    groups=st.booleans(),
    params=st.sampled_from([None, "nvme"]),
)
def test_nvme_equals_memory_bitwise(tmp_path_factory, stage, precision, micro, threads, direct, buffers, groups,
                                    params):  # fmt: skip
    assume(stage > 0 or params is None)  # (stage 0 has no shard to offload: test_bad_policies)
    d = tmp_path_factory.mktemp("nvme")
    direct = direct and direct_io(d)  # (where the filesystem refuses it, buffered: tests/test_storage.py has that case)
    kw = dict(stage=stage, precision=precision, micro=micro, groups=groups)
    ref, ref_losses, _ = train(**kw)
    got, losses, io = train(offload=nvme(d, threads=threads, direct=direct, buffers=buffers, params=params), **kw)
    assert losses == ref_losses
    assert differing(fzero.state_dict(ref), fzero.state_dict(got)) == []
    assert type(got.params).__name__ == "Offloaded" and got.params.store.direct == direct
    assert type(got.compute).__name__ == ("Offloaded" if params else "Tensor")
    # every update reads and writes the master and both moments once per rank, and writes the compute copy; the
    # gathers read the compute copy at least once per update (stage 3: forward and backward, small units once; on a
    # SimMesh every simulated rank reads every rank's piece)
    shard = got.params.shape[-1]
    master = shard * (torch.empty((), dtype=got.params.dtype).element_size() + 8)
    copy = shard * torch.empty((), dtype=ref.compute.dtype).element_size() if params else 0
    updates = [x["nvme"] for x in io if x is not None]
    assert len(updates) == 3 and all(x["written"] == master + copy for x in updates), updates
    assert all(x["read"] == master if not params else x["read"] >= master + copy for x in updates), updates


def test_fifty_steps_stage3_bf16_accumulation(tmp_path):
    """The issue's long run: 50 steps, stage 3, bf16, accumulation 2, parameter groups."""
    kw = dict(stage=3, precision="bf16", micro=2, steps=50, groups=True)
    ref, ref_losses, _ = train(**kw)
    got, losses, _ = train(offload=nvme(tmp_path, chunk=8192), **kw)
    assert losses == ref_losses
    assert differing(fzero.state_dict(ref), fzero.state_dict(got)) == []


def test_state_bytes_and_memory_bound(tmp_path):
    _, _, _ = train(steps=0)
    state, _, _ = train(steps=1, offload=nvme(tmp_path, buffers=4, chunk=4096))
    b = fzero.state_bytes(state)
    shard = state.params.shape[-1]
    assert b["master"] == 0 and b["optimizer"] == 0
    assert b["offloaded"] == 12 * shard
    # the bound of docs/offload.md: buffers x chunk x (bytes per element of the leaves), for all ranks of a SimMesh
    assert b["staging"] * 2 == 4 * 4096 * 12


def test_pure_step_keeps_its_input_until_overwritten(tmp_path):
    state, _, _ = train(steps=1, offload=nvme(tmp_path))
    before = state.params.read()
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.cpu_adamw(1e-2, weight_decay=0.1), offload=nvme(tmp_path))
    step = fzero.train_step(model, lm_loss(model), tx, fzero.SimMesh(2))
    batches = list(lm_batches(tiny_gpt(0), 2, 1, 2, 2, 7))
    s1, _ = step(state, batches[0])
    assert torch.equal(state.params.read(), before)  # the input is still readable: a pure step
    after = s1.params.read()
    s1b, _ = step(state, batches[0])  # and can be stepped again (a speculative step rolled back)
    assert torch.equal(s1b.params.read(), after)
    with pytest.raises(StaleStateError, match="overwritten by a later step"):
        s1.params.read()  # its slot now holds s1b's values


def test_checkpoint_resumes_on_another_world_size(tmp_path):
    """Saved from NVMe on 2 ranks, resumed on 3 ranks in memory and on NVMe: the same as the in-memory run
    resumed the same way."""
    ck = tmp_path / "ck"
    kw = dict(stage=3, precision="bf16", micro=2, groups=True)
    mem, _, _ = train(steps=3, **kw)
    got, _, _ = train(steps=3, offload=nvme(tmp_path), **kw)
    fzero.checkpoint.save(got, ck / "nvme")
    fzero.checkpoint.save(mem, ck / "mem")
    for offload in (None, nvme(tmp_path)):
        tx = fzero.zero3(nvme_worker.optimizer(True), accumulate=2, precision="bf16", offload=offload)
        # (one `like` each: two states loaded into one store would share its two slots)
        a, _ = fzero.checkpoint.load(ck / "nvme", fzero.init(tiny_gpt(0), tx, fzero.SimMesh(3)))
        b, _ = fzero.checkpoint.load(ck / "mem", fzero.init(tiny_gpt(0), tx, fzero.SimMesh(3)))
        assert type(a.params).__name__ == ("Offloaded" if offload else "Tensor")
        ra, la, _ = train(world=3, steps=2, start=3, offload=offload, state=a, **kw)
        rb, lb, _ = train(world=3, steps=2, start=3, offload=offload, state=b, **kw)
        assert la == lb
        assert differing(fzero.state_dict(ra), fzero.state_dict(rb)) == []


def test_files_are_safetensors_and_removed(tmp_path):
    from safetensors import safe_open

    state, _, _ = train(steps=1, offload=nvme(tmp_path))
    store = state.params.store
    files = sorted(store.scratch.path.iterdir())
    assert files and all(f.name.startswith(("rank0-", "rank1-")) for f in files)
    with safe_open(str(files[0]), framework="pt") as f:
        names = {k for k in f.keys() if not k.startswith("__pad")}
    assert names == {f"{n}.{s}" for n in ("params", "exp_avg", "exp_avg_sq") for s in (0, 1)}
    where = store.scratch.path
    store.close()
    assert not where.exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("fzero-io")]


# ------------------------------------------------------------------------------------------------------- faults
def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupted_and_truncated_swap_files_are_named(tmp_path):
    state, _, _ = train(steps=1, offload=nvme(tmp_path))
    x = state.params
    f = x.store.files[0, 0]
    _flip(f.path, f.offset(f"params.{x.slot}") + 5)
    with pytest.raises(SwapCorruptError, match=str(f.path.name)):
        train(steps=1, offload=nvme(tmp_path), state=state)
    state, _, _ = train(steps=1, offload=nvme(tmp_path))
    f = state.params.store.files[1, 0]
    os.truncate(f.path, f.offset("exp_avg.0"))
    with pytest.raises(SwapCorruptError, match=str(f.path.name)):
        state.params.store.read(state.tx_state["shard_update"].exp_avg)


def test_bad_policies(tmp_path):
    with pytest.raises(ValueError, match=r"Offload\(params='nvme'\) .* \(stage 0\): use stages 1-3"):
        train(stage=0, steps=0, offload=nvme(tmp_path, params="nvme"))
    with pytest.raises(ValueError, match="needs a directory"):
        fzero.Offload("cpu", params="nvme")
    with pytest.raises(ValueError, match="chunk must be a multiple of 4096"):
        fzero.Offload("nvme", path=str(tmp_path), chunk=5000)
    with pytest.raises(ValueError, match="buffers must be an integer >= 3"):
        fzero.Offload("nvme", path=str(tmp_path), buffers=2)
    with pytest.raises(ValueError, match="whole parameter tensors"):
        train(steps=1, offload=nvme(tmp_path), opt=fzero.lamb())


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(StoragePathError, match="nowhere"):
        train(steps=0, offload=fzero.Offload("nvme", path=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="needs a directory"):
        fzero.zero3(fzero.cpu_adamw(), offload="nvme")


def test_full_disk_is_named(tmp_path):
    """`RLIMIT_FSIZE` stands for a full disk (the kernel refuses the write with EFBIG, as with ENOSPC): the swap
    files are allocated whole at `init`, so it fails there, naming the file."""
    code = f"""
import resource, signal, torch, fzero
from tests.support import tiny_gpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))
tx = fzero.zero3(fzero.cpu_adamw(), offload=fzero.Offload("nvme", path={str(tmp_path)!r}, chunk=4096))
try:
    fzero.init(tiny_gpt(0), tx, fzero.SimMesh(2))
except fzero.storage.StorageFullError as e:
    print("FULL", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("FULL") and ".swap" in out.stdout, out.stdout
    assert issubclass(StorageFullError, fzero.storage.StorageError)
    assert not list(tmp_path.iterdir())  # the failed run's scratch directory is gone


@pytest.mark.timeout(300)
def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    """SIGKILL in the middle of a step (inside the update's pipeline): the next run removes the dead run's swap
    files and resumes from the last checkpoint, bitwise the uninterrupted run."""
    swap, ck = tmp_path / "swap", tmp_path / "ck"
    swap.mkdir()
    # this process's thread count: a matmul's reduction order, so the killed run's checkpoint, may depend on it
    code = f"""
import os, signal, torch, fzero
torch.set_num_threads({torch.get_num_threads()})
from fzero.storage import store
from tests import nvme_worker
from tests.nvme_worker import train
nvme_worker.killed_run({str(swap)!r}, {str(ck)!r})
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert len(list(swap.iterdir())) == 1  # the killed run's scratch directory is left behind
    resumed = nvme_worker.resume(str(swap), str(ck))
    assert [p for p in swap.iterdir() if p != resumed.params.store.scratch.path] == []  # removed by the next run
    ref, _, _ = train(steps=6, **nvme_worker.KW)
    assert differing(fzero.state_dict(ref), fzero.state_dict(resumed)) == []


# ------------------------------------------------------------------------------------------------- processes
@pytest.mark.timeout(600)
def test_two_gloo_processes_core_and_engine(tmp_path):
    spawn(nvme_worker.run, (2, str(tmp_path)), 2)
    import json

    results = json.loads((tmp_path / "results.json").read_text())
    assert results == {name: [] for name in nvme_worker.CASES}


def test_engine_on_one_process_reads_unit_by_unit(tmp_path):
    """`fzero.initialize` without torchrun (a one-rank SimMesh) with `offload_param: nvme` computes unit by unit
    from the disk, as the core does (the whole compute copy is never in memory: `gathered_peak` below the model),
    bitwise the in-memory engine; evaluation under `no_grad` too."""
    import torch.nn.functional as F

    from fzero.examples.gpt import GPT, GPTConfig

    def six_blocks() -> GPT:  # (with 2 blocks every unit is live at once: the root's tied head, one prefetched)
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=6, n_head=2, d_model=16))

    runs = []
    for device in ("none", "nvme"):
        off = {"device": device, "nvme_path": str(tmp_path)}
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": off,
                                        "stage3_param_persistence_threshold": 0}}  # fmt: skip
        model = six_blocks()
        engine, *_ = fzero.initialize(model=model, config=config, model_parameters=model.parameters())
        for batch in lm_batches(model, 1, 2, 2, 3, 7):
            loss = F.cross_entropy(engine(batch["x"][0]).float().flatten(0, 1), batch["y"][0].flatten())
            engine.backward(loss)
            engine.step()
        with torch.no_grad():
            out = engine(lm_batches(model, 1, 1, 2, 1, 9)[0]["x"][0])
        if device == "nvme":
            assert type(engine.state.compute).__name__ == "Offloaded"
            assert engine.step_metrics["gathered_peak"] < engine.state.layout.numel
        runs.append((engine.module_state_dict(), out))
    assert differing(runs[0][0], runs[1][0]) == []
    assert torch.equal(runs[0][1], runs[1][1])


# ------------------------------------------------------------------------------------------------------ config
def _cfg(**offload):
    return {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload}}  # fmt: skip


def test_config_keys(tmp_path):
    from fzero.config import ConfigError, UnsupportedConfigError, parse_config

    cfg = parse_config({**_cfg(device="nvme", nvme_path=str(tmp_path), buffer_count=5),
                        "aio": {"block_size": 1 << 16, "intra_op_parallelism": 3}}, world=2)  # fmt: skip
    assert cfg.offload_policy == fzero.Offload("nvme", path=str(tmp_path), buffers=5, threads=3, block_size=1 << 16)
    with pytest.warns(DeprecationWarning, match="aio.thread_count is the old name of aio.intra_op_parallelism"):
        cfg = parse_config({**_cfg(device="nvme", nvme_path=str(tmp_path)), "aio": {"thread_count": 2}}, world=2)
    assert cfg.offload_policy.threads == 2
    bad = [
        (_cfg(device="nvme"), ConfigError, "offload_optimizer.device: 'nvme' needs nvme_path"),
        ({**_cfg(device="nvme", nvme_path="x"), "aio": {"use_gds": True}}, UnsupportedConfigError, "aio.use_gds"),
        ({**_cfg(device="nvme", nvme_path="x"), "aio": {"block_size": 1000}}, ConfigError, "aio.block_size"),
        ({**_cfg(), "aio": {"thread_count": 1, "intra_op_parallelism": 1}}, ConfigError, "aio.thread_count"),
        (_cfg(device="nvme", nvme_path="x", ratio=0.5), UnsupportedConfigError, "ratio"),
        (_cfg(device="nvme", nvme_path="x", buffer_count=2), ConfigError, "buffer_count"),
    ]
    for config, error, key in bad:
        with pytest.raises(error, match=key), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            parse_config(config, world=2)
    both = _cfg(device="nvme", nvme_path=str(tmp_path))
    both["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    assert parse_config(both, world=2).offload_policy.params == "nvme"
    both["zero_optimization"]["stage"] = 2  # DeepSpeed reads offload_param at stage 3 only
    assert parse_config(both, world=2).offload_policy.params is None
    offload_param = {"device": "nvme", "nvme_path": str(tmp_path)}
    param = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": offload_param}}
    alone = parse_config(param, world=2).offload_policy  # the optimizer in memory: its own files (DeepSpeedExamples)
    assert (alone.optimizer, alone.params, alone.path) == (None, "nvme", str(tmp_path))
    param["zero_optimization"]["offload_param"] = {"device": "nvme"}
    with pytest.raises(ConfigError, match="offload_param.device: 'nvme' needs nvme_path"):
        parse_config(param, world=2)


def test_hybrid_mesh_trains_saves_and_resumes(tmp_path):
    """Hybrid sharding ((2, 2) SimMesh) with the tier: bitwise the in-memory run, through a checkpoint."""
    mesh = fzero.SimMesh(shape={"replicate": 2, "shard": 2})

    def run(offload, state=None, start=0):
        model = tiny_gpt(0)
        tx = fzero.zero3(fzero.cpu_adamw(1e-2), hybrid=True, offload=offload, precision="bf16")
        state = state or fzero.init(model, tx, mesh)
        step = fzero.train_step(model, lm_loss(model), tx, mesh)
        for batch in lm_batches(tiny_gpt(0), 4, 1, 2, 2 + start, 3)[start:]:
            state, _ = step(state, batch)
        return state, tx

    mem, _ = run(None)
    got, tx = run(nvme(tmp_path))
    assert differing(fzero.state_dict(mem), fzero.state_dict(got)) == []
    fzero.checkpoint.save(got, tmp_path / "ck")
    loaded, _ = fzero.checkpoint.load(tmp_path / "ck", fzero.init(tiny_gpt(0), tx, mesh))
    assert type(loaded.params).__name__ == "Offloaded"
    got, _ = run(nvme(tmp_path), state=loaded, start=2)
    mem, _ = run(None, state=mem, start=2)
    assert differing(fzero.state_dict(mem), fzero.state_dict(got)) == []


def test_reads_from_several_threads(tmp_path):
    """A checkpoint of a SimMesh state writes its ranks' files on threads side by side, each reading its rows of
    the offloaded leaves: the store's streams share staging buffers, so they must run one after another."""
    from concurrent.futures import ThreadPoolExecutor

    state, _, _ = train(world=4, steps=1, offload=nvme(tmp_path, chunk=4096))
    leaves = [state.params, state.tx_state["shard_update"].exp_avg, state.tx_state["shard_update"].exp_avg_sq]
    whole = [x.read() for x in leaves]
    jobs = [(k, r) for _ in range(20) for k in range(3) for r in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: leaves[job[0]].read(job[1]), jobs))
    assert all(torch.equal(g, whole[k][r]) for g, (k, r) in zip(got, jobs, strict=True))


def test_partial_load_keeps_the_rest(tmp_path):
    """`load(..., select=)` into an offloaded state: the selected leaves from the checkpoint, the others the
    target's own (copied into the new version on disk)."""
    saved, _, _ = train(steps=2, offload=nvme(tmp_path))
    fzero.checkpoint.save(saved, tmp_path / "ck")
    like, _, _ = train(steps=0, offload=nvme(tmp_path))
    fresh = like.tx_state["shard_update"].exp_avg.read()
    got, _ = fzero.checkpoint.load(tmp_path / "ck", like, select=lambda key: key == "params")
    assert torch.equal(got.params.read(), saved.params.read())
    assert torch.equal(got.tx_state["shard_update"].exp_avg.read(), fresh)
    assert int(got.step) == 0


def test_an_io_error_is_named_and_the_input_state_survives(tmp_path):
    """A write that the system refuses mid-update (here: one swap file's descriptor replaced by a read-only one,
    EBADF): the step raises `StorageError` naming the file, after every transfer in flight has finished (no
    thread left writing, none hung), and the state the step started from is still whole on disk."""
    from fzero.storage import StorageError

    state, _, _ = train(steps=1, offload=nvme(tmp_path))
    before = [x.read() for x in (state.params, state.tx_state["shard_update"].exp_avg)]
    f = state.params.store.files[1, 0]
    readonly = os.open(f.path, os.O_RDONLY)
    os.dup2(readonly, f._fd)  # (the file's own descriptor now refuses writes)
    os.close(readonly)
    with pytest.raises(StorageError, match=f"{f.path.name}.*EBADF"):
        train(steps=1, start=1, offload=nvme(tmp_path), state=state)
    after = [x.read() for x in (state.params, state.tx_state["shard_update"].exp_avg)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    state.params.store.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("fzero-io")]


@pytest.mark.parametrize("states", [None, torch.bfloat16])
def test_bf16_master_weights_on_disk(tmp_path, states):
    """DeepSpeed's `bf16_master_weights_and_grads` (`fzero.optim.stored_in`): the store holds the leaves in their
    stored dtypes (bf16 master; bf16 moments with `bf16_optimizer_states`), bitwise the in-memory run."""
    opt = fzero.optim.stored_in(fzero.cpu_adamw(1e-2), torch.bfloat16, states)
    bf16 = torch.bfloat16
    kw = dict(stage=3, micro=2, opt=opt, precision=fzero.Policy(param_dtype=bf16, compute_dtype=bf16, accum_dtype=bf16))
    ref, ref_losses, _ = train(**kw)
    got, losses, _ = train(offload=nvme(tmp_path), **kw)
    assert losses == ref_losses
    assert differing(fzero.state_dict(ref), fzero.state_dict(got)) == []
    assert got.params.store.leaves == {"params": bf16, "exp_avg": states or torch.float32,
                                       "exp_avg_sq": states or torch.float32}  # fmt: skip

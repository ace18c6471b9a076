"""The CUDA path: the stages, the engine, ZeRO-Offload and the compute shard on NVMe on a GPU, over NCCL (a group
of one: NCCL refuses two ranks on one device, so these tests need only one GPU), against torch's AdamW on the same
GPU. Skipped without CUDA; CI has none (docs/engine.md, "On a GPU", says where they last ran)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import fzero
from fzero.host import process_group
from fzero.storage import in_memory
from tests import engine_worker
from tests.bounds import assert_adam_close
from tests.support import differing, lm_batches, lm_loss, reference_run, tiny_gpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PRESETS = (fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3)
LR = 1e-2
STEPS = 3


@pytest.fixture(autouse=True)
def on_the_gpu(monkeypatch):
    """The engine trains on the GPU (tests/conftest.py sets the CPU for the rest of the suite)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    """A DistMesh over an NCCL group of one rank on GPU 0, for the module's tests; destroyed after them."""
    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("nccl") / "store"
    process_group.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, timeout=120)
    try:
        yield fzero.DistMesh()
    finally:
        process_group.shutdown()


def _on_cuda(batches):
    return [{k: v.cuda() for k, v in b.items()} for b in batches]


def _rank_batches(model, steps: int, seed: int):
    """The engine's batches on one rank: `steps` micro-batches of 4 sequences, on the GPU."""
    return [{k: v[0] for k, v in b.items()} for b in _on_cuda(lm_batches(model, 1, 1, 4, steps, seed))]


def _core(stage: int, mesh, model, batches, micro: int = 1, fused: bool = False, **kwargs):
    tx = PRESETS[stage](fzero.adamw(LR, fused=fused), accumulate=micro, **kwargs)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    sim = isinstance(mesh, fzero.SimMesh)  # a SimMesh takes every rank's batch, a DistMesh its own
    for batch in batches:
        state, _ = step(state, batch if sim else {k: v[0] for k, v in batch.items()})
    return fzero.state_dict(state, mesh)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_over_nccl_are_torch_adamw_bitwise(nccl, stage):
    """One rank, one micro-step, float32: every stage runs torch's own kernels on the GPU (the forward, the
    backward, `torch.optim.AdamW(foreach=False)`'s elementwise steps) in the same order, so bitwise; with two
    micro-steps the gradient sums in another order, so Adam's step bound (tests/bounds.py)."""
    model = tiny_gpt(5).cuda()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = _on_cuda(lm_batches(model, 1, 1, 4, STEPS, 6))
    want = reference_run(model, lm_loss, batches, 1, lambda p: torch.optim.AdamW(p, lr=LR, foreach=False))
    got = _core(stage, nccl, copy.deepcopy(model), batches)
    assert all(v.is_cuda for v in got.values())
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    batches = _on_cuda(lm_batches(model, 1, 2, 2, STEPS, 7))
    want = reference_run(model, lm_loss, batches, 2, lambda p: torch.optim.AdamW(p, lr=LR))
    got = _core(stage, nccl, copy.deepcopy(model), batches, micro=2)
    assert_adam_close({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()},
                      {k: v.cpu() for k, v in start.items()}, LR, STEPS)  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fused_adamw_on_cuda_is_torch_fused_bitwise(nccl, stage):
    """`adamw(fused=True)` with master weights on the GPU runs torch's fused kernel: every stage bitwise
    `torch.optim.AdamW(fused=True)` (one rank, one micro-step, float32). The kernel computes each element alike
    wherever a tensor ends (unlike its CPU build), which a flat buffer against the model's tensors relies on."""
    model = tiny_gpt(13).cuda()
    batches = _on_cuda(lm_batches(model, 1, 1, 4, STEPS, 14))
    want = reference_run(model, lm_loss, batches, 1, lambda p: torch.optim.AdamW(p, lr=LR, fused=True))
    got = _core(stage, nccl, copy.deepcopy(model), batches, fused=True)
    assert all(v.is_cuda for v in got.values())
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_fused_adamw_on_cuda_is_elementwise():
    """The whole buffer in one call, or cut into pieces of odd lengths: the same values (what sharding needs)."""
    g = torch.Generator(device="cuda").manual_seed(15)
    p0, grads = (torch.randn(10_007, device="cuda", generator=g) for _ in range(2))
    opt = fzero.adamw(LR, weight_decay=0.1, fused=True)
    whole, _ = opt.update(grads, opt.init(p0), p0)
    cut = [0, 3, 1000, 4097, 10_007]
    pieces = [opt.update(grads[a:b], opt.init(p0[a:b]), p0[a:b])[0] for a, b in itertools.pairwise(cut)]
    assert torch.equal(whole, torch.cat(pieces))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nccl_equals_simmesh_on_cuda(nccl, stage):
    """The same step over NCCL and simulated, bf16 compute with float32 master weights: bitwise."""
    model = tiny_gpt(8).cuda()
    batches = _on_cuda(lm_batches(model, 1, 2, 3, STEPS, 9))
    policy = fzero.get_policy("bf16")
    got = _core(stage, nccl, copy.deepcopy(model), batches, micro=2, precision=policy)
    want = _core(stage, fzero.SimMesh(1), copy.deepcopy(model), batches, micro=2, precision=policy)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_equals_core_on_cuda(nccl, stage, precision):
    """`fzero.initialize` + DeepSpeed's loop on the GPU over NCCL: bitwise the functional step (the engine adds no
    arithmetic), with clipping, accumulation and, for fp16, dynamic loss scaling."""
    kind = "mlp" if precision == "fp16" else "gpt"
    r = engine_worker.compare_with_train_step(stage, precision, 2, kind, mesh=nccl, device="cuda")
    assert r["differ"] == {} and r["global_steps"] == 3, r


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_overlap_on_cuda(nccl, stage):
    """`overlap_comm` on the GPU: the reductions and gathers run beside the compute, the result bitwise the
    functional step's."""
    zero = {"stage": stage, "overlap_comm": True}
    r = engine_worker.compare_with_train_step(stage, "bf16", 2, "gpt", mesh=nccl, device="cuda",
                                              config={"zero_optimization": zero})  # fmt: skip
    assert r["differ"] == {} and r["global_steps"] == 3, r


def _engine_run(stage: int, offload: bool, model, batches, **zero_keys):
    zero: dict = {"stage": stage, **zero_keys}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }
    engine, *_ = fzero.initialize(model=model, config=config)
    return _engine_continue(engine, batches)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_offload_from_cuda(nccl, stage):
    """ZeRO-Offload from the GPU: the float32 master weights and Adam's state in pinned host memory, updated by the
    C kernel, the bf16 compute copy on the GPU; within Adam's step bound of the same run updated on the GPU (the
    kernel's AdamW is a few ulp from torch's per step: tests/test_native.py)."""
    model = tiny_gpt(11).cuda()
    start = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    batches = _rank_batches(model, STEPS, 12)
    host = _engine_run(stage, True, copy.deepcopy(model), batches)
    gpu = _engine_run(stage, False, copy.deepcopy(model), batches)
    assert host.state.params.device.type == "cpu" and host.state.params.is_pinned()
    assert host.state.compute.is_cuda and gpu.state.params.is_cuda
    got = {k: v.cpu() for k, v in host.module_state_dict().items()}
    want = {k: v.cpu() for k, v in gpu.module_state_dict().items()}
    assert_adam_close(got, want, start, LR, STEPS)


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_checkpoint_on_cuda(nccl, stage, tmp_path):
    """Save after two steps, load into a fresh engine on the GPU, take a third: bitwise the uninterrupted run."""
    model = tiny_gpt(13).cuda()
    batches = _rank_batches(model, 3, 14)
    whole = _engine_run(stage, False, copy.deepcopy(model), batches)
    first = _engine_run(stage, False, copy.deepcopy(model), batches[:2])
    first.save_checkpoint(str(tmp_path), tag="two")
    resumed = _engine_run(stage, False, copy.deepcopy(model), [])
    resumed.load_checkpoint(str(tmp_path), tag="two")
    assert resumed.state.params.is_cuda
    resumed = _engine_continue(resumed, batches[2:])
    want, got = whole.module_state_dict(), resumed.module_state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_background_save_of_a_cuda_state(nccl, tmp_path):
    """`save(blocking=False)` of a state on the GPU (pinned staging, non-blocking copies) while donated steps
    overwrite it: the files hold the state at the call."""
    model = tiny_gpt(15).cuda()
    tx = fzero.zero3(fzero.adamw(LR))
    step = fzero.train_step(model, lm_loss(model), tx, nccl, donate=True)
    batches = _rank_batches(model, 4, 16)
    state = fzero.init(model, tx, nccl)
    state, _ = step(state, batches[0])
    at_call = _on_host(fzero.state_dict(state, nccl))
    handle = fzero.save(state, tmp_path, mesh=nccl, blocking=False)
    for batch in batches[1:]:
        state, _ = step(state, batch)
    handle.wait(timeout=120)
    loaded, _ = fzero.load(tmp_path, fzero.init(model, tx, nccl), nccl)
    assert loaded.params.is_cuda
    got = _on_host(fzero.state_dict(loaded, nccl))
    assert [k for k in at_call if not torch.equal(got[k], at_call[k])] == []


def _engine_continue(engine, batches):
    for batch in batches:
        logits = engine(batch["x"])
        engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten()))
        engine.step()
    return engine


def test_train_command_wants_a_gpu_per_process(capsys):
    """`fzero train --nproc N` on fewer GPUs: a usage error naming both counts and the way to the CPU."""
    from fzero import cli

    gpus = torch.cuda.device_count()
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--nproc", str(gpus + 1), "--steps", "1"])
    assert info.value.code == 2
    assert f"--nproc {gpus + 1}: CUDA sees {gpus} GPU(s)" in capsys.readouterr().err


def _on_host(tensors: dict) -> dict:
    return {k: v.cpu() for k, v in tensors.items()}


def _stage3(mesh, model, batches, optimizer, offload):
    """Stage 3, bf16 compute, one step per batch of this rank's: the last state and each step's metrics."""
    tx = fzero.zero3(optimizer, precision="bf16", offload=offload)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    metrics = []
    for batch in batches:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


@pytest.mark.parametrize("optimizer", [None, "cpu", "nvme"])
def test_offload_param_nvme_on_cuda_equals_memory(nccl, tmp_path, optimizer):
    """Stage 3 with this rank's compute shard in swap files (`Offload(optimizer, params="nvme")`) over NCCL: each
    unit is read into host memory, copied to the GPU and gathered there; bitwise the same run with the shard in
    memory on the GPU. The reference's update is the same arithmetic: torch's ops on the GPU for a master with the
    gradients (`None`: no offload), the C kernel on the host for a master in host memory or on disk
    (`offload="cpu"`: the kernel is elementwise, so the NVMe tier's chunks change nothing)."""
    model = tiny_gpt(17).cuda()
    batches = _rank_batches(model, STEPS, 18)

    def opt():
        return fzero.adamw(LR, weight_decay=0.1) if optimizer is None else fzero.cpu_adamw(LR, weight_decay=0.1)

    want, want_metrics = _stage3(nccl, copy.deepcopy(model), batches, opt(), None if optimizer is None else "cpu")
    offload = fzero.Offload(optimizer, params="nvme", path=str(tmp_path), chunk=4096)
    got, metrics = _stage3(nccl, copy.deepcopy(model), batches, opt(), offload)
    assert type(got.compute).__name__ == "Offloaded" and want.compute.is_cuda
    assert all(m["io"]["nvme"]["read"] > 0 for m in metrics)  # every step's units came from the files
    assert [float(m["loss"]) for m in metrics] == [float(m["loss"]) for m in want_metrics]
    assert torch.equal(in_memory(got.compute), want.compute.cpu())  # the copy on disk: the in-memory one's bytes
    assert differing(_on_host(fzero.state_dict(want, nccl)), _on_host(fzero.state_dict(got, nccl))) == []


@pytest.mark.parametrize("offload", [False, True])
def test_engine_offload_param_nvme_on_cuda(nccl, tmp_path, offload):
    """`offload_param: {"device": "nvme"}` from a DeepSpeed config on the GPU (no longer refused), the optimizer on
    the GPU or (`offload_optimizer: cpu`) on the host: bitwise the same engine with the compute shard in memory,
    through training and an evaluation forward (under `no_grad`: the units read, copied to the GPU, freed)."""
    model = tiny_gpt(19).cuda()
    batches = _rank_batches(model, STEPS, 20)
    want = _engine_run(3, offload, copy.deepcopy(model), batches)
    param = {"device": "nvme", "nvme_path": str(tmp_path)}
    got = _engine_run(3, offload, copy.deepcopy(model), batches, offload_param=param)
    assert type(got.state.compute).__name__ == "Offloaded" and want.state.compute.is_cuda
    assert torch.equal(in_memory(got.state.compute), want.state.compute.cpu())
    assert differing(_on_host(want.module_state_dict()), _on_host(got.module_state_dict())) == []
    with torch.no_grad():
        out, want_out = got(batches[0]["x"]), want(batches[0]["x"])
    assert out.is_cuda and torch.equal(out, want_out)

"""`cpu_adamw` / `cpu_adam` as fzero optimizers, the fused gradient factor and copy-out in `shard_update`, and
optimizer offload (`shard_update(..., offload="cpu")`).

What is bitwise and why:
- offload vs no offload, any stage, pure or donated, any piece size: on a CPU-only machine the transfers are
  no-ops and the kernel is elementwise, so the same operations meet the same values;
- the fused factor vs multiplying first: the kernel's `g * grad_scale` is the same float32 product torch's
  `grads * factor` computes (one rounding of the same operands); upcasting bf16 gradients is exact;
- the fused copy-out vs `gather(dtype)`'s cast: both round the same float32 parameters to nearest even;
- stage equivalence with `cpu_adamw`: the elementwise argument of docs/equivalence.md holds for the kernel too.
Against `fzero.adamw` (torch's op order) the kernel differs by rounding only: the per-step bound is proven in
tests/test_native.py; through a model, tolerances below are stated where used.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.optim import AdamState, Optimizer
from fzero.transforms import accumulate, chain, clip_by_global_norm, gather, reduce_scatter, scale_loss, shard_update
from tests.bounds import adam_drift, assert_adam_close, max_diff
from tests.support import mlp, regression_batches, regression_loss, tiny_gpt


def train(tx, model, world, micro=1, steps=3, donate=False, cast=None, seed=0):
    mesh = fzero.SimMesh(world=world)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh, donate=donate)
    metrics = []
    for batch in regression_batches(model, world, micro, 4, steps, seed):
        if cast is not None:
            batch = {k: v.to(cast) for k, v in batch.items()}
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def zero_chain(opt, stage, *, micro=1, offload=None, compute_dtype=None, chunk=1 << 22, scale=None, clip=None,
               reduce_dtype=None):  # fmt: skip
    """The presets' chains, with shard_update's new keywords exposed."""
    acc = accumulate(micro)
    reduce = [acc, fzero.all_reduce(reduce_dtype)] if stage == 0 else (
        [acc, reduce_scatter(reduce_dtype)] if stage == 1 else [reduce_scatter(reduce_dtype), acc])  # fmt: skip
    return chain(
        *reduce,
        scale_loss(scale if scale is not None else "none"),
        clip_by_global_norm(clip) if clip else fzero.identity(),
        shard_update(opt, torch.float32, offload=offload, compute_dtype=compute_dtype, chunk=chunk),
        gather(compute_dtype, lazy=stage == 3),
    )


def assert_states_equal(a, b):
    assert torch.equal(a.params, b.params)
    assert (a.compute is None) == (b.compute is None)
    if a.compute is not None:
        assert a.compute.dtype == b.compute.dtype and torch.equal(a.compute, b.compute)
    for x, y in zip(optree.tree_leaves(a.tx_state), optree.tree_leaves(b.tx_state), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_cpu_adamw_is_an_optimizer_with_adams_state():
    opt = fzero.cpu_adamw(0.1)
    assert isinstance(opt, Optimizer) and {"grad_scale", "grad_dtype", "out"} <= opt.features
    assert fzero.adamw(0.1).features == frozenset()
    p = torch.randn(10)
    state = opt.init(p)
    assert isinstance(state, AdamState) and int(state.count) == 0
    g = torch.randn(10)
    before = (p.clone(), state.exp_avg.clone(), state.exp_avg_sq.clone())
    new_p, new_state = opt.update(g, state, p)  # pure: nothing it was given changes
    assert all(torch.equal(x, y) for x, y in zip(before, (p, state.exp_avg, state.exp_avg_sq), strict=True))
    assert int(new_state.count) == 1 and not torch.equal(new_p, p)
    donated_p, donated = opt.update(g, state, p, donate=True)  # in place, the same numbers
    assert donated_p is p and donated.exp_avg is state.exp_avg
    assert torch.equal(donated_p, new_p) and torch.equal(donated.exp_avg_sq, new_state.exp_avg_sq)


@given(seed=st.integers(0, 99), steps=st.integers(1, 5), decoupled=st.booleans(), bias_correction=st.booleans())
def test_cpu_adam_applies_its_schedule_and_step_count(seed, steps, decoupled, bias_correction):
    """Each update is `native.adam_step` at the applied-update count, with the schedules' values (bitwise)."""
    schedule = lambda n: 0.1 / (1 + n)  # noqa: E731
    beta1 = lambda n: 0.8 + 0.01 * n  # noqa: E731
    make = fzero.cpu_adamw if decoupled else fzero.cpu_adam
    opt = make(schedule, betas=(beta1, 0.99), weight_decay=0.05, bias_correction=bias_correction)
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(37, generator=gen)
    state = opt.init(p)
    m, v, ref = torch.zeros(37), torch.zeros(37), p.clone()
    for t in range(steps):
        g = torch.randn(37, generator=gen)
        p, state = opt.update(g, state, p)
        fzero.native.adam_step(ref, g, m, v, step=t + 1, lr=schedule(t), betas=(beta1(t), 0.99), eps=1e-8,
                               weight_decay=0.05, decoupled=decoupled, bias_correction=bias_correction)  # fmt: skip
        assert torch.equal(p, ref) and torch.equal(state.exp_avg, m) and int(state.count) == t + 1


def test_cpu_adam_errors():
    with pytest.raises(ValueError, match="invalid learning rate: -1"):
        fzero.cpu_adamw(-1.0)
    with pytest.raises(ValueError, match="cpu_adamw keeps float32 master weights .* dtype torch.float64"):
        fzero.cpu_adamw().init(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"offload='nvme' needs a directory for its swap files: offload=fzero.Offload\('nvme', path=...\)",
    ):
        shard_update(fzero.cpu_adamw(), offload="nvme")
    with pytest.raises(ValueError, match="offload must be None, 'cpu' or an fzero.Offload, got 'disk'"):
        shard_update(fzero.cpu_adamw(), offload="disk")
    with pytest.raises(TypeError, match="compute_dtype must be a floating torch.dtype"):
        shard_update(fzero.cpu_adamw(), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="chunk must be a positive number"):
        shard_update(fzero.cpu_adamw(), chunk=0)


@given(stage=st.sampled_from([0, 1, 2, 3]), world=st.integers(1, 3), micro=st.integers(1, 2),
       donate=st.booleans(), chunk=st.sampled_from([1, 7, 1 << 22]), low=st.booleans(),
       make=st.sampled_from([fzero.cpu_adamw, fzero.adamw]))  # fmt: skip
def test_offload_equals_no_offload_bitwise(stage, world, micro, donate, chunk, low, make):
    """The offloaded path (pieces, host buffers, compute copy handed to gather) gives the very same state, with
    the native kernel or a torch-op optimizer."""
    model = mlp([5, 9, 3], 1)
    cdt = torch.bfloat16 if low else None
    kw = {"micro": micro, "compute_dtype": cdt, "scale": 64.0, "clip": 0.3}
    want, _ = train(zero_chain(make(1e-2), stage, **kw), model, world, micro, donate=donate, cast=cdt)
    tx = zero_chain(make(1e-2), stage, offload="cpu", chunk=chunk, **kw)
    got, _ = train(tx, model, world, micro, donate=donate, cast=cdt)
    assert_states_equal(want, got)
    assert got.params.device.type == "cpu" and not got.params.is_pinned()  # pinned only with an accelerator


@given(stage=st.sampled_from([0, 2, 3]), world=st.integers(1, 3), reduce_bf16=st.booleans(),
       donate=st.booleans())  # fmt: skip
def test_fused_factor_and_copy_out_equal_the_separate_passes(stage, world, reduce_bf16, donate):
    """cpu_adamw taking the loss-scale/clip factor, bf16 gradients and the bf16 copy-out into its one pass equals
    the same optimizer stripped of its features (shard_update then casts and multiplies, gather casts)."""
    model = mlp([6, 8, 4], 2)
    kw = {"scale": 1024.0, "clip": 0.05, "reduce_dtype": torch.bfloat16 if reduce_bf16 else None,
          "compute_dtype": torch.bfloat16}  # fmt: skip
    fused = fzero.cpu_adamw(3e-2, weight_decay=0.1)
    plain = Optimizer(fused.init, fused.update)  # no features: every pass done separately, as for fzero.adamw
    want, wm = train(zero_chain(plain, stage, **kw), model, world, cast=torch.bfloat16, donate=donate)
    got, gm = train(zero_chain(fused, stage, **kw), model, world, cast=torch.bfloat16, donate=donate)
    assert [m["grad_norm"] for m in wm] == [m["grad_norm"] for m in gm]
    assert_states_equal(want, got)
    assert got.compute.dtype == torch.bfloat16


@given(world=st.integers(1, 3), micro=st.integers(1, 2), seed=st.integers(0, 50))
def test_stage_equivalence_holds_with_cpu_adamw(world, micro, seed):
    """docs/equivalence.md's bitwise rows, with the native kernel as the optimizer."""
    model = mlp([4, 7, 3], seed)
    states = {}
    for stage in range(4):
        tx = getattr(fzero, f"zero{stage}")(fzero.cpu_adamw(1e-2), accumulate=micro)
        states[stage], _ = train(tx, model, world, micro, seed=seed)
    full = {s: fzero.state_dict(states[s]) for s in states}
    for a, b in ((0, 1), (2, 3)) + (((1, 2),) if micro == 1 else ()):
        for k in full[a]:
            assert torch.equal(full[a][k], full[b][k]), (a, b, k)


def test_cpu_adamw_tracks_adamw_through_training():
    """The kernel's fused multiply-adds differ from torch's op order by a few float32 roundings per step (bound
    in tests/test_native.py). Through a model no tighter per-element bound exists: where a gradient is near zero,
    Adam's `m / (sqrt(v) + eps)` turns a rounding into a visible step. So tests/bounds.py's kind 3: every element
    within Adam's step bound, the mean difference under the detection threshold. A wrong update moves parameters
    by about lr."""
    from tests.support import lm_batches, lm_loss

    model = tiny_gpt(0)
    results = []
    for opt in (fzero.adamw(1e-2), fzero.cpu_adamw(1e-2)):
        mesh = fzero.SimMesh(world=2)
        tx = fzero.zero2(opt)
        state = fzero.init(model, tx, mesh)
        start = state.params.clone()
        step = fzero.train_step(model, lm_loss(model), tx, mesh)
        for batch in lm_batches(model, 2, 1, 2, 5, 3):
            state, _ = step(state, batch)
        results.append(state.params)
    assert_adam_close({"p": results[1]}, {"p": results[0]}, {"p": start}, 1e-2, 5)


def dist_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    model = mlp([5, 9, 3], 1)
    tx = zero_chain(fzero.cpu_adamw(1e-2), 2, offload="cpu", compute_dtype=torch.bfloat16, chunk=5, clip=0.3)
    mesh = fzero.DistMesh()
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh, donate=True)
    for batch in regression_batches(model, world, 1, 4, 3, 0):
        state, _ = step(state, {k: v[rank].to(torch.bfloat16) for k, v in batch.items()})
    torch.save({"params": state.params, "compute": state.compute}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_offload_over_gloo_matches_sim(tmp_path):
    """Two real processes: each rank's offloaded shard and the all-gathered bf16 compute copy equal SimMesh's."""
    mp.start_processes(dist_worker, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul's reduction order may depend on the thread count
    try:
        tx = zero_chain(fzero.cpu_adamw(1e-2), 2, offload="cpu", compute_dtype=torch.bfloat16, chunk=5, clip=0.3)
        want, _ = train(tx, mlp([5, 9, 3], 1), 2, donate=True, cast=torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["params"], want.params[rank]) and torch.equal(got["compute"], want.compute[rank])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned host memory, real copies)")
def test_offload_from_cuda_keeps_state_on_the_host():
    model = mlp([5, 9, 3], 1)
    tx = zero_chain(fzero.cpu_adamw(1e-2), 2, offload="cpu", compute_dtype=torch.bfloat16, chunk=7)
    want, _ = train(tx, model, 1, donate=True, cast=torch.bfloat16)
    mesh = fzero.SimMesh(world=1)
    cuda_model = mlp([5, 9, 3], 1).cuda()
    state = fzero.init(cuda_model, tx, mesh)
    assert state.params.device.type == "cpu" and state.params.is_pinned() and state.compute.is_cuda
    step = fzero.train_step(cuda_model, regression_loss(cuda_model), tx, mesh, donate=True)
    for batch in regression_batches(model, 1, 1, 4, 3, 0):
        state, _ = step(state, {k: v.cuda().to(torch.bfloat16) for k, v in batch.items()})
    assert state.compute.is_cuda and state.tx_state is not None
    # the same host arithmetic; the gradients come from CUDA matmuls, so only close, not bitwise (bf16 compute:
    # tests/bounds.py's per-element bound)
    assert max_diff({"p": state.params.cpu()}, {"p": want.params}) <= adam_drift(
        1e-2, 3, scale=want.params.abs().max().item()
    )

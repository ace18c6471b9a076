"""`fzero.lamb`: DeepSpeed's FusedLamb arithmetic with each parameter tensor's trust ratio, at every stage.

The reference is a float64 transcription of DeepSpeed's kernel (`csrc/lamb/fused_lamb_cuda_kernel.cu`, parts 1-3)
on each whole tensor. fzero computes the same elementwise operations; its norms are sums of per-rank pieces (one
dot product per piece, added in rank order), so the two differ only by the order of the norms' additions.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.checkpoint import named_leaves, reshard
from fzero.layout import make_layout
from fzero.optim.groups import segments as make_segments
from fzero.optim.tensors import tensors_of
from tests.bounds import U64, adam_drift, assert_within, tracks
from tests.support import differing, mlp, reference_run, regression_batches, regression_loss
from tests.test_checkpoint import assert_same


def transcription(w, m, v, g, t, h):
    """One FusedLamb step of one tensor, float64, in the kernel's operations; returns `(w, m, v)`."""
    b1, b2 = h["betas"]
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    d = torch.sqrt(v + h["eps"]) if h["eps_inside_sqrt"] else torch.sqrt(v) + h["eps"]
    u = m / d + h["weight_decay"] * w
    step = h["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t) if h["bias_correction"] else h["lr"]
    wn, un = w.norm().item(), u.norm().item()
    c = min(max(wn / un, h["min_coeff"]), h["max_coeff"]) if wn != 0 and un != 0 else 1.0
    return w - (step * c) * u, m, v


hypers = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-3, 1e-2, 0.1]),
        "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.0, 0.99)]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "max_coeff": st.sampled_from([10.0, 0.3]),
        "min_coeff": st.sampled_from([0.01, 0.0]),
        "bias_correction": st.booleans(),
        "eps_inside_sqrt": st.booleans(),
    }
)


@settings(deadline=None)
@given(h=hypers, shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 6)), min_size=1, max_size=4),
       world=st.integers(1, 3), steps=st.integers(1, 3), seed=st.integers(0, 99), grouped=st.booleans())  # fmt: skip
def test_lamb_is_the_kernel_per_tensor(h, shapes, world, steps, seed, grouped):
    """Every rank's shard updated with its pieces' norms summed over the ranks equals the transcription on each
    whole tensor, within the float64 bound of the norms' other order of additions: each norm is a sum of at most
    `n` squares (`n` the tensor's size), within `gamma_n` relative of the exact sum in either order (Higham 4.2),
    so the ratio `c` moves by at most `2 gamma_n c` relative, and the step `s c u` by `2 gamma_n s c |u|`; 16 more
    roundings of every element's operations cost `16 u |w|`; over `steps` steps (a step's error in `w` moves the
    next norm of `w` by the same relative amount)."""
    names = [f"t{i}" for i in range(len(shapes))]
    layout = make_layout([(n, s, torch.float64) for n, s in zip(names, shapes, strict=True)], world=world, align=1)
    options = {k: h[k] for k in ("bias_correction", "eps_inside_sqrt")}
    rest = {k: v for k, v in h.items() if k not in options}
    groups = fzero.param_groups({"t0": {"lr": rest["lr"] / 2}}) if grouped else None
    opt = fzero.lamb(**rest, **options, groups=groups)
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in zip(names, shapes, strict=True)}
    flat = torch.zeros(layout.numel, dtype=torch.float64)
    for leaf in layout.leaves:
        flat[leaf.offset : leaf.offset + leaf.numel] = full[leaf.name].reshape(-1)
    shards = flat.view(world, -1) if world > 1 else flat.view(1, -1)  # one unit: rank r's shard is chunk r
    tensors = tensors_of(layout, full=world == 1, ranks=range(world), total=_sum_rows)
    segs = None
    if grouped:
        resolved = groups.resolve(names, set(opt.defaults))
        segs = make_segments(layout, resolved, full=world == 1, ranks=range(world))
    state = opt.init(shards)
    ref = {n: (full[n].clone(), torch.zeros_like(full[n]), torch.zeros_like(full[n])) for n in names}
    for t in range(1, steps + 1):
        gflat = torch.zeros(layout.numel, dtype=torch.float64)
        for leaf in layout.leaves:
            grad = torch.randn(leaf.shape, generator=g, dtype=torch.float64)
            gflat[leaf.offset : leaf.offset + leaf.numel] = grad.reshape(-1)
            hl = {**h, "lr": rest["lr"] / 2} if grouped and leaf.name == "t0" else h
            ref[leaf.name] = transcription(*ref[leaf.name], grad, t, hl)
        shards, state = opt.update(gflat.view_as(shards), state, shards, segments=segs, tensors=tensors)
    got = shards.reshape(-1)
    for leaf in layout.leaves:
        w = got[leaf.offset : leaf.offset + leaf.numel]
        want = ref[leaf.name][0].reshape(-1)
        n = leaf.numel
        gamma = n * U64 / (1 - n * U64)
        moved = (want - full[leaf.name].reshape(-1)).abs().max().item()
        bound = steps * (2 * gamma * moved + 16 * U64 * max(want.abs().max().item(), 1.0)) * 2
        assert (w - want).abs().max().item() <= bound, leaf.name
    assert got[layout.real_numel :].eq(0).all() or world == 1  # padding stays zero


def _sum_rows(partial):
    out = partial[0]
    for r in range(1, partial.shape[0]):
        out = out + partial[r]
    return out.expand_as(partial)


def run(preset, world, micro, batches, model, opt, **kw):
    tx = getattr(fzero, preset)(opt, accumulate=micro, **kw)
    mesh = fzero.SimMesh(world)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    for batch in batches:
        state, metrics = step(state, batch)
    return state, metrics


@settings(deadline=None, max_examples=10)
@given(world=st.integers(2, 3), micro=st.integers(1, 2), seed=st.integers(0, 9), grouped=st.booleans())
def test_stages_agree_and_track_full_batch_lamb(world, micro, seed, grouped):
    """Stages 1-3 give bitwise the same parameters (the same shards, the same pieces' sums in the same order);
    stage 0 (whole tensors on every rank) within the float32 step bound; and a plain full-batch run of the
    transcription (float32, whole tensors) within Lamb's own step bound: each step moves an element by at most
    `s c |u| <= max_coeff lr r_t` (without weight decay, with the bias correction: `s |m / d| <= lr r_t` as Adam's,
    tests/bounds.py), so two runs differ by at most twice the sum, `adam_drift(max_coeff lr, ...)`; plus the
    detection threshold on the mean difference."""
    model = mlp([6, 5, 3], seed)
    groups = fzero.param_groups({"*.bias": {"lr": 5e-3}}) if grouped else None
    opt = fzero.lamb(1e-2, max_coeff=2.0, groups=groups)
    batches = regression_batches(model, world, micro, 2, 3, seed)
    states = {p: fzero.state_dict(run(p, world, micro, batches, model, opt)[0]) for p in ("zero0", "zero1", "zero2",
                                                                                            "zero3")}  # fmt: skip
    assert differing(states["zero2"], states["zero3"]) == []
    if micro == 1:
        assert differing(states["zero1"], states["zero2"]) == []

    class TorchLamb(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-2})

        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                st_ = self.state.setdefault(p, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                st_["t"] += 1
                lr = 5e-3 if grouped and p.ndim == 1 else 1e-2
                h = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 2.0,
                     "min_coeff": 0.01, "bias_correction": True, "eps_inside_sqrt": False}  # fmt: skip
                w, st_["m"], st_["v"] = transcription(p.clone(), st_["m"], st_["v"], p.grad, st_["t"], h)
                p.copy_(w)

    ref = reference_run(model, regression_loss, batches, micro, TorchLamb)
    start = model.state_dict()
    for got in states.values():
        scale = max(v.abs().max().item() for v in ref.values())
        check = {"max": max((got[k] - ref[k]).abs().max().item() for k in ref),
                 "bound": adam_drift(2.0 * 1e-2, 3, scale=scale), "tracks": tracks(got, ref, start)}  # fmt: skip
        assert_within(check)


def test_the_norms_cost_one_small_all_gather():
    """Per step, Lamb adds one all-gather of two float64 per parameter tensor (the pieces' sums of `w^2` and `u^2`,
    in the ledger) at stages 1-3, and nothing at stage 0."""
    model = mlp([6, 5, 3], 0)
    batches = regression_batches(model, 2, 1, 2, 1, 0)
    _, lamb3 = run("zero3", 2, 1, batches, model, fzero.lamb(1e-2))
    _, adam3 = run("zero3", 2, 1, batches, model, fzero.adamw(1e-2))
    lamb_ag, adam_ag = lamb3["comm"]["all_gather"], adam3["comm"]["all_gather"]
    assert lamb_ag["calls"] - adam_ag["calls"] == 1
    assert lamb_ag["elements"] - adam_ag["elements"] == 4 * 2 * 2  # 4 tensors, 2 sums each, from 2 ranks
    _, lamb0 = run("zero0", 2, 1, batches, model, fzero.lamb(1e-2))
    _, adam0 = run("zero0", 2, 1, batches, model, fzero.adamw(1e-2))
    assert lamb0["comm"] == adam0["comm"]


def test_offload_and_resharding():
    """Under offload (the whole shard in one piece: its norms need whole tensors) Lamb is the same torch
    operations, bitwise; a state saved at world 2 and resharded to world 3 continues like the same state
    resharded in memory."""
    model = mlp([6, 5, 3], 1)
    batches = regression_batches(model, 2, 1, 2, 2, 1)
    opt = fzero.lamb(1e-2, weight_decay=0.01)
    plain, _ = run("zero2", 2, 1, batches, model, opt)
    off, _ = run("zero2", 2, 1, batches, model, opt, offload="cpu")
    assert differing(fzero.state_dict(off), fzero.state_dict(plain)) == []
    like3 = fzero.init(model, fzero.zero2(opt), fzero.SimMesh(3))
    moved = reshard(plain, like3)
    assert_same(named_leaves(moved), named_leaves(plain))


def test_bad_lamb_hyper_parameters():
    with pytest.raises(ValueError, match="min_coeff 1.0 exceeds max_coeff 0.5"):
        fzero.lamb(max_coeff=0.5, min_coeff=1.0)
    with pytest.raises(ValueError, match="invalid max_coeff: -1"):
        fzero.lamb(max_coeff=-1.0)

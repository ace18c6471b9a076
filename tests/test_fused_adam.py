"""`adam(w)(fused=True)` off the CPU: torch's fused kernel (`fzero.optim.fused_adam`), bitwise
`torch.optim.AdamW(fused=True)` on tensors of the same lengths.

A GPU update runs the same Python as these tests, on the CPU build of the same kernel; tests/test_cuda.py runs it on a
GPU. On the CPU the kernel rounds each tensor's tail on a scalar path, so the references here hold tensors of the
lengths the update hands the kernel (the whole buffer; a group's segments)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero.optim.fused_adam import on_device, torch_fused_adam, with_fused_keywords
from fzero.optim.groups import Segments
from tests.test_optim import hyper


def _kw(h):
    return {"lr": h["lr"], "betas": (h["b1"], h["b2"]), "eps": h["eps"], "weight_decay": h["wd"]}


@given(h=hyper, n=st.integers(0, 70), steps=st.integers(1, 5), seed=st.integers(0, 99),
       dtype=st.sampled_from([torch.float32, torch.float64]), decoupled=st.booleans(),
       donate=st.booleans())  # fmt: skip
def test_torch_fused_is_torch_fused_adamw_bitwise(h, n, steps, seed, dtype, decoupled, donate):
    kw = _kw(h)
    ours = torch_fused_adam(kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], decoupled)
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g, dtype=dtype)
    ref = p0.clone().requires_grad_()
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], **kw, fused=True)
    p, state = p0.clone(), ours.init(p0)
    for t in range(steps):
        grad = torch.randn(n, generator=g, dtype=dtype)
        ref.grad = grad.clone()
        opt.step()
        before = (p.clone(), state.exp_avg.clone())
        new, state = ours.update(grad, state, p, donate=donate)
        assert torch.equal(new, ref.detach()), f"step {t + 1}"
        assert (new is p) == donate and (donate or torch.equal(p, before[0])), "donation, or purity"
        p = new
    assert int(state.count) == steps
    assert torch.equal(state.exp_avg, opt.state[ref]["exp_avg"])
    assert torch.equal(state.exp_avg_sq, opt.state[ref]["exp_avg_sq"])


@given(h=hyper, lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 99),
       data=st.data())  # fmt: skip
def test_groups_are_torch_param_groups_bitwise(h, lengths, seed, data):
    """Each group's segments are one kernel call with the group's hyper-parameters: torch's param groups with one
    tensor per segment."""
    group = data.draw(st.lists(st.integers(0, 2), min_size=len(lengths), max_size=len(lengths)))
    overrides = ({}, {"lr": h["lr"] * 3, "weight_decay": 0.0}, {"betas": (0.5, 0.9), "eps": 1e-4})
    ends = tuple(sum(lengths[: i + 1]) for i in range(len(lengths)))
    segments = Segments(ends, tuple(group), overrides)
    kw = _kw(h)
    ours = torch_fused_adam(kw["lr"], kw["betas"], kw["eps"], kw["weight_decay"], True)
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(ends[-1], generator=g)
    refs = [x.clone().requires_grad_() for x in p0.split(lengths)]
    groups = [{"params": [r for r, k in zip(refs, group, strict=True) if k == i], **overrides[i]} for i in range(3)]
    opt = torch.optim.AdamW([x for x in groups if x["params"]], **kw, fused=True)
    p, state = p0.clone(), ours.init(p0)
    for t in range(3):
        grad = torch.randn(ends[-1], generator=g)
        for r, gr in zip(refs, grad.split(lengths), strict=True):
            r.grad = gr.clone()
        opt.step()
        p, state = ours.update(grad, state, p, segments=segments)
        assert torch.equal(p, torch.cat([r.detach() for r in refs])), f"step {t + 1}"


@given(n=st.integers(0, 50), scale=st.sampled_from([1.0, 0.25, 1 / 3]), seed=st.integers(0, 99),
       low=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))  # fmt: skip
def test_fused_keywords_are_shard_updates_passes(n, scale, seed, low):
    """The native kernel's keywords around torch's kernel: the same values `shard_update` gives an optimizer
    without them (its cast, its multiply, the compute copy rounded from the new parameters)."""
    inner = torch_fused_adam(1e-2, (0.9, 0.999), 1e-8, 0.01, True)
    ours = with_fused_keywords(inner)
    assert ours.features == fzero.cpu_adamw().features
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    grads = torch.randn(n, generator=g).to(low)
    out = torch.empty(n, dtype=torch.bfloat16)
    got, s1 = ours.update(grads, ours.init(p0), p0, grad_scale=scale, out=out)
    prepared = grads.to(torch.float32)
    want, s2 = inner.update(prepared * scale if scale != 1.0 else prepared, inner.init(p0), p0)
    assert torch.equal(got, want) and torch.equal(s1.exp_avg_sq, s2.exp_avg_sq)
    assert torch.equal(out, want.to(torch.bfloat16))


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_on_the_cpu_is_the_native_kernel(decoupled):
    """`fused=True` with master weights on the CPU runs `cpu_adam(w)` (the same values, bitwise), keywords
    included; `on_device` sends other devices to the other optimizer."""
    make = fzero.adamw if decoupled else fzero.adam
    native = fzero.cpu_adamw if decoupled else fzero.cpu_adam
    g = torch.Generator().manual_seed(3)
    p0, grads = torch.randn(1000, generator=g), torch.randn(1000, generator=g).bfloat16()
    outs = [torch.empty(1000, dtype=torch.bfloat16) for _ in range(2)]
    results = []
    for opt, out in zip((make(1e-2, fused=True), native(1e-2)), outs, strict=True):
        results.append(opt.update(grads, opt.init(p0), p0, grad_scale=0.5, out=out)[0])
    assert torch.equal(*results) and torch.equal(*outs)
    calls = []

    def recording(name):
        def update(grads, state, params, **kw):
            calls.append(name)
            return params, state

        return fzero.optim.Optimizer(lambda p: None, update)

    host = recording("host")
    both = on_device(host, recording("device"))
    both.update(p0, None, p0)
    both.update(p0.to("meta"), None, p0.to("meta"))
    assert calls == ["host", "device"]
    assert both.update.choose(p0) is host
    assert both.update.choose(p0.to("meta")).features == fzero.cpu_adamw().features  # it takes the keywords


def test_without_bias_correction_a_gpu_runs_torch_ops():
    """torch's kernel always corrects the bias: DeepSpeed's `bias_correction: false` runs `adamw()`'s operations
    off the CPU (bitwise them), not the kernel."""
    ours = fzero.adamw(1e-2, bias_correction=False, fused=True).update.choose(torch.empty(0, device="meta"))
    ops = fzero.adamw(1e-2, bias_correction=False)
    g = torch.Generator().manual_seed(4)
    p0, grads = torch.randn(64, generator=g), torch.randn(64, generator=g)
    assert torch.equal(ours.update(grads, ours.init(p0), p0)[0], ops.update(grads, ops.init(p0), p0)[0])

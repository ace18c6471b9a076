"""Per-parameter hyper-parameters (`fzero.param_groups`): random group assignments against `torch.optim.AdamW` /
`SGD` with the same param groups, at every stage, world size and accumulation, with the C kernel and offload; the
segment tables; resharding; the errors.

Tolerances are those of tests/test_stages.py (float64, derived there: `ATOL64`), and of tests/test_native.py for the
C kernel (float32: the kernel's fused multiply-adds differ from torch's rounding by a few ulp per step).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.checkpoint import named_leaves, reshard
from fzero.layout import make_layout
from fzero.optim.groups import segments
from tests.bounds import assert_adam_close, reorder_bound
from tests.support import lm_batches, lm_loss, mlp, regression_batches, regression_loss, tiny_gpt
from tests.test_checkpoint import assert_same
from tests.test_stages import ATOL64, PRESETS, equal, max_diff

KEYS = {"lr", "betas", "eps", "weight_decay"}
GROUP_VALUES = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.sampled_from([1e-3, 3e-3, 2e-2]),
        "weight_decay": st.sampled_from([0.0, 0.05, 0.3]),
        "betas": st.sampled_from([(0.8, 0.99), (0.95, 0.9)]),
    },
)


@st.composite
def assignments(draw, names):
    """Random explicit groups: each parameter in one of 2-3 groups with random hyper-parameters."""
    k = draw(st.integers(2, 3))
    values = [draw(GROUP_VALUES) for _ in range(k)]
    label = [draw(st.integers(0, k - 1)) for _ in names]
    return [([n for n, g in zip(names, label, strict=True) if g == i], values[i]) for i in range(k)]


def torch_groups(model, groups):
    """The same groups as torch param groups (tied parameters once, by their first name)."""
    by_name = dict(model.named_parameters())
    return [{"params": [by_name[n] for n in names], **values} for names, values in groups if names]


def reference(model, loss_of, batches, micro, groups, make):
    ref = copy.deepcopy(model)
    opt = make(torch_groups(ref, groups))
    loss_fn = loss_of(ref)
    for i in range(0, len(batches), micro):
        chunk = batches[i : i + micro]
        full = {k: torch.cat([b[k].flatten(0, 1) for b in chunk]) for k in chunk[0]}
        opt.zero_grad()
        loss_fn({**dict(ref.named_parameters()), **dict(ref.named_buffers())}, full).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def run(model, loss_of, batches, world, micro, preset, opt, **kw):
    mesh = fzero.SimMesh(world)
    tx = PRESETS[preset](opt, accumulate=micro, **kw)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_of(model), tx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    return state


@given(data=st.data(), world=st.integers(1, 4), micro=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_random_groups_match_torch_adamw(data, world, micro, seed):
    """Stages 0-3 with 2-3 random groups equal torch.optim.AdamW with the same groups: bitwise at world 1 with one
    micro-step (the same kernels on the same values), within the derived float64 tolerance elsewhere; and bitwise
    to each other where tests/test_stages.py says the arithmetic is the same."""
    model = mlp(data.draw(st.lists(st.integers(1, 6), min_size=3, max_size=4)), seed, torch.float64)
    groups = data.draw(assignments([n for n, _ in model.named_parameters()]))
    batches = regression_batches(model, world, micro, 2, 3, seed + 1)
    ref = reference(model, regression_loss, batches, micro, groups, lambda g: torch.optim.AdamW(g, lr=1e-2))
    opt = fzero.adamw(1e-2, groups=fzero.param_groups(groups=groups))
    out = {p: fzero.state_dict(run(model, regression_loss, batches, world, micro, p, opt)) for p in PRESETS}
    for name, got in out.items():
        assert max_diff(got, ref) <= ATOL64, name
    assert equal(out["zero0"], out["zero1"]) and equal(out["zero2"], out["zero3"])
    if micro == 1:
        assert equal(out["zero1"], out["zero2"])
    if world == 1 and micro == 1:
        assert equal(out["zero0"], ref)


@settings(max_examples=10)
@given(data=st.data(), world=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_random_groups_match_torch_sgd(data, world, seed):
    model = mlp([5, 4, 3], seed, torch.float64)
    names = [n for n, _ in model.named_parameters()]
    values = st.fixed_dictionaries({}, optional={"lr": st.sampled_from([1e-3, 5e-2]),
                                                 "momentum": st.sampled_from([0.0, 0.9]),
                                                 "weight_decay": st.sampled_from([0.0, 0.1])})  # fmt: skip
    k = data.draw(st.integers(2, 3))
    vals = [data.draw(values) for _ in range(k)]
    label = [data.draw(st.integers(0, k - 1)) for _ in names]
    groups = [([n for n, g in zip(names, label, strict=True) if g == i], vals[i]) for i in range(k)]
    batches = regression_batches(model, world, 1, 2, 3, seed + 1)
    ref = reference(model, regression_loss, batches, 1, groups, lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.5))
    opt = fzero.sgd(1e-2, momentum=0.5, groups=fzero.param_groups(groups=groups))
    for preset in ("zero0", "zero3"):
        got = fzero.state_dict(run(model, regression_loss, batches, world, 1, preset, opt))
        assert max_diff(got, ref) <= ATOL64
        if world == 1:
            assert equal(got, ref)


@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("preset", ["zero1", "zero3"])
def test_groups_on_the_c_kernel(preset, offload):
    """`cpu_adamw` with groups (and with offload, whose pipelined pieces slice the table) against torch's AdamW with
    the same groups: within the kernel's float32 bound of tests/test_native.py after 3 steps."""
    model = tiny_gpt(3)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rules = {"*.bias|*ln*": {"weight_decay": 0.0}, "head.*|wte.*": {"lr": 3e-3, "betas": (0.8, 0.99)}}
    groups = fzero.param_groups(rules)
    names = [n for n, _ in model.named_parameters()]
    resolved = groups.resolve(names, KEYS)
    explicit = [([n for n, g in zip(names, resolved.labels, strict=True) if g == i], dict(o))
                for i, o in enumerate(resolved.overrides)]  # fmt: skip
    batches = lm_batches(model, 2, 1, 2, 3, 4)
    ref = reference(model, lm_loss, batches, 1, explicit, lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1))
    opt = fzero.cpu_adamw(1e-2, weight_decay=0.1, groups=groups)
    got = fzero.state_dict(run(model, lm_loss, batches, 2, 1, preset, opt, offload=offload))
    # float32 against the full-batch reference: the rank-by-rank reduction and the kernel's fused multiply-adds each
    # move a few ulp per step, which Adam amplifies where v is small: tests/bounds.py's kind 3
    assert_adam_close(got, ref, start, 1e-2, 3, betas=(0.8, 0.99))


def test_groups_survive_resharding():
    """A state with groups saved at world 2 and loaded at world 3 continues bitwise like a world-3 run that was
    resharded in memory at the same point: groups come from names, never from the saved offsets; and like the same
    continuation at world 1 within the float64 reordering bound (the ranks' gradients summed in another order)."""
    model = tiny_gpt(5, torch.float64)
    groups = fzero.param_groups({"*.bias": {"weight_decay": 0.0, "lr": 3e-2}})
    opt = fzero.adamw(1e-2, weight_decay=0.1, groups=groups)
    tx = fzero.zero2(opt)
    b2 = lm_batches(model, 2, 1, 3, 2, 6)
    state = run(model, lm_loss, b2, 2, 1, "zero2", opt)
    like3 = fzero.init(model, tx, fzero.SimMesh(3))
    moved = reshard(state, like3)
    assert_same(named_leaves(moved), named_leaves(state))
    b3 = lm_batches(model, 3, 1, 2, 2, 7)
    step3 = fzero.train_step(model, lm_loss(model), tx, fzero.SimMesh(3))
    for batch in b3:
        moved, _ = step3(moved, batch)
    like1 = fzero.init(model, tx, fzero.SimMesh(1))
    one = reshard(state, like1)
    step1 = fzero.train_step(model, lm_loss(model), tx, fzero.SimMesh(1))
    for batch in b3:
        one, _ = step1(one, {k: v.flatten(0, 1).unsqueeze(0) for k, v in batch.items()})
    # each gradient element sums 3 ranks x 2 sequences x 8 tokens = 48 terms, in another order at world 1;
    # 2 steps at the groups' largest lr, 3e-2
    bound = reorder_bound(3e-2, 48, 2)
    assert max_diff(fzero.state_dict(moved), fzero.state_dict(one)) <= bound


def test_segment_tables():
    """Shards cut groups at rank boundaries; padding joins the run before it; adjacent runs of a group merge."""
    lay = make_layout([("a", (5,), torch.float32), ("b", (3,), torch.float32), ("c", (8,), torch.float32)],
                      world=2, align=4)  # fmt: skip
    groups = fzero.param_groups({"b": {"lr": 1.0}})
    resolved = groups.resolve(["a", "b", "c"], KEYS)
    full = segments(lay, resolved, full=True)
    assert full.ends == (8, 12, 24) and full.group == (0, 1, 0)  # a: 0-5 (+pad to 8), b: 8-11 (+pad), c: 12-20 (+pad)
    r0 = segments(lay, resolved, full=False, ranks=(0,))
    r1 = segments(lay, resolved, full=False, ranks=(1,))
    assert (r0.ends, r0.group) == ((8, 12), (0, 1))  # rank 0: elements 0-11
    assert (r1.ends, r1.group) == ((12,), (0,))  # rank 1: elements 12-23, all of c
    both = segments(lay, resolved, full=False, ranks=(0, 1))
    assert (both.ends, both.group) == ((8, 12, 24), (0, 1, 0))  # a SimMesh's [2, 12]: the ranks end to end
    assert full.slice(6, 14).ends == (2, 6, 8) and full.slice(6, 14).group == (0, 1, 0)


def test_errors_name_the_problem():
    model = tiny_gpt(0)
    mesh = fzero.SimMesh(2)

    def init(groups, opt=fzero.adamw):
        return fzero.init(model, fzero.zero2(opt(1e-2, groups=groups)), mesh)

    with pytest.raises(ValueError, match=r"rule 'head\.bais' matches no trainable parameter"):
        init(fzero.param_groups({"head.bais": {"lr": 1e-3}}))
    with pytest.raises(KeyError, match=r"sets 'wd': not a hyper-parameter of this optimizer"):
        init(fzero.param_groups({"*.bias": {"wd": 0.0}}))
    with pytest.raises(ValueError, match=r"'blocks.0.ln1.bias' matches rules '\*.bias' and 'blocks\.\*', which set lr"):
        init(fzero.param_groups({"*.bias": {"lr": 1e-3}, "blocks.*": {"lr": 2e-3}}))
    with pytest.raises(ValueError, match=r"'wpe.weight' is in parameter groups 0 and 1"):
        init(fzero.param_groups(groups=[(["wpe.weight"], {"lr": 1.0}), (["wpe.weight"], {"lr": 2.0})]))
    with pytest.raises(ValueError, match=r"'wte.weight' \(and \d+ more\) requires grad but is in no parameter group"):
        init(fzero.param_groups(groups=[(["wpe.weight"], {"lr": 1.0})], missing="error"))
    with pytest.raises(ValueError, match=r"parameter group \{'lr': -1.0\}: invalid learning rate: -1.0"):
        init(fzero.param_groups({"*.bias": {"lr": -1.0}}))
    with pytest.raises(TypeError, match="rules must be a dict"):
        fzero.param_groups(["*.bias"])

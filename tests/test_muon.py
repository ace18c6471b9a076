"""`fzero.muon`: DeepSpeed's MuonWithAuxAdam, each matrix orthogonalised whole by its owner rank at stages 1-3.

The reference transcribes DeepSpeed's `muon_update` and `adam_update` (runtime/zero/muon/original_muon.py) and its
optimizer step on each whole parameter tensor. fzero performs the same operations on every element, and the owner
assembles each matrix exactly from the ranks' pieces, so the two agree bitwise at every stage and world size.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.layout import make_layout
from fzero.optim.muon import deepspeed_use_muon, newton_schulz
from fzero.optim.tensors import owners, tensors_of
from tests.support import differing, mlp, regression_batches, regression_loss


def ds_standard(g, steps=5):
    """DeepSpeed's `zeropower_via_newtonschulz5`, float32 (its compute dtype where bf16 is unsupported)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.float()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        aa = x @ x.mT
        bb = b * aa + c * aa @ aa
        x = a * x + bb @ x
    return x.mT if g.size(-2) > g.size(-1) else x


def reference_step(params, grads, state, t, h):
    """One MuonWithAuxAdam step on whole tensors (DeepSpeed's operations), in place."""
    for name, p in params.items():
        g = grads[name].clone()
        m, v = state[name]
        if deepspeed_use_muon(name, tuple(p.shape)):
            m.lerp_(g, 1 - h["momentum"])
            u = g.lerp_(m, h["momentum"])
            u2 = u.view(len(u), -1) if u.ndim > 2 else u
            o = newton_schulz(u2, 5, h["ns_method"], torch.float32)
            o = o * (math.sqrt(g.size(-2) / g.size(-1)) if g.size(-2) > g.size(-1) else 1.0)
            p.mul_(1 - h["lr"] * h["weight_decay"])
            p.add_(o.reshape(p.shape), alpha=-h["lr"])
        else:
            b1, b2 = h["adam_betas"]
            m.lerp_(g, 1 - b1)
            v.lerp_(g * g, 1 - b2)
            u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + h["adam_eps"])
            p.mul_(1 - h["adam_lr"] * h["adam_weight_decay"])
            p.add_(u, alpha=-h["adam_lr"])


def test_newton_schulz_is_deepspeeds():
    """ "standard" is DeepSpeed's iteration, bitwise; "gram" computes the same polynomial of `x x^T` (Dao's Gram
    Newton-Schulz): in float64 the two agree to rounding (5 steps of products of matrices with entries <= 1 and
    coefficients <= 4.8: the 1e-9 here is far above their float64 rounding and far below any real change)."""
    g = torch.Generator().manual_seed(0)
    for shape in ((4, 9), (9, 4), (5, 5), (1, 7)):
        x = torch.randn(shape, generator=g)
        assert torch.equal(newton_schulz(x, 5, "standard"), ds_standard(x))
        x64 = x.double()
        gram, std = newton_schulz(x64, 5, "gram", torch.float64), newton_schulz(x64, 5, "standard", torch.float64)
        assert (gram - std).abs().max().item() < 1e-9, shape


hypers = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([0.02, 0.1]),
        "momentum": st.sampled_from([0.95, 0.8]),
        "weight_decay": st.sampled_from([0.0, 0.1]),
        "adam_lr": st.sampled_from([3e-4, 1e-2]),
        "adam_betas": st.just((0.9, 0.95)),
        "adam_eps": st.just(1e-10),
        "adam_weight_decay": st.sampled_from([0.0, 0.01]),
        "ns_method": st.sampled_from(["gram", "standard"]),
    }
)


@settings(deadline=None, max_examples=40)
@given(h=hypers, shapes=st.lists(st.sampled_from([(3, 5), (6, 2), (4,), (2, 2, 3), (7,)]), min_size=1, max_size=4),
       world=st.integers(1, 4), steps=st.integers(1, 3), seed=st.integers(0, 99))  # fmt: skip
def test_every_rank_count_gives_the_whole_tensor_step(h, shapes, world, steps, seed):
    """Shards of any world, their matrices moved to their owners and back, give bitwise the step on whole tensors."""
    names = [f"layer{i}.w" for i in range(len(shapes))]
    layout = make_layout([(n, s, torch.float32) for n, s in zip(names, shapes, strict=True)], world=world, align=1)
    opt = fzero.muon(**{k: v for k, v in h.items() if k != "ns_method"}, ns_method=h["ns_method"])
    mesh = fzero.SimMesh(world)
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) for n, s in zip(names, shapes, strict=True)}
    flat = torch.zeros(layout.numel)
    for leaf in layout.leaves:
        flat[leaf.offset : leaf.offset + leaf.numel] = full[leaf.name].reshape(-1)
    shards = flat.view(world, -1)  # one unit: rank r's shard is chunk r
    tensors = tensors_of(layout, full=world == 1, ranks=range(world), exchange=mesh.all_to_all)
    state = opt.init(shards)
    ref = {n: t.clone() for n, t in full.items()}
    ref_state = {n: (torch.zeros_like(t), torch.zeros_like(t)) for n, t in full.items()}
    for t in range(1, steps + 1):
        grads = {n: torch.randn(s, generator=g) for n, s in zip(names, shapes, strict=True)}
        gflat = torch.zeros(layout.numel)
        for leaf in layout.leaves:
            gflat[leaf.offset : leaf.offset + leaf.numel] = grads[leaf.name].reshape(-1)
        shards, state = opt.update(gflat.view_as(shards), state, shards, tensors=tensors)
        reference_step(ref, grads, ref_state, t, h)
    got = shards.reshape(-1)
    for leaf in layout.leaves:
        assert torch.equal(got[leaf.offset : leaf.offset + leaf.numel], ref[leaf.name].reshape(-1)), leaf.name
    assert not got[layout.real_numel :].any()  # padding stays zero


def run(preset, world, batches, model, opt):
    tx = getattr(fzero, preset)(opt)
    mesh = fzero.SimMesh(world)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    for batch in batches:
        state, metrics = step(state, batch)
    return fzero.state_dict(state), metrics


@pytest.mark.parametrize("world", [2, 3])
def test_stages_agree_bitwise_and_the_ledger_counts_the_exchange(world):
    """Stages 0-3 train bitwise alike (one micro-step: the same reduced gradients; the same whole-matrix step);
    stages 1-3 add exactly two all-to-alls per step (the pieces to the owners and back), stage 0 none."""
    model = mlp([6, 5, 4, 3], 0)
    batches = regression_batches(model, world, 1, 2, 2, 0)
    opt = fzero.muon(0.05, weight_decay=0.1, adam_lr=1e-2)
    results = {p: run(p, world, batches, model, opt) for p in ("zero0", "zero1", "zero2", "zero3")}
    for p in ("zero1", "zero2", "zero3"):
        assert differing(results[p][0], results["zero0"][0]) == [], p
    _, adam = run("zero2", world, batches, model, fzero.adamw(1e-2))
    extra = results["zero2"][1]["comm"].get("all_to_all", {"calls": 0})
    assert adam["comm"].get("all_to_all") is None and extra["calls"] == 2
    assert results["zero0"][1]["comm"].get("all_to_all") is None


@pytest.mark.parametrize("world", [1, 2, 3])
def test_groups_give_each_half_its_values(world):
    """Param groups (DeepSpeed 0.19.8 splits each into its Muon and Adam halves): the whole-tensor step with each
    tensor's group's values, bitwise, at any world."""
    from fzero.optim.groups import segments as make_segments

    shapes = {"a.w": (4, 6), "a.b": (4,), "c.w": (6, 4), "c.b": (6,)}
    over = {"lr": 0.01, "adam_lr": 1e-3, "weight_decay": 0.0, "adam_weight_decay": 0.0, "momentum": 0.9}
    groups = fzero.param_groups({"c.*": over})
    base = {"lr": 0.05, "momentum": 0.95, "weight_decay": 0.1, "adam_lr": 1e-2, "adam_betas": (0.9, 0.95),
            "adam_eps": 1e-10, "adam_weight_decay": 0.1}  # fmt: skip
    opt = fzero.muon(**base, groups=groups)
    layout = make_layout([(n, s, torch.float32) for n, s in shapes.items()], world=world, align=1)
    resolved = groups.resolve(list(shapes), set(opt.defaults))
    segs = make_segments(layout, resolved, full=world == 1, ranks=range(world))
    tensors = tensors_of(layout, full=world == 1, ranks=range(world), exchange=fzero.SimMesh(world).all_to_all)
    g = torch.Generator().manual_seed(world)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    flat = torch.zeros(layout.numel)
    for leaf in layout.leaves:
        flat[leaf.offset : leaf.offset + leaf.numel] = full[leaf.name].reshape(-1)
    shards = flat.view(world, -1)
    state = opt.init(shards)
    ref, ref_state = {n: t.clone() for n, t in full.items()}, {n: (torch.zeros_like(t), torch.zeros_like(t))
                                                               for n, t in full.items()}  # fmt: skip
    for t in range(1, 3):
        grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        gflat = torch.zeros(layout.numel)
        for leaf in layout.leaves:
            gflat[leaf.offset : leaf.offset + leaf.numel] = grads[leaf.name].reshape(-1)
        shards, state = opt.update(gflat.view_as(shards), state, shards, segments=segs, tensors=tensors)
        for name in shapes:
            h = {**base, **(over if name.startswith("c.") else {}), "ns_method": "gram"}
            reference_step({name: ref[name]}, {name: grads[name]}, {name: ref_state[name]}, t, h)
    got = shards.reshape(-1)
    for leaf in layout.leaves:
        assert torch.equal(got[leaf.offset : leaf.offset + leaf.numel], ref[leaf.name].reshape(-1)), leaf.name


def test_owners_balance_the_matrices():
    numels = [30, 30, 20, 10, 10, 5]
    owner = owners(numels, 3)
    load = [sum(n for n, o in zip(numels, owner, strict=True) if o == r) for r in range(3)]
    assert max(load) - min(load) <= max(numels) and sorted(load) == [30, 35, 40]


def test_muon_errors():
    with pytest.raises(ValueError, match="ns_method must be 'gram' or 'standard'"):
        fzero.muon(ns_method="svd")
    with pytest.raises(ValueError, match="invalid momentum: 1.5"):
        fzero.muon(momentum=1.5)
    with pytest.raises(ValueError, match="muon needs each tensor's place"):
        opt = fzero.muon()
        p = torch.zeros(4)
        opt.update(p, opt.init(p), p)


def test_the_config_maps_deepspeeds_muon():
    """DeepSpeed 0.19.8's two halves: `lr` shared unless `muon_lr` / `adam_lr`, defaults 0.02 and 3e-4,
    `weight_decay` for both, `betas`/`eps` the Adam half's; a scheduler drives both halves as two param groups
    (WarmupLR without `warmup_max_lr`: each to its own lr); the engine then trains as the core preset does."""
    from fzero.config import parse_config
    from fzero.config.build import optimizer_spec

    def spec(params, **extra):
        return optimizer_spec(parse_config({"train_batch_size": 4, "optimizer": {"type": "Muon", "params": params},
                                            **extra}))  # fmt: skip

    s = spec({})
    assert (s.kind, s.lr, s.hypers["adam_lr"], s.options) == ("muon", 0.02, 3e-4, {"ns_method": "gram"})
    assert (spec({"lr": 0.1}).lr, spec({"lr": 0.1}).hypers["adam_lr"]) == (0.1, 0.1)
    s = spec({"lr": 0.1, "muon_lr": 0.05, "adam_lr": 1e-3, "weight_decay": 0.1, "betas": [0.8, 0.9]})
    assert (s.lr, s.hypers["adam_lr"], s.hypers["adam_weight_decay"], s.hypers["adam_betas"]) == (
        0.05,
        1e-3,
        0.1,
        (0.8, 0.9),
    )
    warm = spec({"muon_lr": 0.05, "adam_lr": 1e-3}, scheduler={"type": "WarmupLR", "params": {
        "warmup_num_steps": 2, "warmup_type": "linear"}})  # fmt: skip
    muon_lrs, adam_lrs = [warm.lr(n) for n in range(5)], [warm.hypers["adam_lr"](n) for n in range(5)]
    assert muon_lrs[-1] == 0.05 and adam_lrs[-1] == 1e-3 and muon_lrs[0] == adam_lrs[0] == 0.0
    assert all(math.isclose(a * 50, m) for a, m in zip(adam_lrs, muon_lrs, strict=True))  # each to its own lr
    model = mlp([6, 5, 3], 0)
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Muon", "params": {"lr": 0.05, "weight_decay": 0.1}}}  # fmt: skip
    engine, *_ = fzero.initialize(model=model, config=cfg)
    state, _ = run("zero2", 1, regression_batches(model, 1, 1, 4, 2, 3), mlp([6, 5, 3], 0),
                   fzero.muon(0.05, weight_decay=0.1, adam_lr=0.05, adam_weight_decay=0.1))  # fmt: skip
    for batch in regression_batches(model, 1, 1, 4, 2, 3):
        loss = torch.nn.functional.mse_loss(engine(batch["x"][0]), batch["y"][0])
        engine.backward(loss)
        engine.step()
    got = engine.module_state_dict()
    assert differing(got, state) == []
    with pytest.raises(fzero.config.UnsupportedConfigError, match="optimizer.params.per_head_muon"):
        spec({"per_head_muon": True})


def test_the_engine_takes_deepspeeds_param_groups_for_muon():
    """`model_parameters` groups with Muon, as DeepSpeed 0.19.8 takes them: a group's `lr` and `weight_decay` for
    both its halves, `betas` / `eps` for its Adam half; the engine trains as the core optimizer with those groups,
    bitwise, and a scheduler drives every half from its own lr."""
    model = mlp([6, 5, 3], 0)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.01, "betas": [0.8, 0.9]}]
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Muon", "params": {"lr": 0.05, "weight_decay": 0.1}}}  # fmt: skip
    engine, *_ = fzero.initialize(model=model, model_parameters=groups, config=cfg)
    over = {"weight_decay": 0.0, "adam_weight_decay": 0.0, "lr": 0.01, "adam_lr": 0.01, "adam_betas": (0.8, 0.9)}
    core = fzero.muon(0.05, weight_decay=0.1, adam_lr=0.05, adam_weight_decay=0.1,
                      groups=fzero.param_groups({"*.bias": over}))  # fmt: skip
    batches = regression_batches(model, 1, 1, 4, 2, 3)
    state, _ = run("zero2", 1, batches, mlp([6, 5, 3], 0), core)
    for batch in batches:
        engine.backward(torch.nn.functional.mse_loss(engine(batch["x"][0]), batch["y"][0]))
        engine.step()
    assert differing(engine.module_state_dict(), state) == []
    from fzero.config import parse_config
    from fzero.config.build import optimizer_spec

    warm = optimizer_spec(parse_config({**cfg, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}),
                          [(["0.weight"], {}), (["0.bias"], {"lr": 0.01})])  # fmt: skip
    assert [g.hypers["adam_lr"](9) for g in warm.groups] == [0.05, 0.01]

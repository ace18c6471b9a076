"""bf16 master weights (DeepSpeed's `bf16.bf16_master_weights_and_grads`, `bf16_optimizer_states`): float32
arithmetic, one rounding on store (`fzero.optim.stored_in`), at stages 1-3, through the config and the engine."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.config import ConfigError, parse_config
from fzero.optim import stored_in
from fzero.optim.groups import Segments
from tests.bounds import adam_drift
from tests.support import differing, mlp, reference_run, regression_batches, regression_loss

U_BF16 = 2.0**-8  # bf16's unit roundoff


def transcription(opt, p, g, state, state_dtype):
    """What `stored_in` promises: the float32 update of the upcast values, each result rounded once."""
    up = optree.tree_map(lambda x: x.float() if x.is_floating_point() and x.shape == p.shape else x, state)
    new_p, new_state = opt.update(g.float(), up, p.float())
    store = state_dtype or torch.float32
    down = optree.tree_map(lambda x: x.to(store) if x.is_floating_point() and x.shape == p.shape else x, new_state)
    return new_p.to(p.dtype), down


@settings(deadline=None, max_examples=30)
@given(kind=st.sampled_from(["adamw", "lion", "sgd", "adagrad"]), state_dtype=st.sampled_from([None, torch.bfloat16]),
       n=st.integers(1, 40), steps=st.integers(1, 3), seed=st.integers(0, 99), donate=st.booleans(),
       grouped=st.booleans())  # fmt: skip
def test_one_rounding_on_store(kind, state_dtype, n, steps, seed, donate, grouped):
    """Bitwise the float32 update rounded once, for any optimizer, grouped or not, pure or donated."""
    inner = {"adamw": lambda: fzero.adamw(1e-2, weight_decay=0.1), "lion": lambda: fzero.lion(1e-3),
             "sgd": lambda: fzero.sgd(0.1, momentum=0.9), "adagrad": lambda: fzero.adagrad(0.1)}[kind]()  # fmt: skip
    opt = stored_in(inner, torch.bfloat16, state_dtype)
    segments = Segments((n,), (1,), ({}, {"lr": 3e-3})) if grouped else None
    kw = {} if segments is None else {"segments": segments}
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).bfloat16()
    state = opt.init(p)
    ref_p, ref_state = p.clone(), optree.tree_map(torch.clone, state)
    for _ in range(steps):
        grad = torch.randn(n, generator=g).bfloat16()
        ref_p, ref_state = (
            transcription(inner, ref_p, grad, ref_state, state_dtype)
            if not grouped
            else (_grouped_transcription(inner, ref_p, grad, ref_state, state_dtype, segments))
        )
        p, state = opt.update(grad, state, p, donate=donate, **kw)
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref_p)
        for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(ref_state), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _grouped_transcription(opt, p, g, state, state_dtype, segments):
    up = optree.tree_map(lambda x: x.float() if x.is_floating_point() and x.shape == p.shape else x, state)
    new_p, new_state = opt.update(g.float(), up, p.float(), segments=segments)
    store = state_dtype or torch.float32
    down = optree.tree_map(lambda x: x.to(store) if x.is_floating_point() and x.shape == p.shape else x, new_state)
    return new_p.to(p.dtype), down


def _policy():
    return fzero.Policy(param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        accum_dtype=torch.bfloat16)  # fmt: skip


def bf16_loss(model):
    def loss_fn(params, batch):
        out = torch.func.functional_call(model, params, (batch["x"].bfloat16(),))
        return torch.nn.functional.mse_loss(out.float(), batch["y"])

    return loss_fn


def train(preset, world, batches, model, opt, precision):
    tx = getattr(fzero, preset)(opt, precision=precision)
    mesh = fzero.SimMesh(world)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, bf16_loss(model), tx, mesh)
    for batch in batches:
        state, _ = step(state, batch)
    return state


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stages_agree_and_the_error_is_the_stated_one(world):
    """Stages 1-3 with bf16 master weights train bitwise alike and hold the master in bf16 (half the bytes); against
    full-batch float32 AdamW the difference is within Adam's step bound plus one bf16 rounding of the weights per
    step (`u |w|`, u = 2^-8: tests/bounds.py's kind 3 for bf16, without the detection threshold)."""
    model = mlp([6, 5, 3], 0)
    batches = regression_batches(model, world, 1, 2, 3, 0)
    opt = stored_in(fzero.adamw(1e-2), torch.bfloat16)
    states = {p: train(p, world, batches, model, opt, _policy()) for p in ("zero1", "zero2", "zero3")}
    dicts = {p: fzero.state_dict(s) for p, s in states.items()}
    assert differing(dicts["zero2"], dicts["zero3"]) == [] and differing(dicts["zero1"], dicts["zero2"]) == []
    assert states["zero2"].params.dtype == torch.bfloat16
    fp32 = train("zero2", world, batches, model, fzero.adamw(1e-2), "bf16")
    assert fzero.state_bytes(states["zero2"])["master"] * 2 == fzero.state_bytes(fp32)["master"]
    ref = reference_run(model, regression_loss, batches, 1, lambda p: torch.optim.AdamW(p, lr=1e-2))
    scale = max(v.abs().max().item() for v in ref.values())
    bound = adam_drift(1e-2, 3, scale=scale) + 3 * U_BF16 * scale
    got = dicts["zero2"]
    assert max((got[k].double() - ref[k].double()).abs().max().item() for k in ref) <= bound


def _config(**bf16):
    return {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, **bf16}}  # fmt: skip


def test_deepspeeds_rules():
    """DeepSpeed 0.19.8: stages 1-3 only; bf16_optimizer_states needs the master option; float32 states (or any
    offload) need the CPU Adam under offload."""
    cfg = _config()
    with pytest.raises(ConfigError, match="bf16.bf16_master_weights_and_grads: with float32 optimizer states"):
        parse_config(cfg)
    with pytest.raises(ConfigError, match="only supported with ZeRO stage 1, 2 or 3"):
        parse_config({**cfg, "zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match="bf16.bf16_optimizer_states: requires bf16_master_weights_and_grads"):
        parse_config({**cfg, "bf16": {"enabled": True, "bf16_optimizer_states": True}})
    lion = {**cfg, "optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}  # fmt: skip
    with pytest.raises(ConfigError, match="needs zero_optimization.offload_optimizer.device 'cpu' and optimizer"):
        parse_config(lion)
    parse_config({**cfg, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    parse_config({**lion, "bf16": {**lion["bf16"], "bf16_optimizer_states": True}, "zero_optimization": {
        "stage": 2}})  # fmt: skip


@pytest.mark.parametrize(
    ("zero", "bf16", "state_dtype"),
    [
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}, torch.float32),  # DeepSpeed's CPU Adam, fp32 state
        ({"stage": 3}, {"bf16_optimizer_states": True}, torch.bfloat16),
    ],
)
def test_the_engine_trains_as_the_core_and_checkpoints_bitwise(tmp_path, zero, bf16, state_dtype):
    """The engine with the config equals the core preset with `stored_in` bitwise; its checkpoint holds the bf16
    master and the state in their dtypes, and a fresh engine resumes bitwise."""
    model = mlp([6, 5, 3], 1)
    cfg = {**_config(**bf16), "zero_optimization": zero}
    eng, *_ = fzero.initialize(model=copy.deepcopy(model), config=cfg)
    assert eng.state.params.dtype == torch.bfloat16
    state_leaves = [x for x in optree.tree_leaves(eng.state.tx_state) if isinstance(x, torch.Tensor)
                    and x.is_floating_point() and x.shape == eng.state.params.shape]  # fmt: skip
    assert state_leaves and all(x.dtype == state_dtype for x in state_leaves)
    batches = regression_batches(model, 1, 1, 4, 4, 2)

    def steps(engine, part):
        for b in part:
            engine.backward(torch.nn.functional.mse_loss(engine(b["x"][0].bfloat16()).float(), b["y"][0]))
            engine.step()

    steps(eng, batches[:2])
    eng.save_checkpoint(tmp_path)
    steps(eng, batches[2:])
    again, *_ = fzero.initialize(model=mlp([6, 5, 3], 9), config=cfg)
    again.load_checkpoint(tmp_path)
    steps(again, batches[2:])
    assert differing(again.module_state_dict(), eng.module_state_dict()) == []

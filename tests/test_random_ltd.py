"""Random-LTD (DeepSpeed's data routing) held against DeepSpeed 0.19.8 itself (CPU accelerator, gloo, 2 processes:
`tests/random_ltd_worker.py`), and fzero's own pieces on one process.

DeepSpeed's random-LTD op is a CUDA kernel its CPU accelerator cannot build; the worker stands in for the three
kernels (`token_sort_`, `token_gather`, `token_scatter_`) with an element-by-element reference of their semantics
(`RefKernel`). So what is compared with DeepSpeed's own code is everything but those kernels: its config parsing,
scheduler, token draws, autograd functions, layer wrapper, `convert_to_random_ltd` and the engine's `update_seq`.
Gathers and scatters copy values, so with the same tokens every loss is the same arithmetic on both sides: bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch

import fzero.deepspeed as deepspeed
from fzero.config import ConfigError, ConfigTypeError, ConfigWarning, UnsupportedConfigError, parse_config
from fzero.config.data_routing import parse_data_routing
from fzero.deepspeed.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from fzero.optim import random_ltd as ltd
from tests import random_ltd_worker as w
from tests.real_models import T, V, gpt2
from tests.spawn import spawn

WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("random-ltd")
    spawn(w.run, (WORLD, str(tmp)), WORLD)
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.timeout(300)
def test_kept_tokens_follow_deepspeeds_schedule(runs):
    """DeepSpeed's RandomLTDScheduler and fzero's, fed the same steps (two micro-steps each) over 1.25 x
    require_steps for the examples' schedules (500 to 4887 steps): the same kept length and consumed layer-tokens at
    every step. In training, every step's kept length and layer-tokens are DeepSpeed's, and each block's input had
    DeepSpeed's token count (blocks 1 and 2 the kept tokens, 0 and 3 the whole sequence)."""
    for ds_trace, fz_trace in runs["pieces"]["schedules"]:
        assert fz_trace == ds_trace
        assert ds_trace[-1][0] > ds_trace[0][0]  # (the schedule rose)
    ds = runs["deepspeed"]
    assert ds["kept"] == [3, 4, 5, 6, 8, 8]
    for stage, fz in runs["fzero"].items():
        assert fz["kept"] == ds["kept"] and fz["consumed"] == ds["consumed"], stage
        assert [[n for n, _ in step] for step in fz["seen"]] == [[n for n, _ in step] for step in ds["seen"]], stage
    assert [n for n, _ in ds["seen"][0]] == [w.S, 3, 3, w.S]


@pytest.mark.timeout(300)
def test_losses_equal_deepspeeds_bitwise_at_every_stage(runs):
    """The same model, data and token draws (the global generator seeded before each forward): fzero's losses at
    stages 0 and 3 equal DeepSpeed's (stage 0) bitwise at every step, hence at stages 1 and 2 too (one micro-step per
    step: stages 0-3 are bitwise equal, docs/equivalence.md; random-LTD only sees the forward, whose parameters are
    whole at stages 0-2 and gathered per unit at 3). At stage 3 each block is a unit (persistence threshold 1000
    elements, a block has 2.2k) and its path holds the wrapper: the block's parameters were gathered whenever it ran
    (the gather hooks fire around the wrapper's forward)."""
    assert sorted(runs["fzero"]) == ["0", "3"]
    ds = runs["deepspeed"]
    for stage, fz in runs["fzero"].items():
        assert fz["losses"] == ds["losses"], stage
        assert fz["wrapped"] == ["RandomLayerTokenDrop"] * w.LAYERS
    z3 = runs["fzero"]["3"]
    assert {"h.1", "h.2"} <= set(z3["units"])
    assert all(real for step in z3["seen"] for _, real in step)


@pytest.mark.timeout(300)
def test_token_ops_match_deepspeeds(runs):
    """From the same seed, fzero's gpt_sample_tokens / bert_sample_tokens draw DeepSpeed's int32 indices and cut
    DeepSpeed's masks; GatherTokens -> layer -> ScatterTokens gives DeepSpeed's output and input gradient bitwise,
    batch-first and sequence-first."""
    pieces = runs["pieces"]
    assert pieces["sampling"] == [[True, True, True]] * 2
    assert pieces["autograd"] == [[True, True]] * 2


def _subset(ds, fz, where=""):
    """Every key DeepSpeed's parsed config has is fzero's, with the same value (fzero fills in more defaults)."""
    if isinstance(ds, dict):
        for key, value in ds.items():
            assert key in fz, f"{where}.{key}"
            _subset(value, fz[key], f"{where}.{key}")
    else:
        assert ds == fz, where


@pytest.mark.timeout(300)
def test_config_as_deepspeed_parses_it(runs):
    """DeepSpeed's get_data_routing and fzero's parse_data_routing on the same blocks (absent, enabled without
    random_ltd, random_ltd disabled with keys, the worker's enabled block): DeepSpeed's keys and values."""
    for ds, fz in runs["pieces"]["config"]:
        _subset(ds, fz)
    disabled = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    assert runs["pieces"]["config"][2][1]["random_ltd"] == disabled


@pytest.mark.timeout(300)
def test_checkpoint_resume_is_bitwise(runs):
    """Stage 3: saved after 2 steps, loaded into a new engine whose generator was elsewhere: the next 2 losses and
    the scheduler's state are the uninterrupted run's bitwise; the scheduler's state went through the checkpoint
    (JSON) and the client state comes back without it."""
    r = runs["resume"]
    assert r["resumed"] == r["after"]
    assert r["loaded"] == r["saved"] and r["saved"]["current_steps"] == 1
    assert r["resumed_final"] == r["final"]
    assert r["client"] == {"mine": 1}


# ------------------------------------------------------------------------------------------------ one process
ROUTING = {
    "enabled": True,
    "random_ltd": {
        "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
        "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 3, "max_value": T, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 4, "seq_per_step": 1}},
    },
}  # fmt: skip


def _with(path: str, value, block=None):
    """ROUTING (or `block`) with the key at dotted `path` set to `value` (`...` deletes it)."""
    out = json.loads(json.dumps(block or ROUTING))
    *keys, last = path.split(".")
    node = out
    for key in keys:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "error", "message"),
    [
        ("random_ltd.total_layer_num", ..., ConfigError, "x.random_ltd.total_layer_num: is required"),
        ("random_ltd.model_mask_name", ..., ConfigError, "x.random_ltd.model_mask_name: is required"),
        ("random_ltd.random_ltd_schedule.schedule_config.seq_per_step", ..., ConfigError,
         "x.random_ltd.random_ltd_schedule.schedule_config.seq_per_step: is required"),
        ("random_ltd.random_ltd_schedule.schedule_type", "fixed_root", ConfigError, "expected one of 'fixed_linear'"),
        ("random_ltd.random_ltd_schedule.schedule_config.require_steps", 0, ConfigError, "require_steps: expected"),
        ("random_ltd.random_ltd_schedule.min_value", 9, ConfigError, "min_value: 9 exceeds max_value 8"),
        ("random_ltd.random_ltd_layer_num", 5, ConfigError, "random_ltd_layer_num: 5 exceeds total_layer_num 4"),
        ("random_ltd.random_ltd_layer_id", [1], ConfigError, "random_ltd_layer_id: names 1 layers, fewer than"),
        ("random_ltd.model_type", "encoder-decoder", ConfigError, "model_type: expected one of 'decoder', 'encoder'"),
        ("random_ltd.hidden_state_order", "bsh", ConfigError, "hidden_state_order: expected one of"),
        ("random_ltd.random_ltd_layer_id", "1,2", ConfigTypeError, "random_ltd_layer_id: expected a list"),
        ("random_ltd.layer_token_lr_schedule", {"enabled": True}, UnsupportedConfigError,
         "layer_token_lr_schedule.enabled: True (bool) is not supported"),
        ("random_ltd", [1], ConfigTypeError, "x.random_ltd: expected an object"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(path, value, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_data_routing(_with(path, value), "x")


def test_config_unknown_keys_and_the_top_level_dispatch():
    """An unknown key is named in one ConfigWarning; the engine's config reaches this parser through
    `data_efficiency.data_routing`, its error naming the full path."""
    with pytest.warns(ConfigWarning, match=r"x\.random_ltd\.random_ltd_layers"):
        parse_data_routing(_with("random_ltd.random_ltd_layers", 2), "x")
    base = {"train_batch_size": 2}
    cfg = parse_config({**base, "data_efficiency": {"data_routing": ROUTING}}, world=1)
    assert cfg["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_layer_id"] == [1, 2]
    with pytest.raises(ConfigError, match=r"^data_efficiency\.data_routing\.random_ltd\.model_type: is required"):
        parse_config({**base, "data_efficiency": {"data_routing": _with("random_ltd.model_type", ...)}}, world=1)


def test_schedule_and_token_selection_are_plain_functions():
    """The schedule is a pure function of the step; the kept positions are sorted and distinct; drop_tokens is the
    layer on the kept tokens with the others passed through, and its gradient is the layer's at
    the kept positions and the identity's elsewhere."""
    f = ltd.fixed_linear(min_value=128, max_value=1024, require_steps=400, seq_per_step=8)
    assert [f(s) for s in (0, 1, 200, 399, 400, 10**6)] == [128, 128, 576, 1016, 1024, 1024]
    with pytest.raises(ValueError, match="seq_per_step must be a positive integer, got 0"):
        ltd.fixed_linear(1, 2, 3, 0)
    idx = ltd.sample_tokens(5, 9, batch=3, layers=2, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (2, 3, 5) and all(len(set(row.tolist())) == 5 for row in idx.reshape(-1, 5))
    assert torch.equal(idx, idx.sort(dim=-1).values)
    hidden = torch.randn(3, 9, 4)
    rows = idx[0]
    out = ltd.drop_tokens(lambda h: h * 3.0, hidden, rows)
    kept = torch.zeros(3, 9, dtype=torch.bool).scatter(1, rows, True)
    assert torch.equal(out[kept], hidden[kept] * 3.0) and torch.equal(out[~kept], hidden[~kept])
    x = hidden.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(ltd.drop_tokens(lambda p: p * 3.0, x, rows).sum(), x)
    assert torch.equal(grad, torch.where(kept[..., None], 3.0, 1.0).expand_as(grad))
    seq_first = ltd.drop_tokens(lambda h: h * 3.0, hidden.transpose(0, 1), rows, batch_first=False)
    assert torch.equal(seq_first.transpose(0, 1), out)


def _engine(model, routing=ROUTING, stage: int = 0):
    cfg = {
        "train_batch_size": 2,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "data_efficiency": {"data_routing": routing},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      printer=lambda *_: None)  # fmt: skip
    return engine


def test_transformers_gpt2_with_its_positional_mask():
    """transformers 5's GPT-2 passes its blocks the mask positionally (DeepSpeed 0.19.8's wrapper, keywords only,
    raises TypeError there); fzero's wrapper finds it by the block's signature. The first step's loss equals,
    bitwise, a plain GPT-2 whose blocks 1 and 2 are cut to the same tokens by forward hooks (the same draw from the
    same seed, then plain indexing); evaluation drops nothing; the state dict keeps the model's keys."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    reference = gpt2(layers=4)
    drawn: dict[str, torch.Tensor] = {}

    def cut(block_id):
        def pre(module, args, kwargs):
            hidden = args[0]
            if block_id == 1:  # the first dropping block draws for both (DeepSpeed's gpt_sample_tokens)
                weights = torch.ones(2 * hidden.shape[0], hidden.shape[1])
                drawn["idx"] = torch.multinomial(weights, 3).reshape(2, hidden.shape[0], 3).sort(-1).values
            rows = drawn["idx"][block_id - 1]
            drawn["full"] = hidden
            mask = args[2]
            part = torch.stack([hidden[b, rows[b]] for b in range(hidden.shape[0])])
            return (part, args[1], None if mask is None else mask[:, :, :3, :3], *args[3:]), kwargs

        def post(module, args, kwargs, output):
            rows, full = drawn["idx"][block_id - 1], drawn["full"].clone()
            for b in range(full.shape[0]):
                full[b, rows[b]] = output[b]
            return full

        return pre, post

    for i in (1, 2):
        pre, post = cut(i)
        reference.transformer.h[i].register_forward_pre_hook(pre, with_kwargs=True)
        reference.transformer.h[i].register_forward_hook(post, with_kwargs=True)
    torch.manual_seed(11)
    expected = reference(input_ids=ids, labels=ids).loss

    model = gpt2(layers=4)
    plain_keys = list(model.state_dict())
    engine = convert_to_random_ltd(_engine(model), GPT2Block)
    torch.manual_seed(11)
    loss = engine(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, expected)
    assert engine.random_ltd_scheduler.get_current_seq() == 3
    engine.backward(loss)
    engine.step()
    assert sorted(save_without_random_ltd(engine)) == sorted(plain_keys) == sorted(engine.module_state_dict())
    assert list(remove_random_ltd_state_dict({"h.1.random_ltd_layer.w": 0})) == ["h.1.w"]
    seen = []
    engine.module.transformer.h[1].random_ltd_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    engine.eval()
    with torch.no_grad():
        engine(input_ids=ids)
    assert seen == [T] and not engine.module.transformer.h[1].random_ltd_layer.training


def test_refusals_name_what_to_do():
    """convert_to_random_ltd needs the engine; a random_ltd_layer_num the ids cannot match and random-LTD disabled
    are errors that say so."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    with pytest.raises(TypeError, match="pass the engine"):
        convert_to_random_ltd(gpt2(layers=4), GPT2Block)
    with pytest.raises(ValueError, match=r"random_ltd_layer_num is 2 but 1 wrapped layers matched"):
        convert_to_random_ltd(_engine(gpt2(layers=4), _with("random_ltd.random_ltd_layer_id", [1, 7])), GPT2Block)
    plain = _engine(gpt2(layers=4), {"enabled": False})
    assert not plain.random_ltd_enabled()
    with pytest.raises(RuntimeError, match="random-LTD is not enabled"):
        convert_to_random_ltd(plain, GPT2Block)


def test_scheduler_state_is_the_engines_checkpoint_record(tmp_path):
    """The scheduler's state is a part of the engine's record (`parts["random_ltd"]`), not of the client state: a
    client_state with a `"random_ltd"` key of its own comes back as it went in, and a new engine resumes the
    scheduler. A record without `parts` (written before it existed) loads, leaving the scheduler as it was."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fzero.checkpoint import read_manifest, resolve
    from fzero.checkpoint import save as fzero_save
    from fzero.engine.checkpointing import _record

    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    engine = convert_to_random_ltd(_engine(gpt2(layers=4)), GPT2Block)
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    saved = engine.random_ltd_scheduler.state_dict()
    assert saved["current_steps"] == 1 and saved["consumed_layer_tokens"] > 0
    engine.save_checkpoint(tmp_path, tag="t", client_state={"random_ltd": 1})
    record = read_manifest(resolve(tmp_path, "t")).user_state
    assert record["engine"]["parts"] == {"random_ltd": saved} and record["client_state"] == {"random_ltd": 1}

    old = {key: value for key, value in _record(engine).items() if key != "parts"}  # (the record before `parts`)
    fzero_save(engine.state, tmp_path, tag="old", data_position=engine.micro_steps, config=engine.config.values,
               user_state={"client_state": {}, "engine": old})  # fmt: skip
    fresh = convert_to_random_ltd(_engine(gpt2(layers=4)), GPT2Block)
    start = fresh.random_ltd_scheduler.state_dict()
    _, client = fresh.load_checkpoint(tmp_path, tag="old")
    assert client == {} and fresh.global_steps == 2 and fresh.random_ltd_scheduler.state_dict() == start
    _, client = fresh.load_checkpoint(tmp_path, tag="t")
    assert client == {"random_ltd": 1} and fresh.random_ltd_scheduler.state_dict() == saved

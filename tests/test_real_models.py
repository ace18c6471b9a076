"""Models nobody here wrote: tiny Hugging Face GPT-2, Llama, BERT and Mixtral built from configs, a peft LoRA
adapter, a torchvision-style ResNet, and the habits that come with them (activation checkpointing, evaluation
between steps, frozen and tied weights, `save_pretrained`, sharded construction with the model's own initializer).

Tolerances against plain `torch.optim.AdamW` on the full batch (3 steps, lr 1e-2, 2 ranks):
- float32: 1e-4, the empirical float32 bound of docs/equivalence.md (the reduction order differs: per rank, then over
  ranks); measured up to 3.1e-5 here;
- bfloat16 compute: 2 * lr * steps = 0.06, the bound docs/equivalence.md derives (a gradient below bf16's noise can
  flip sign, and Adam turns that into a full lr step); measured up to 0.038.
Everything else here is bitwise: stages against each other, runs with checkpointing or an evaluation pass against
the same run without, SimMesh against DistMesh (tests/real_models_worker.py).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import fzero
from tests import real_models_worker
from tests.bounds import TRACKS, adam_check, assert_within
from tests.real_models import (
    MODELS,
    assert_bitwise,
    frozen_embeddings,
    gpt2,
    image_batches,
    image_loss,
    lm_loss,
    lora,
    reference,
    resnet,
    token_batches,
    train,
)
from tests.spawn import spawn

pytest.importorskip("transformers")

BATCHES = token_batches(world=2, steps=3)
LR, STEPS = 1e-2, 3  # tests.real_models.reference's AdamW and the batches'


def close(got, ref, make, threshold=TRACKS) -> None:
    """float32 (or bf16 compute) against the full-batch AdamW reference: tests/bounds.py's kind 3."""
    assert_within(adam_check(got, ref, make().state_dict(), LR, STEPS), threshold)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_stage_matches_adamw_and_loads_strictly(name):
    """Stages 0-3 equal each other bitwise (one micro-step: the same reduction and update) and plain AdamW within
    the float32 tolerance; the state dict has exactly the model's keys (BERT's position_ids and Llama's
    inv_freq are non-persistent buffers: not in it) and loads with strict=True."""
    make = MODELS[name]
    ref = reference(make(), BATCHES)
    results = {}
    for preset in ("zero0", "zero1", "zero2", "zero3"):
        state, _ = train(make(), BATCHES, preset)
        results[preset] = fzero.state_dict(state)
        assert set(results[preset]) == set(make().state_dict()), preset
    for preset in ("zero0", "zero1", "zero3"):
        assert_bitwise(results[preset], results["zero2"])
    close(results["zero2"], ref, make)
    make().load_state_dict(results["zero3"], strict=True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_stage3_equals_stage2_and_tracks_fp32(name):
    make = MODELS[name]
    ref = reference(make(), BATCHES)
    two, _ = train(make(), BATCHES, "zero2", precision="bf16")
    three, _ = train(make(), BATCHES, "zero3", precision="bf16")
    assert_bitwise(fzero.state_dict(three), fzero.state_dict(two))
    close(fzero.state_dict(three), ref, make, threshold=None)  # bf16 compute: the per-element bound


@pytest.mark.parametrize("preset", ["zero2", "zero3"])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_activation_checkpointing_is_bitwise(name, reentrant, preset):
    """`gradient_checkpointing_enable()` (both of torch's kinds) changes nothing: the recompute sees exactly the
    step's parameters (gathered per unit at stage 3) and draws the same dropout."""
    make = lambda: MODELS[name](dropout=0.1)  # noqa: E731
    plain, _ = train(make(), BATCHES, preset)
    model = make()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed, _ = train(model, BATCHES, preset)
    assert_bitwise(fzero.state_dict(checkpointed), fzero.state_dict(plain))


def test_checkpointing_with_torch_func_is_a_clear_error():
    model = gpt2()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="autodiff='func' cannot differentiate a model with activation checkpointing"):
        train(model, BATCHES[:1], autodiff="func")


def test_evaluation_between_steps_changes_nothing():
    """`eval_step` between steps (eval mode, no_grad, several forwards): the training is bitwise the one without,
    and stage 3's evaluation (one unit at a time) gives stage 2's outputs."""
    mesh = fzero.SimMesh(2)
    seen = {}
    for preset in ("zero2", "zero3"):
        finals = []
        for evaluate_between in (False, True):
            model = gpt2(dropout=0.1)
            tx = getattr(fzero, preset)(fzero.adamw(1e-2))
            state = fzero.init(model, tx, mesh)
            step = fzero.train_step(model, lm_loss(model), tx, mesh)
            logits = lambda p, b, m=model: torch.func.functional_call(m, p, (b["x"],)).logits  # noqa: E731
            evaluate = fzero.eval_step(model, logits, mesh)
            outputs = []
            for batch in BATCHES:
                state, _ = step(state, batch)
                if evaluate_between:
                    model.eval()
                    outputs += [evaluate(state, batch), evaluate(state, batch)]
                    model.train()
            finals.append(fzero.state_dict(state))
        assert_bitwise(finals[1], finals[0])
        assert torch.equal(outputs[0], outputs[1])  # eval mode: no dropout
        seen[preset] = outputs
    for a, b in zip(seen["zero2"], seen["zero3"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["zero0", "zero1", "zero2", "zero3"])
def test_the_model_moved_to_meta_after_init_trains_the_same(preset):
    """`model.to("meta")` right after `fzero.init` (freeing the model's own copy of the parameters, which the
    state has copied; `fzero.init`'s docstring): GPT-2 (tied head) trains and evaluates bitwise as with the model
    left alone."""
    mesh = fzero.SimMesh(2)
    finals, outputs = [], []
    for to_meta in (False, True):
        model = gpt2()
        tx = getattr(fzero, preset)(fzero.adamw(LR))
        state = fzero.init(model, tx, mesh)
        if to_meta:
            model.to("meta")
        step = fzero.train_step(model, lm_loss(model), tx, mesh)
        evaluate = fzero.eval_step(model, lambda p, b, m=model: torch.func.functional_call(m, p, (b["x"],)).logits,
                                   mesh)  # fmt: skip
        for batch in BATCHES:
            state, _ = step(state, batch)
        model.eval()
        outputs.append(evaluate(state, BATCHES[0]))
        finals.append(fzero.state_dict(state))
    assert all(p.is_meta for p in model.parameters())
    assert_bitwise(finals[1], finals[0])
    assert torch.equal(outputs[1], outputs[0])


@pytest.mark.parametrize("preset", ["zero0", "zero1", "zero2", "zero3"])
def test_frozen_tied_embedding(preset):
    """GPT-2 with `wte` frozen (and `lm_head` tied to it): both names in the state dict, the embedding unchanged,
    the rest as plain AdamW trains it; stage 3 shards the frozen embedding and equals stage 2 bitwise."""
    ref = reference(frozen_embeddings(), BATCHES)
    state, _ = train(frozen_embeddings(), BATCHES, preset)
    got = fzero.state_dict(state)
    assert set(got) == set(ref) and "lm_head.weight" in got
    assert torch.equal(got["transformer.wte.weight"], frozen_embeddings().transformer.wte.weight)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    close(got, ref, frozen_embeddings)
    if preset == "zero3":
        two, _ = train(frozen_embeddings(), BATCHES, "zero2")
        assert_bitwise(got, fzero.state_dict(two))
        assert state.frozen.shape[-1] == state.layout.frozen_layout.shard_numel  # sharded at rest


@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_lora_adapter(base):
    """A peft LoRA model: only the adapters train; at stage 3 the frozen base model is sharded at rest (each rank
    holds 1/world of it, padding aside) and gathered per unit; stages agree bitwise and track AdamW."""
    ref = reference(lora(base=base), BATCHES)
    results = {}
    for preset in ("zero0", "zero2", "zero3"):
        state, _ = train(lora(base=base), BATCHES, preset)
        results[preset] = fzero.state_dict(state)
        if preset == "zero3":
            frozen = state.layout.frozen_layout
            per_rank = fzero.state_bytes(state)["frozen"]
            assert per_rank == frozen.numel // 2 * 4  # fp32, the frozen buffer split in 2
            assert frozen.real_numel * 4 / 2 <= per_rank < frozen.real_numel * 4 / 2 * 1.1
    assert_bitwise(results["zero0"], results["zero2"])
    assert_bitwise(results["zero3"], results["zero2"])
    close(results["zero2"], ref, lambda: lora(base=base))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_save_pretrained_round_trip(tmp_path, name):
    """Train at stage 3, load the consolidated state strictly, `save_pretrained`, `from_pretrained`: the same
    tensors (non-persistent buffers are the model's own, recomputed)."""
    make = MODELS[name]
    state, _ = train(make(), BATCHES, "zero3")
    model = make()
    model.load_state_dict(fzero.state_dict(state), strict=True)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path)
    assert_bitwise(again.state_dict(), model.state_dict())


def test_lora_save_pretrained_round_trip(tmp_path):
    from peft import PeftModel

    state, _ = train(lora(), BATCHES, "zero3")
    model = lora()
    model.load_state_dict(fzero.state_dict(state), strict=True)
    model.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(gpt2(), tmp_path)
    assert_bitwise(again.state_dict(), model.state_dict())


def test_resnet_stage3_with_size_based_units():
    """A CNN without an nn.ModuleList (BatchNorm, in-place ReLU on block outputs): with `BySize` units stage 3
    gathers well under half the model at once, and equals stage 2 bitwise (buffers included)."""
    psi = sum(p.numel() for p in resnet().parameters())
    batches = image_batches(world=2, steps=3)
    two, _ = train(resnet(), batches, "zero2", loss=image_loss)
    units = fzero.layout.BySize(psi // 20)
    three, metrics = train(resnet(), batches, "zero3", loss=image_loss, units=units)
    assert len(three.layout.units) > 4
    assert metrics["gathered_peak"] < 0.5 * psi
    assert_bitwise(fzero.state_dict(three), fzero.state_dict(two))


class InPlace(torch.nn.Module):
    """Blocks in an nn.ModuleList whose outputs are modified in place: `y += h`, then ReLU(inplace=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.act = torch.nn.ReLU(inplace=True)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            y = block(h)
            y += h
            h = self.act(y)
        return self.out(h)


def test_in_place_ops_on_unit_outputs():
    """Legal in plain PyTorch, hence at stage 3: the pre-backward hook is a tensor hook, not an autograd Function
    whose outputs autograd forbids modifying in place."""

    def loss(model):
        return lambda p, b: torch.func.functional_call(model, p, (b["x"],)).pow(2).mean()

    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(2, 4, 6, generator=g)} for _ in range(3)]
    runs = {p: train(torch.manual_seed(0) and InPlace(), batches, p, loss=loss) for p in ("zero2", "zero3")}
    assert_bitwise(fzero.state_dict(runs["zero3"][0]), fzero.state_dict(runs["zero2"][0]))


def test_single_big_unit_warns():
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))  # 1.05M elements
    with pytest.warns(UserWarning, match=r"unit '<root>' holds 100% of the parameters.*BySize"):
        fzero.init(model, fzero.zero3(fzero.adamw()), fzero.SimMesh(2), units="module_list")
    with pytest.warns(UserWarning, match=r"unit '<root>' holds 100%"):  # a unit bigger than any module
        fzero.init(model, fzero.zero3(fzero.adamw()), fzero.SimMesh(2), units=fzero.layout.BySize(10**6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fzero.init(model, fzero.zero3(fzero.adamw()), fzero.SimMesh(2), units=fzero.layout.BySize(100_000))
        fzero.init(model, fzero.zero3(fzero.adamw()), fzero.SimMesh(2))  # the default: module by module here
        fzero.init(model, fzero.zero2(fzero.adamw()), fzero.SimMesh(2))  # only stage 3 gathers per unit


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_meta_construction_with_the_models_initializer(name):
    """A model built on `meta` and constructed sharded with its own `_init_weights` (run as `model.apply` would:
    GPT-2's parent-set `c_proj` scaling included) is fully initialised and trains; torch's `reset_parameters`
    alone misses tensors (GPT-2's Conv1D, rotary inv_freq, position_ids), and the error names them."""
    make = MODELS[name]
    with torch.device("meta"):
        meta = make()
    mesh = fzero.SimMesh(2)
    tx = fzero.zero3(fzero.adamw(1e-2))
    state = fzero.init(meta, tx, mesh, initializer=meta._init_weights)
    full = fzero.state_dict(state)
    assert all(torch.isfinite(v).all() for v in full.values() if v.is_floating_point())
    model = make()
    model.load_state_dict(full, strict=True)
    step = fzero.train_step(model, lm_loss(model), tx, mesh)
    losses = []
    batch = token_batches(2, 1, seed=3)[0]
    for _ in range(6):  # the same batch: it can be memorised, so the loss must fall
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert abs(losses[0] - torch.log(torch.tensor(64.0)).item()) < 0.5 and losses[-1] < losses[0]
    reset = lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None  # noqa: E731
    with pytest.raises(ValueError, match="initializer left .* uninitialised"):
        fzero.init(meta, tx, mesh, initializer=reset)


def test_parent_set_initialisation_reaches_the_child():
    """GPT-2's `_init_weights` sets `c_proj.weight` from the attention/MLP module (its parent), at
    initializer_range / sqrt(2 n_layer): sharded construction must run it there, after the child's own init."""
    with torch.device("meta"):
        meta = gpt2(layers=8, width=64)
    state = fzero.init(meta, fzero.zero3(fzero.adamw()), fzero.SimMesh(2), initializer=meta._init_weights)
    full = fzero.state_dict(state)
    proj, attn = full["transformer.h.3.attn.c_proj.weight"].std(), full["transformer.h.3.attn.c_attn.weight"].std()
    assert abs(proj / attn - 0.25) < 0.05  # 0.02 / sqrt(16) against 0.02, from 4096 and 12288 samples


def test_simulated_ranks_draw_different_dropout():
    """Each rank draws its own dropout masks (the rule of fzero.state.rng; separate processes seeded alike would not),
    and the same state, batch and step draw the same masks again."""
    model = gpt2(dropout=0.3)
    mesh = fzero.SimMesh(2)
    state = fzero.init(model, fzero.zero2(fzero.adamw()), mesh)
    x = token_batches(world=1, steps=1)[0]["x"]
    same = {"x": x.expand(2, *x.shape[1:])}
    evaluate = fzero.eval_step(model, lm_loss(model), mesh)  # train mode: dropout on
    losses = evaluate(state, same)
    assert not torch.equal(losses[0], losses[1])
    assert torch.equal(evaluate(state, same), losses)


def test_engine_single_process_every_stage():
    """The engine in one process (`initialize` without torchrun): GPT-2 with a frozen tied embedding, passed as
    `model.parameters()` (DeepSpeed accepts frozen ones there), checkpointing, evaluation passes between steps;
    every stage gives the same parameters, AdamW's within tolerance, and `module_state_dict` loads strictly."""
    digests = {}
    for stage in (0, 1, 2, 3):
        r = real_models_worker._engine_case(stage, "fp32", rank=None)
        assert r["strict_load"], stage
        assert_within(r["vs_reference"])
        digests[stage] = (r["params"], r["eval"])
    assert len(set(digests.values())) == 1, digests


@pytest.mark.timeout(300)
def test_two_gloo_processes(tmp_path):
    """On 2 gloo processes: SimMesh equals DistMesh bitwise with dropout on (functional core, stages 2 and 3, LoRA,
    checkpointing); the engine trains GPT-2 with frozen embeddings, checkpointing and evaluation passes between
    steps, stage 3 equal to stage 2 bitwise and to plain AdamW within tolerance."""
    spawn(real_models_worker.run, (2, str(tmp_path)), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    for case, differ in results["core"].items():
        assert differ == [], case  # the tensors where DistMesh differs from SimMesh
    engine = results["engine"]
    for case, r in engine.items():
        assert r["strict_load"], case
    for precision in ("fp32", "bf16"):
        assert engine[f"3-{precision}"]["params"] == engine[f"2-{precision}"]["params"], precision
        assert engine[f"3-{precision}"]["eval"] == engine[f"2-{precision}"]["eval"], precision
    assert_within(engine["2-fp32"]["vs_reference"])
    assert_within(engine["2-bf16"]["vs_reference"], threshold=None)

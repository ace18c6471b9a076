"""The default unit choice (`fzero.layout.Auto`): the `nn.ModuleList` children and the large untied modules outside
the list, or module by module where those would leave one unit holding most of the model (an `nn.Sequential`, a
CNN). Stage 3 then gathers a fraction of the model at once, and trains to the same parameters, bitwise, as the same
layers in a `ModuleList` and as one unit: gradients, their mean over ranks and AdamW are elementwise, so the layout
changes no element's arithmetic (no clipping here: the gradient norm's summation order follows the layout)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import fzero
from fzero.layout import ROOT_UNIT, Auto, unit_policy
from fzero.sharding.schedule import Gatherer
from tests.real_models import V, assert_bitwise, gpt2, llama, token_batches, train

WIDTH = 512  # four bias-free layers of 512 x 512: 2**20 elements, the smallest model the rule splits


def sequential(layers: int, norm: bool = False, seed: int = 0) -> nn.Sequential:
    """`layers` bias-free Linear + ReLU (a LayerNorm after each with `norm`), no ModuleList."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH, bias=False), nn.ReLU()] + ([nn.LayerNorm(WIDTH)] if norm else [])
    return nn.Sequential(*mods)


class Listed(nn.Module):
    """The same modules in an `nn.ModuleList`: the rule's own units."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.layers = nn.ModuleList(seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(model: nn.Module):
    def loss_fn(params, batch):
        return ((torch.func.functional_call(model, params, (batch["x"],)) - batch["y"]) ** 2).mean()

    return loss_fn


def _train(model: nn.Module, units, steps: int = 2, seed: int = 1):
    """`real_models.train` at stage 3 (AdamW, 2 simulated ranks) on `steps` batches of 3 random rows a rank."""
    g = torch.Generator().manual_seed(seed)
    batches = [{k: torch.randn(2, 3, WIDTH, generator=g) for k in ("x", "y")} for _ in range(steps)]
    return train(model, batches, "zero3", loss=_loss, units=units)


@settings(max_examples=3, deadline=None)
@given(layers=st.integers(4, 6), norm=st.booleans())
def test_sequential_units_are_its_modules_and_train_bitwise(layers, norm):
    """Each Linear a unit (a LayerNorm, under the 100,000-element minimum, stays in the root unit, gathered for the
    step as DeepSpeed keeps small parameters); the gathered peak at most two units' worth (one computing, one
    prefetched, plus the root); the parameters bitwise the ModuleList model's and the one-unit run's."""
    seq = sequential(layers, norm)
    psi = WIDTH * WIDTH * layers
    state, metrics = _train(seq, None)
    linears = {str(i) for i, m in enumerate(seq) if isinstance(m, nn.Linear)}
    assert {u.name for u in state.layout.units} == linears | ({ROOT_UNIT} if norm else set())
    root = 2 * WIDTH * layers if norm else 0
    assert metrics["gathered_peak"] <= 2 * WIDTH * WIDTH + root and 2 * WIDTH * WIDTH <= psi / 2  # (2 of >= 4 Linears)
    listed, _ = _train(Listed(sequential(layers, norm)), "module_list")
    assert len(listed.layout.units) == layers * (2 if norm else 1)  # the list's children that own parameters
    with pytest.warns(UserWarning, match="holds 100% of the parameters"):
        one, _ = _train(sequential(layers, norm), "single")
    got = fzero.state_dict(state)
    assert_bitwise({f"layers.{k}": v for k, v in got.items()}, fzero.state_dict(listed))
    assert_bitwise(got, fzero.state_dict(one))


class CNN(nn.Module):
    """Convolution stages without a ModuleList, BatchNorm between (1.2M elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 128, 3, padding=1)
        self.stages = nn.Sequential(*(nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.BatchNorm2d(128),
                                                    nn.ReLU()) for _ in range(8)))  # fmt: skip
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def test_cnn_units_follow_its_convolutions():
    """A CNN: each 128-channel convolution a unit; what is under 100,000 elements (the stem, the BatchNorms, the
    head) in the root unit, gathered for the step."""
    unit_of = unit_policy(CNN(), None)
    assert {unit_of(n) for n, _ in CNN().named_parameters()} == {ROOT_UNIT} | {f"stages.{i}.0" for i in range(8)}
    assert unit_of("stages.3.1.weight") == unit_of("stem.weight") == ROOT_UNIT


def test_models_with_a_module_list_keep_its_units():
    """HF GPT-2: its blocks (the ModuleList's children) are units; outside the list, the position table (262,144
    elements) is a unit of its own, while the token embedding, tied to the head (both modules read it), and the final
    norm (under 100,000 elements) stay in the root unit; small models: unchanged."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000))
    auto, by_list = unit_policy(model, None), unit_policy(model, "module_list")
    assert all(auto(n) == by_list(n) for n, _ in model.named_parameters() if not n.startswith("transformer.wpe."))
    assert auto("transformer.wpe.weight") == "transformer.wpe" and by_list("transformer.wpe.weight") == ROOT_UNIT
    assert auto("transformer.wte.weight") == auto("transformer.ln_f.weight") == ROOT_UNIT
    small = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # under 2**20 elements: one unit, as before
    assert {unit_policy(small, None)(n) for n, _ in small.named_parameters()} == {ROOT_UNIT}


@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_embedding_and_head_outside_the_list_are_units_and_train_bitwise(preset):
    """An untied Llama: its embedding and head, outside the ModuleList, are units of their own (with `Auto(1000)`
    these tiny ones are over the minimum), gathered when their modules run and reduced as their gradients complete;
    the final norm stays in the root unit. Stage 2 and stage 3 on 2 ranks train to the parameters of the same model
    with both in the root unit, bitwise (the same elementwise arithmetic; no clipping). A GPT-2, whose head shares
    the embedding's weight, keeps that weight in the root unit (both modules read it), its position table a unit."""
    pytest.importorskip("transformers")
    batches = token_batches(2, 2)
    split, _ = train(llama(), batches, preset, units=Auto(1000))
    names = {u.name for u in split.layout.units}
    assert {"model.embed_tokens", "lm_head", ROOT_UNIT} <= names, names
    rooted, _ = train(llama(), batches, preset, units="module_list")
    assert "lm_head" not in {u.name for u in rooted.layout.units}
    assert_bitwise(fzero.state_dict(split), fzero.state_dict(rooted))
    tied, _ = train(gpt2(), batches, preset, units=Auto(500))
    unit_of = {leaf.name: tied.layout.units[leaf.unit].name for leaf in tied.layout.leaves}
    assert unit_of["transformer.wte.weight"] == ROOT_UNIT and unit_of["transformer.wpe.weight"] == "transformer.wpe"
    assert_bitwise(fzero.state_dict(tied), fzero.state_dict(train(gpt2(), batches, preset, units="module_list")[0]))


class TiedLogits(nn.Module):
    """x-transformers' tied embedding: no head module, the logits read the embedding's weight (`h @ emb.weight.T`)
    after the embedding ran, then calls the embedding again; with `early`, the forward first reads the last layer's
    weight (a regularizer), before the forward reaches that layer, else only its metadata (which reads nothing)."""

    def __init__(self, early: bool = False, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.early, self.emb = early, nn.Embedding(V, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last = self.layers[-1].weight
        if self.early:
            penalty = last.square().mean()
        else:
            width = self.emb.embedding_dim
            assert last.shape == (width, width) and last.dtype == torch.float32 and hash(last) == id(last)
            penalty = x.new_zeros((), dtype=torch.float32)
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = h @ self.emb.weight.T
        with torch.no_grad():  # the embedding called again after the read (a target, as contrastive losses take)
            self.emb(x)
        return logits, penalty


def _next_token_loss(model: nn.Module):
    def loss_fn(params, batch):
        logits, penalty = torch.func.functional_call(model, params, (batch["x"],))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["x"][:, 1:].flatten()) + penalty

    return loss_fn


@pytest.mark.parametrize("early", [False, True])
def test_a_weight_read_outside_its_module(early, monkeypatch):
    """A unit's weight read outside its module gets the tensor its module computes with: at stages 0-2, where a
    unit stays gathered once gathered, also before the forward reached it (gathered then, in forward order); at
    stage 3, which frees a unit after its forward, after its forward (gathered again, held to its backward). The
    tied logits, and at stages 0-2 a penalty on a later layer read first, train to the parameters of the same model
    with the embedding in the root unit, bitwise; at stage 3 the early read is an error naming the weight. A model
    that reads no weight outside its modules makes no such read (nothing is gathered ahead of the forward)."""
    reads: list[str] = []
    real_read = Gatherer.read
    monkeypatch.setattr(Gatherer, "read", lambda self, i, n: reads.append(n) or real_read(self, i, n))
    batches = token_batches(2, 2)
    for preset in ("zero0", "zero1", "zero2") + (() if early else ("zero3",)):
        split, _ = train(TiedLogits(early), batches, preset, loss=_next_token_loss, units=Auto(1000))
        assert "emb" in {u.name for u in split.layout.units}
        assert set(reads) == ({"emb.weight", "layers.1.weight"} if early else {"emb.weight"}), reads
        rooted, _ = train(TiedLogits(early), batches, preset, loss=_next_token_loss, units="module_list")
        assert "emb" not in {u.name for u in rooted.layout.units}
        assert_bitwise(fzero.state_dict(split), fzero.state_dict(rooted))
    if early:
        with pytest.raises(RuntimeError, match="parameter 'layers.1.weight' was used .* outside the forward of its "
                                               "stage-3 unit"):  # fmt: skip
            train(TiedLogits(early), batches, "zero3", loss=_next_token_loss, units=Auto(1000))
    pytest.importorskip("transformers")
    reads.clear()
    for preset in ("zero2", "zero3"):
        train(llama(), batches, preset, units=Auto(1000))
        train(gpt2(), batches, preset, units=Auto(500))
    assert reads == []


def test_auto_min_numel_and_the_warning():
    """`Auto(n)`: modules under n elements join the unit around them; where even modules leave one unit most of
    the model (one big Linear), init warns; a bad n is an error naming the policy."""
    seq = sequential(4, norm=True)
    each = unit_policy(seq, Auto(1))
    assert len({each(n) for n, _ in seq.named_parameters()}) == 8  # every Linear and LayerNorm
    big = nn.Sequential(nn.Linear(2048, 1024), nn.Linear(1024, 8))
    with pytest.warns(UserWarning, match=r"unit '0' holds 100% of the parameters"):
        fzero.init(big, fzero.zero3(fzero.adamw()), fzero.SimMesh(2))
    with pytest.raises(ValueError, match=r"Auto\(min_numel=...\) needs an int >= 1, got 0"):
        Auto(0)


def test_engine_units_from_the_persistence_threshold():
    """The shell picks units as DeepSpeed's granularity: `stage3_param_persistence_threshold` is the smallest
    module with a unit of its own (0: every module owning parameters); it trains (one process: its gathering on
    two is benchmarks/stage3_memory.py's)."""
    for threshold, count in ((100_000, 5), (0, 8)):
        config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": threshold},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
        seq = sequential(4, norm=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine, *_ = fzero.initialize(model=seq, model_parameters=seq.parameters(), config=config,
                                          printer=lambda line: None)  # fmt: skip
        assert len(engine.state.layout.units) == count
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(2))
        loss = (engine(x) ** 2).mean()
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss) and engine.global_steps == 1

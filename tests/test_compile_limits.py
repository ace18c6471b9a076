"""Per-unit compilation where each block needs a graph of its own: Hugging Face's Llama with its KV cache on (the
default, `config.use_cache`), whose layers each fill their own cache entry, so dynamo guards on the layer and
compiles one graph per block, and one more each for an evaluation between steps (no grad) and for a last short batch
(dynamic). Past dynamo's recompile limit it would run the remaining blocks eager, silently but for a warning;
`fzero.sharding.compile` gives each block the limit's budget, so every block runs compiled at every step.

Single process, a `SimMesh` of 2 ranks, a backend that counts the graphs it compiles and the calls into them (run
as traced: the losses are eager's, bitwise). The limit is lowered to 3 here so that two layers cross it (the real
limit, 8, is crossed by nine layers, or by fewer evaluated between steps).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import fzero

transformers = pytest.importorskip("transformers")

LAYERS, RANKS, LIMIT_HERE = 2, 2, 3
LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def _losses(backend=None) -> list[float]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache  # (the default: what makes each layer's graph its own)
    mesh = fzero.SimMesh(RANKS)
    tx = fzero.zero3(fzero.adamw(1e-2))
    state = fzero.init(model, tx, mesh)
    compile = False if backend is None else {"backend": backend}
    loss = lambda p, x: fzero.call(model, p, x, labels=x).loss  # noqa: E731
    step = fzero.train_step(model, loss, tx, mesh, compile=compile)
    evaluate = fzero.eval_step(model, loss, mesh)
    g = torch.Generator().manual_seed(0)
    losses = []
    for length, train in ((12, True), (12, False), (12, True), (7, True)):  # evaluated between steps; a short batch
        x = torch.randint(0, 64, (RANKS, 2, length), generator=g)
        if train:
            state, metrics = step(state, x)
            losses.append(float(metrics["loss"]))
        else:
            losses.extend(evaluate(state, x).tolist())
        if backend is not None:
            backend.steps.append(backend.calls)
            backend.calls = 0
    return losses


class Counting:
    """A dynamo backend that runs the traced graph as it is, counting the graphs and the calls into them."""

    def __init__(self) -> None:
        self.graphs, self.calls, self.steps = 0, 0, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.mark.timeout(300)
def test_every_block_is_compiled_past_dynamos_recompile_limit():
    torch._dynamo.reset()
    backend = Counting()
    with torch._dynamo.config.patch({LIMIT: LIMIT_HERE}):
        compiled = _losses(backend)
    torch._dynamo.reset()
    assert compiled == _losses()
    # every block of every rank ran compiled at every step, the evaluation and the short batch included
    assert backend.steps == [LAYERS * RANKS] * 4
    assert backend.graphs > LIMIT_HERE  # (the premise: the blocks' graphs, per block and variant, cross the limit)

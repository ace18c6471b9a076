"""Per-unit compilation where each block needs a graph of its own: Hugging Face's Llama with its KV cache on (the
default, `config.use_cache`), whose layers each fill their own cache entry, so dynamo guards on the layer and
compiles one graph per block. Past dynamo's recompile limit it would run the remaining blocks eager, silently but
for a warning; `fzero.sharding.compile` raises the limit for its compiled units, so every block runs compiled, also
after a last short batch (a dynamic graph per block).

Single process, a `SimMesh` of 2 ranks, a backend that counts the graphs it compiles and the calls into them (run
as traced: the losses are eager's, bitwise). The limit is lowered to 2 here so that two layers cross it (the real
limit, 8, is crossed by nine).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import fzero

transformers = pytest.importorskip("transformers")

LAYERS, RANKS = 2, 2
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
    step = fzero.train_step(model, lambda p, x: fzero.call(model, p, x, labels=x).loss, tx, mesh, compile=compile)
    g = torch.Generator().manual_seed(0)
    losses = []
    for length in (12, 12, 7):  # the last batch short: a dynamic graph per block
        state, metrics = step(state, torch.randint(0, 64, (RANKS, 2, length), generator=g))
        losses.append(float(metrics["loss"]))
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
    with torch._dynamo.config.patch({LIMIT: LAYERS}):
        compiled = _losses(backend)
    torch._dynamo.reset()
    assert compiled == _losses()
    # every block of every rank ran compiled at every step, the short one included
    assert backend.steps == [LAYERS * RANKS] * 3
    assert backend.graphs == 2 * LAYERS  # a graph per block, and a dynamic one each for the short batch

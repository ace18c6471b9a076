"""`deepspeed.runtime.data_pipeline.data_routing`: DeepSpeed 0.19.8's random-LTD (random layerwise token dropping)
as its scripts import it, over fzero's engine (`fzero.engine.random_ltd`) and the pure schedule and token selection
(`fzero.optim.random_ltd`).

    from fzero.deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd

    engine, *_ = deepspeed.initialize(model=model, config=cfg, ...)   # data_efficiency.data_routing.random_ltd
    engine = convert_to_random_ltd(engine, GPT2Block)

`helper` (`convert_to_random_ltd`, `save_without_random_ltd`, `remove_random_ltd_state_dict`), `basic_layer`
(`RandomLayerTokenDrop`), `scheduler` (`RandomLTDScheduler`) and `utils` (`bsh_decoder_gather` /
`bsh_decoder_scatter`); the token ops are `fzero.deepspeed.ops.random_ltd`.
"""

from __future__ import annotations

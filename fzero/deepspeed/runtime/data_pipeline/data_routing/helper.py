"""`deepspeed.runtime.data_pipeline.data_routing.helper`: wrapping a model's layers for random-LTD, and its state dict
without the wrappers.

    engine = convert_to_random_ltd(engine, GPT2Block)     # every GPT2Block wrapped, then engine.random_ltd_initialize()
    torch.save(save_without_random_ltd(engine.module), path)

fzero's wrapper keeps the layers' parameter paths, so the state dict has no `.random_ltd_layer` in its keys and
`remove_random_ltd_state_dict` leaves fzero's keys as they are (it removes DeepSpeed's, for state dicts saved by it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch import nn

from fzero.engine.random_ltd import RandomLayerTokenDrop

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]


def convert_to_random_ltd(model: Any, convert_type: type | tuple[type, ...]) -> Any:
    """Wrap every submodule of type `convert_type` in a `RandomLayerTokenDrop` and configure them
    (`model.random_ltd_initialize()`), as DeepSpeed's.

    Args:
      model: the engine `initialize` returned (its `.module` is wrapped); the config enables random-LTD.
      convert_type: the layer class (e.g. transformers' `GPT2Block`), or a tuple of classes.

    Returns:
      `model`.

    Raises:
      TypeError: `model` is not an engine (it has no `random_ltd_initialize`): wrap after `initialize`.
      ValueError, RuntimeError: `random_ltd_initialize`'s (the number of layers matched; random-LTD disabled).
    """
    if not callable(getattr(model, "random_ltd_initialize", None)):
        raise TypeError(
            f"convert_to_random_ltd: {type(model).__name__} has no random_ltd_initialize(); pass the engine "
            "fzero.deepspeed.initialize returned (DeepSpeed's convert_to_random_ltd needs its engine too)"
        )
    c_model = model.module if hasattr(model, "module") else model
    names = [name for name, module in c_model.named_modules() if isinstance(module, convert_type) and name]
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        owner = c_model.get_submodule(owner_path)
        layer = getattr(owner, attr)
        if not isinstance(layer, RandomLayerTokenDrop):
            setattr(owner, attr, RandomLayerTokenDrop(layer))
    model.random_ltd_initialize()
    return model


def save_without_random_ltd(model: Any) -> OrderedDict[str, Any]:
    """The model's state dict (of `model.module` for an engine) without the wrappers' `.random_ltd_layer` in the
    keys."""
    c_model: nn.Module = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(c_model.state_dict())


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """`state_dict` with every `.random_ltd_layer` removed from its keys (DeepSpeed's wrapper puts it there)."""
    return OrderedDict((key.replace(".random_ltd_layer", ""), value) for key, value in state_dict.items())

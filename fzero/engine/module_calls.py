"""The module's own attributes through the engine, as DeepSpeed's engine passes them on, and a clear error for a
call of a stage-3 module outside the engine.

DeepSpeed's `DeepSpeedEngine.__getattr__` answers a name the engine lacks from its module: scripts read
`engine.config`, call `engine.generate(...)`, `engine.gradient_checkpointing_enable()`, or a model's own method
(DeepSpeed-Chat's `critic.forward_value(...)`). fzero's engine does the same, and runs the module's methods as it
runs its forward (`Engine._call`): with the engine's parameters bound, and with gradients inside the open micro-step,
so that `engine.backward(loss)` finds the forward a method ran. Attributes that are not the module's methods (a
submodule, the config) come back as they are.

At stage 3 the module's parameters are empty between the engine's calls (DeepSpeed's too; its hooks gather them
around any call). A direct call (`engine.module(x)`, `engine.module.generate(...)`) would fail deep inside a layer
("'weight' must be 2-D"); fzero raises, before the forward, an error saying where the values are.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch import nn

from .parameters import ZeroParamStatus

__all__ = ["ModuleCalls"]


class ModuleCalls:
    """The engine's mixin for its module's attributes and calls (the engine defines `_call` and `_calls`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, nor has its module "
                                 f"({type(module).__name__})") from None  # fmt: skip
        if inspect.ismethod(value) and value.__self__ is module:
            call = self._call  # type: ignore[attr-defined]

            def method(*args: Any, **kwargs: Any) -> Any:
                return call(value, args, kwargs)

            method.__name__ = name
            method.__doc__ = value.__doc__
            return method
        return value

    def _watch_outside_calls(self, module: nn.Module) -> None:
        """At stage 3: make a call of `module` outside the engine, while its parameters are partitioned, an error
        naming what to do (the hook holds the engine weakly: it keeps no engine alive)."""
        engine = weakref.ref(self)

        def check(mod: nn.Module, args: Any) -> None:
            owner = engine()
            if owner is None or owner._calls > 0:  # type: ignore[attr-defined]  # (inside engine(...) or a method)
                return
            for p in mod.parameters():
                if getattr(p, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE:
                    raise RuntimeError(
                        f"{type(mod).__name__} was called outside its engine at ZeRO stage 3, where its parameters "
                        "are partitioned (this one is empty here): call it through the engine, engine(...) for the "
                        "forward, engine.<method>(...) for its other methods (engine.generate(...) for "
                        "engine.module.generate(...)), or gather it first with deepspeed.zero.GatheredParameters("
                        "engine.module.parameters())"
                    )

        self._outside_hook = module.register_forward_pre_hook(check)

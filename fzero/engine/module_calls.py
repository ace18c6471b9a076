"""The module's own attributes through the engine, as DeepSpeed's engine passes them on, and a clear error for a
call of a stage-3 module outside the engine.

DeepSpeed's `DeepSpeedEngine.__getattr__` answers a name the engine lacks from its module: scripts read
`engine.config`, call `engine.generate(...)`, `engine.gradient_checkpointing_enable()`, or a model's own method
(DeepSpeed-Chat's `critic.forward_value(...)`). fzero's engine does the same, and runs the module's methods as it
runs its forward (`Engine._call`): with the engine's parameters bound, and with gradients inside the open micro-step,
so that `engine.backward(loss)` finds the forward a method ran. Attributes that are not the module's methods (a
submodule, the config) come back as they are.

At stage 3 the module's parameters are empty between the engine's calls (DeepSpeed's too; its hooks gather them
around any call). A direct call (`engine.module(x)`, `engine.module.generate(...)`) under `torch.no_grad()` runs
on the engine's parameters, gathered unit by unit as in the engine's own evaluation forward (DeepSpeed-Chat's actor
generates this way); with gradients it would compute gradients the engine never sees, and is an error saying what
to call instead.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from typing import Any

import torch
from torch import Tensor, nn

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
        """At stage 3: a call of `module` outside the engine, while its parameters are partitioned, runs on the
        engine's parameters without gradients (DeepSpeed-Chat's `actor.module.generate(...)`), and with gradients
        is an error naming what to do. The hooks hold the engine weakly: they keep no engine alive."""
        engine = weakref.ref(self)
        open_calls: list[contextlib.AbstractContextManager[None] | None] = []

        def before(mod: nn.Module, args: Any) -> None:
            owner = engine()
            if owner is None or owner._calls > 0:  # type: ignore[attr-defined]  # (inside engine(...) or a method)
                if open_calls:  # a call nested in one `before` bound: `after` leaves that binding open
                    open_calls.append(None)
                return
            if not any(map(_absent, mod.parameters())):
                return  # (gathered by GatheredParameters, or nothing partitioned)
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{type(mod).__name__} was called outside its engine, with gradients enabled, at ZeRO stage 3, "
                    "where its parameters are partitioned and only the engine's forward trains them: call "
                    "engine(...) for the forward, engine.<method>(...) for its other methods (engine.generate(...) "
                    "for engine.module.generate(...)); under torch.no_grad() a direct call runs on the engine's "
                    "parameters"
                )
            binding = owner._evaluation_binding()  # type: ignore[attr-defined]
            binding.__enter__()
            open_calls.append(binding)
            owner._calls += 1  # type: ignore[attr-defined]

        def after(mod: nn.Module, args: Any, output: Any) -> None:
            owner = engine()
            binding = open_calls.pop() if open_calls else None
            if owner is None or binding is None:
                return  # (the engine's own call, or one nested in a bound call)
            owner._calls -= 1  # type: ignore[attr-defined]
            binding.__exit__(*sys.exc_info())  # (an exception in flight: the gathering is abandoned)

        self._outside_hooks = (module.register_forward_pre_hook(before),
                               module.register_forward_hook(after, always_call=True))  # fmt: skip


def _absent(param: Tensor) -> bool:
    """Whether a stage-3 parameter's values are not in it now: partitioned across the ranks, or (offloaded) kept
    only in the engine's state."""
    if getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE:
        return True
    return param.numel() == 0 and getattr(param, "ds_numel", 0) > 0

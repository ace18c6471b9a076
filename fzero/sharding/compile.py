"""Per-unit compilation: each unit's module forward compiled by `torch.compile`, the gathers, reductions and hooks
outside the graphs (FSDP2 and torchtitan's `block.compile()` under `fully_shard`).

Why per unit and not the whole model: a unit's gather and free are hooks around its module's call (`fzero.sharding.
schedule.Gatherer`), and its parameters are views that change from one step to the next. Compiling the whole model
makes dynamo trace into those hooks (graph breaks, recompiles through the warm-up); compiling `module.forward`
leaves `module.__call__`, where the hooks run, eager, and the graph receives the unit's parameters as inputs
(dynamo's default `inline_inbuilt_nn_modules`: guarded by shape, dtype and stride, not identity), so one graph
serves every step and every block with the same code (a transformer's blocks share one graph). The backward is the
forward graph's AOTAutograd backward.

Where the blocks do need graphs of their own (Hugging Face's decoders with their KV cache on, `config.use_cache`:
each layer fills its own entry of the cache, `cache.layers[self.layer_idx]`, and dynamo guards on which), dynamo
compiles one per block, and past its `recompile_limit` (8 graphs per code object) it would run the rest eager,
with a warning, and an evaluation between steps (no grad: a graph more each) or a last short batch (a dynamic one
each) would cross it sooner. So each compiled forward runs under that limit times the number of modules sharing its
code, the budget each would have with a code of its own: every block is compiled (`_limited`). One graph for all is
then the user's to have (`model.config.use_cache = False` for training).

Which modules: the modules of the units fzero gathers (`Layout.units`: each `nn.ModuleList` child, or the
`fzero.layout.Auto` / `BySize` subtrees) that contain no other unit's module; the root unit's own layers (the
embeddings, the head, the loss around them) stay eager, as a block-wise compile leaves them. A model that is one
unit (a small model) has no hook inside: its own forward is compiled whole. At stages 0-2 the same units are
compiled: their modules are the same, whatever the stage.

    names = compile_units(model, layout, {"backend": "inductor"})   # the compiled modules' paths

A model the user compiled before handing it over (`torch.compile(model)`, `model.compile(...)`) would be traced
whole, the hooks with it: `uncompiled(model)` gives back the plain module and the user's compiler (the same
backend and options, read from torch's wrapper), which `compile_units` then applies unit by unit.
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..layout import ROOT_UNIT, Layout

__all__ = ["COMPILED", "Compiler", "compile_units", "uncompiled"]

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]

COMPILED = "_fzero_compiled"
"""The attribute a compiled module carries: the `torch.compile` keyword arguments it was compiled with."""


def compile_units(model: nn.Module, layout: Layout, how: dict[str, Any] | Compiler) -> list[str]:
    """Compile the forward of each innermost unit module of `layout` in `model` (module docstring).

    A module compiled before the same way is left as it is; another way, its original forward is compiled again.

    Args:
      model: the module the layout was made from.
      layout: its layout (`TrainState.layout`).
      how: `torch.compile`'s keyword arguments (`backend`, `mode`, `fullgraph`, `dynamic`, `options`), or a
        compiler (a function to its compiled function: `uncompiled`'s).

    Returns:
      The paths of the compiled modules, in the layout's order (`[""]`: the model itself, when it is one unit).

    Raises:
      TypeError: `how` has a key `torch.compile` does not take (named).
    """
    if isinstance(how, dict):
        unknown = sorted(set(how) - {"backend", "mode", "fullgraph", "dynamic", "options", "disable"})
        if unknown:
            raise TypeError(f"compile options {unknown} are not torch.compile's keyword arguments (backend, mode, "
                            "fullgraph, dynamic, options, disable)")  # fmt: skip
        options = dict(how)
        compiler: Compiler = lambda fn: torch.compile(fn, **options)  # noqa: E731
        key: Any = options
    else:
        compiler, key = how, how
    modules = dict(model.named_modules())
    paths = [u.name for u in layout.units if u.name != ROOT_UNIT and u.name in modules]
    inner = [p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths)] or [""]
    eagers = {path: modules[path].__dict__.get("_fzero_eager_forward", modules[path].forward) for path in inner}
    codes = {path: _code(eager) for path, eager in eagers.items()}
    sharing = collections.Counter(codes.values())  # (dynamo keeps its graphs per code object)
    for path in inner:
        module, eager = modules[path], eagers[path]
        if getattr(module, COMPILED, None) == key:
            continue
        func = getattr(eager, "__func__", None)
        compiled: Callable[..., Any]
        if func is not None and getattr(eager, "__self__", None) is module:
            # the class's function compiled, bound to the module: `copy.deepcopy` binds the copy's to the copy
            compiled = types.MethodType(_limited(compiler(func), sharing[codes[path]]), module)
        else:  # (a forward set on the instance, not a method of it)
            compiled = _limited(compiler(eager), sharing[codes[path]])
        object.__setattr__(module, "_fzero_eager_forward", eager)
        object.__setattr__(module, "forward", compiled)
        object.__setattr__(module, COMPILED, key)
    return inner


def _code(forward: Callable[..., Any]) -> Any:
    """What dynamo keeps a forward's graphs under: its code object (a `functools.partial`'s function's)."""
    target = getattr(forward, "__func__", forward)
    target = getattr(target, "func", target)
    return getattr(target, "__code__", target)


def _limited(compiled: Callable[..., Any], modules: int) -> Callable[..., Any]:
    """`compiled`, run under dynamo's recompile limits multiplied by the number of `modules` sharing its code: each
    may need graphs of its own (module docstring). Unchanged for a code of one module."""
    if modules == 1:
        return compiled
    config = torch._dynamo.config  # (here, not at import: importing fzero must not import dynamo)
    # the limits on graphs per code object and per frame (torch < 2.6: `cache_size_limit`)
    names = ("recompile_limit", "accumulated_recompile_limit")
    if not hasattr(config, names[0]):
        names = ("cache_size_limit", "accumulated_cache_size_limit")
    per_code, per_frame = (getattr(config, name) for name in names)
    raised = config.patch({names[0]: per_code * modules, names[1]: max(per_frame, per_code * modules)})

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        with raised:
            return compiled(*args, **kwargs)

    return run


def uncompiled(model: nn.Module) -> tuple[nn.Module, Compiler | None]:
    """`model` without torch's whole-model compilation, and the compiler it carried (None: it carried none).

    `torch.compile(model)` is an `OptimizedModule` around the model: its `dynamo_ctx` compiles as the user asked.
    `model.compile(...)` keeps a compiled call on the module itself, which is dropped here; its context is read
    from the compiled function (torch's wrapper keeps it in its closure; where it does not, torch.compile's defaults).

    Returns:
      `(module, compiler)`: the module to train, and the compiler to hand `compile_units`.
    """
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner, model.dynamo_ctx  # type: ignore[return-value]
    called = model.__dict__.get("_compiled_call_impl")
    if called is None:
        return model, None
    model._compiled_call_impl = None
    cells = [c.cell_contents for c in getattr(called, "__closure__", None) or ()]
    context = next((c for c in cells if type(c).__name__ == "OptimizeContext" and callable(c)), None)
    return model, context if context is not None else torch.compile

"""`import deepspeed` answered by `fzero.deepspeed`, for code the user cannot edit (Hugging Face transformers).

A script changes its own import lines (`import fzero.deepspeed as deepspeed`), but transformers imports `deepspeed`
by name inside its functions: `from_pretrained` at ZeRO-3 builds the model under `deepspeed.zero.Init`, loads the
checkpoint through `deepspeed.zero.GatheredParameters`, and `resize_token_embeddings` gathers the same way. With
DeepSpeed installed those would be DeepSpeed's own objects (a model fzero then refuses: its values are in DeepSpeed's
partitions); without it, an `ImportError`. `alias_deepspeed()` makes `deepspeed` and every `deepspeed.X` the
modules `fzero.deepspeed` and `fzero.deepspeed.X` (the same objects, not copies) until the function it returns is
called; fzero's `HfDeepSpeedConfig` holds it for as long as it lives, as long as transformers consults it.

While it holds, DeepSpeed's own modules already imported leave `sys.modules` and come back, unchanged, when the last
holder releases it; a name bound earlier (`import deepspeed` at the top of a module) keeps the module it was bound
to. A `deepspeed.X` that fzero does not have fails as `fzero.deepspeed.X` does (`NotImplementedError` naming the
alternative, or `ModuleNotFoundError`), never falls back to DeepSpeed's.

    release = alias_deepspeed()
    import deepspeed                       # fzero.deepspeed
    release()                              # deepspeed is DeepSpeed's again (or not importable)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["alias_deepspeed"]

_NAME = "deepspeed"
_OURS = "fzero.deepspeed"


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.X` as the already imported `fzero.deepspeed.X` object."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set `__spec__` to the alias's; the module stays fzero's own (reloads, pickling)
        module.__spec__ = self.spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `deepspeed` and `deepspeed.X` as `fzero.deepspeed` and `fzero.deepspeed.X` (first on the meta path)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        module = importlib.import_module(_OURS + fullname[len(_NAME) :])
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=hasattr(module, "__path__"))


class _State:
    def __init__(self) -> None:
        # reentrant: a holder collected by the garbage collector releases from inside whatever allocated, possibly
        # `alias_deepspeed` itself (a plain lock would deadlock there)
        self.lock = threading.RLock()
        self.holders = 0
        self.installed = False
        self.finder = _AliasFinder()
        self.kept: dict[str, ModuleType] = {}  # DeepSpeed's own modules, out of sys.modules while aliased


_state = _State()


def _is_deepspeed(name: str) -> bool:
    return name == _NAME or name.startswith(_NAME + ".")


def alias_deepspeed() -> Callable[[], None]:
    """Make `import deepspeed` (and `deepspeed.X`) give `fzero.deepspeed`'s modules until released.

    Holders nest: the aliases go when the last one releases. Thread-safe; releasing twice is a no-op.

    Returns:
      The release function.
    """
    importlib.import_module(_OURS)
    with _state.lock:
        _state.holders += 1  # (first: a release reentering below cannot take the count to 0 while this one holds)
        if not _state.installed:
            _state.kept = {name: m for name, m in sys.modules.items() if _is_deepspeed(name)}
            for name in _state.kept:
                del sys.modules[name]
            ours = {name: m for name, m in sys.modules.items() if name == _OURS or name.startswith(_OURS + ".")}
            sys.modules.update({_NAME + name[len(_OURS) :]: m for name, m in ours.items()})
            sys.meta_path.insert(0, _state.finder)
            _state.installed = True
    released = False

    def release() -> None:
        nonlocal released
        with _state.lock:
            if released:
                return
            released = True
            _state.holders -= 1
            if _state.holders or not _state.installed:
                return
            _state.installed = False
            sys.meta_path.remove(_state.finder)
            for name in [name for name in sys.modules if _is_deepspeed(name)]:
                del sys.modules[name]
            sys.modules.update(_state.kept)
            _state.kept = {}

    return release

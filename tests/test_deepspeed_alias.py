"""`fzero.deepspeed.alias`: `import deepspeed` gives fzero's modules while held, and what was there before after.

(The same with DeepSpeed itself imported, and transformers' `from_pretrained` through it: tests/test_deepspeed_zero.py.)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import pytest

import fzero.deepspeed as fds
from fzero.deepspeed.alias import alias_deepspeed


@pytest.fixture
def other_deepspeed():
    """Modules standing where DeepSpeed's would be (kept aside if DeepSpeed is imported in this process)."""
    kept = {n: m for n, m in sys.modules.items() if n == "deepspeed" or n.startswith("deepspeed.")}
    for name in kept:
        del sys.modules[name]
    other = {n: types.ModuleType(n) for n in ("deepspeed", "deepspeed.zero", "deepspeed.runtime.engine")}
    for name, module in other.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules.update(other)
    yield other
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    sys.modules.update(kept)


def test_aliases_while_held_and_restores(other_deepspeed):
    outer = alias_deepspeed()
    inner = alias_deepspeed()
    import deepspeed

    assert deepspeed is fds
    from deepspeed.runtime.zero import partition_parameters as pp  # not imported before: found through fzero's

    assert pp is importlib.import_module("fzero.deepspeed.runtime.zero.partition_parameters")
    assert pp.__spec__.name == "fzero.deepspeed.runtime.zero.partition_parameters"  # fzero's module stays fzero's
    assert importlib.import_module("deepspeed.zero") is importlib.import_module("fzero.deepspeed.zero")
    with pytest.raises(NotImplementedError, match="deepspeed.moe.layer is not supported by fzero"):
        importlib.import_module("deepspeed.moe.layer")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.no_such_module")
    inner()
    inner()  # (a second release of one holder changes nothing)
    assert importlib.import_module("deepspeed") is fds  # the outer holder still holds
    outer()
    assert {n: sys.modules.get(n) for n in other_deepspeed} == other_deepspeed
    assert "deepspeed.runtime.zero.partition_parameters" not in sys.modules


def test_hf_config_holds_the_alias_while_it_lives(other_deepspeed):
    pytest.importorskip("transformers")
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from fzero.deepspeed.zero import HfDeepSpeedConfig

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert importlib.import_module("deepspeed") is fds and is_deepspeed_zero3_enabled()
    del config  # (collected at once: nothing else refers to it)
    assert sys.modules["deepspeed"] is other_deepspeed["deepspeed"] and not is_deepspeed_zero3_enabled()

"""`HfDeepSpeedConfig` for fzero: what tells Hugging Face transformers that ZeRO-3 is on, and that it is fzero's.

transformers decides whether `from_pretrained` builds the model under `deepspeed.zero.Init` and loads the
checkpoint through `GatheredParameters` by `is_deepspeed_zero3_enabled()`, which reads the object last registered
with `transformers.integrations.deepspeed.set_hf_deepspeed_config` (a weak reference: keep the object alive while
models are loaded). Its own `HfDeepSpeedConfig` demands the `deepspeed` and `accelerate` distributions; this one
registers itself, and, for as long as it lives, makes the `import deepspeed` inside transformers' functions give
`fzero.deepspeed` (`fzero.deepspeed.alias`), so that the model is built under fzero's `zero.Init`, even where
DeepSpeed is installed too. The one line a DeepSpeed script changes:

    from fzero.deepspeed.zero import HfDeepSpeedConfig   # was: from transformers.integrations.deepspeed import ...
    dschf = HfDeepSpeedConfig(ds_config)                 # keep it alive while models are loaded
    model = AutoModelForCausalLM.from_pretrained(path)   # built partitioned, loaded straight into the partitions
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from typing import Any

from ..alias import alias_deepspeed

__all__ = ["HfDeepSpeedConfig"]


class HfDeepSpeedConfig:
    """A DeepSpeed config that transformers can query (accelerate's `HfDeepSpeedConfig` interface).

    Args:
      config_file_or_dict: the config, a dict (copied) or the path of a JSON file.
    """

    def __init__(self, config_file_or_dict: dict[str, Any] | str | os.PathLike[str]) -> None:
        if isinstance(config_file_or_dict, dict):
            self.config = copy.deepcopy(config_file_or_dict)
        else:
            with open(config_file_or_dict) as f:
                self.config = json.load(f)
        if not isinstance(self.config, dict):
            raise ValueError(f"HfDeepSpeedConfig: {config_file_or_dict!r} does not hold a JSON object")
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {self.get_value(f"zero_optimization.offload_{x}.device") for x in ("optimizer", "param")}
        self._offload = self._stage in (2, 3) and bool(devices & {"cpu", "nvme"})
        try:
            from transformers.integrations.deepspeed import set_hf_deepspeed_config
        except ImportError:  # (no transformers: nothing to tell)
            return
        set_hf_deepspeed_config(self)
        weakref.finalize(self, alias_deepspeed())

    def find_config_node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        """The dict holding the dotted key `ds_key_long` (None if a level is missing), and its last part."""
        *nodes, key = ds_key_long.split(".")
        node: Any = self.config
        for name in nodes:
            node = node.get(name) if isinstance(node, dict) else None
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"Can't find {ds_key_long} entry in the config: {self.config}")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload

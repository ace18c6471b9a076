"""DeepSpeed JSON configs: load, validate against the declared schema, resolve the batch triad.

    >>> cfg = parse_config({"train_batch_size": 32, "gradient_accumulation_steps": 4,
    ...                     "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, world=2)
    >>> cfg.micro_batch, cfg.gas, cfg.stage, cfg.precision
    (4, 4, 2, 'bf16')

Errors name the key (`zero_optimization.stage: expected an integer in [0, 3], got 4 (int)`); unknown keys give one
`ConfigWarning` naming them all; known DeepSpeed features fzero does not implement raise `UnsupportedConfigError`.
The schema, with every key's default and meaning in fzero, is `fzero.config.deepspeed.SCHEMA` (and docs/engine.md).

May import: `fzero.host`, `fzero.sharding`, `fzero.state`, `fzero.optim`, `fzero.transforms`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import ItemsView, Iterator, KeysView
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..transforms.offload import Offload
from .batch import BatchSizeError, resolve_batch
from .deepspeed import SCHEMA
from .schema import ConfigError, ConfigTypeError, ConfigWarning, UnsupportedConfigError

__all__ = [
    "SCHEMA",
    "BatchSizeError",
    "Config",
    "ConfigError",
    "ConfigTypeError",
    "ConfigWarning",
    "UnsupportedConfigError",
    "load_json",
    "parse_config",
]


@dataclass(frozen=True)
class Config:
    """A validated DeepSpeed config for a given data-parallel world size.

    Attributes:
      values: every declared key, validated, defaults filled in (nested dicts).
      world: the data-parallel world size the batch triad was resolved for.
      train_batch_size, micro_batch, gas: the resolved batch triad.
      unknown: dotted paths of the keys fzero did not recognise.
      source: the file the config came from, if any.
    """

    values: dict[str, Any]
    world: int
    train_batch_size: int
    micro_batch: int
    gas: int
    unknown: tuple[str, ...] = ()
    source: str | None = None

    @property
    def stage(self) -> int:
        return self.values["zero_optimization"]["stage"]

    @property
    def precision(self) -> str:
        """'fp16', 'bf16' or 'fp32' (the model's own dtype)."""
        if self.values["fp16"]["enabled"]:
            return "fp16"
        return "bf16" if self.values["bf16"]["enabled"] else "fp32"

    @property
    def offload(self) -> bool:
        """Whether the optimizer runs on the CPU, its state in host memory or on disk."""
        return self.values["zero_optimization"]["offload_optimizer"]["device"] in ("cpu", "nvme")

    @property
    def offload_policy(self) -> str | Offload | None:
        """`shard_update`'s `offload`: None, "cpu", or an `fzero.Offload` from `offload_optimizer`, `offload_param`
        (stage 3) and `aio`. With the optimizer on NVMe the compute copy (`offload_param: nvme`) goes in its files,
        under its `nvme_path`; with the optimizer in memory or on the CPU it goes in files of its own under
        `offload_param.nvme_path`, with that block's `buffer_count` (as DeepSpeed, which swaps parameters with the
        `offload_param` block's settings)."""
        zero, aio = self.values["zero_optimization"], self.values["aio"]
        off, par = zero["offload_optimizer"], zero["offload_param"]
        speculate = off["super_offload"]
        params = "nvme" if zero["stage"] == 3 and par["device"] == "nvme" else None
        io = {"threads": aio["intra_op_parallelism"], "block_size": aio["block_size"]}
        if off["device"] == "nvme":
            return Offload("nvme", params=params, path=off["nvme_path"], buffers=off["buffer_count"],
                           speculate=speculate, **io)  # fmt: skip
        optimizer = "cpu" if off["device"] == "cpu" else None
        if params is not None:
            return Offload(optimizer, params=params, path=par["nvme_path"], buffers=par["buffer_count"],
                           speculate=speculate, **io)  # fmt: skip
        if speculate:
            return Offload("cpu", speculate=True)
        return optimizer

    @property
    def gradient_clipping(self) -> float:
        return self.values["gradient_clipping"]

    @property
    def steps_per_print(self) -> int | None:
        return self.values["steps_per_print"]

    @property
    def wall_clock_breakdown(self) -> bool:
        return self.values["wall_clock_breakdown"]

    # DeepSpeed's `engine.config` is the config dict, read as one (transformers: `config.get("zero_optimization",
    # {}).get("stage")`): the validated values answer, defaults filled in
    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def keys(self) -> KeysView[str]:
        return self.values.keys()

    def items(self) -> ItemsView[str, Any]:
        return self.values.items()


def load_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON config file as a dict, with errors that name the file (and the line of a syntax error)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {str(p)!r} does not exist (or is not a file)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("", f"{p}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{p}: not a UTF-8 text file ({e.reason})") from None
    if not isinstance(data, dict):
        raise ConfigTypeError("", f"{p}: the config must be a JSON object, got a {type(data).__name__}")
    return data


def parse_config(config: dict[str, Any] | str | os.PathLike[str], world: int = 1, *, warn: bool = True) -> Config:
    """Validate a DeepSpeed config (a dict or a JSON file's path) and resolve its batch triad for `world` ranks.

    Args:
      config: the config dict, or the path of a JSON file.
      world: the data-parallel world size.
      warn: emit one `ConfigWarning` naming the unknown keys.

    Raises:
      ConfigError (a ValueError; ConfigTypeError is also a TypeError, UnsupportedConfigError also a
      NotImplementedError) naming the offending key; FileNotFoundError for a missing file.
    """
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        config = load_json(config)
    if not isinstance(config, dict):
        raise ConfigTypeError("", f"the config must be a dict or a JSON file's path, got {type(config).__name__}")
    unknown: list[str] = []
    values = SCHEMA.validate(config, "", unknown)
    tbs, mb, gas = resolve_batch(
        values["train_batch_size"], values["train_micro_batch_size_per_gpu"], values["gradient_accumulation_steps"],
        world,
    )  # fmt: skip
    if unknown and warn:
        where = f" in {source}" if source else ""
        warnings.warn(
            f"fzero ignores unknown DeepSpeed config keys{where}: {', '.join(sorted(unknown))}",
            ConfigWarning,
            stacklevel=2,
        )
    return Config(values, world, tbs, mb, gas, tuple(sorted(unknown)), source)

"""Random-LTD in the engine: DeepSpeed 0.19.8's `RandomLTDScheduler`, `RandomLayerTokenDrop` and the engine's
`random_ltd_*` methods, over the pure schedule and token selection of `fzero.optim.random_ltd`.

A DeepSpeed script enables it in the config (`data_efficiency.data_routing.random_ltd`, parsed by
`fzero.config.data_routing`) and wraps its layers after `initialize`:

    engine, *_ = deepspeed.initialize(model=model, config=cfg, ...)
    engine = convert_to_random_ltd(engine, GPT2Block)      # wraps every GPT2Block, then engine.random_ltd_initialize()
    ...
    engine.random_ltd_scheduler.get_current_seq()           # this step's kept tokens

What follows DeepSpeed exactly: the scheduler's state and arithmetic (`update_seq(global_steps)` at every training
forward of the engine; `consumed_layer_tokens`); which wrapped layers are configured (`random_ltd_initialize`: the
wrapped modules in `named_modules()` order whose path contains the next of the sorted `random_ltd_layer_id` as a
substring, DeepSpeed's own matching); the first configured layer draws the kept tokens of every layer for the
micro-batch (`torch.multinomial`, so the same generator state gives DeepSpeed's tokens) and the others reuse them;
a decoder's mask is the leading `kept x kept` block, an encoder's is gathered per layer; nothing is dropped in eval
mode or once the whole sequence is kept.

Where fzero differs, on purpose:

- the wrapper keeps the layer's parameter paths: it adopts the layer's parameter, buffer and submodule tables rather
  than holding the layer as a child `random_ltd_layer` (still its attribute). The engine's layout, checkpoints and
  stage-3 units are named by those paths, so they stay valid after the wrapping, and at stage 3 the unit whose module
  was the layer now has the wrapper at its path: its gather hooks fire around the wrapper's forward, which runs the
  layer inside them. `state_dict()` keys therefore have no `.random_ltd_layer` part (`remove_random_ltd_state_dict`
  leaves them as they are);
- the layer may be called with positional arguments after the hidden states (transformers 5's GPT-2 passes the mask
  third, positionally): the mask named `model_mask_name` is found by the layer's signature. DeepSpeed's wrapper takes
  keywords only and fails with a `TypeError` there;
- the scheduler's state is saved in the engine's checkpoints as JSON, a part of the engine's own record (its
  `"random_ltd"`, where DeepSpeed's checkpoint has its top-level `random_ltd` entry: `fzero.engine.checkpointing`),
  never in the caller's client state, and restored by `load_checkpoint` unless `load_module_only`, as DeepSpeed's;
  DeepSpeed's token-gather kernels are torch indexing (`fzero.optim.random_ltd`).
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..config.data_keys import RANDOM_LTD as RANDOM_LTD_KEY
from ..config.data_keys import RANDOM_LTD_ATTENTION_MASK as ATTENTION_MASK
from ..config.data_keys import RANDOM_LTD_CONSUMED_LAYER_TOKENS as CONSUMED
from ..config.data_keys import RANDOM_LTD_CURR_STEP as CURR_STEP
from ..config.data_keys import RANDOM_LTD_CURRENT_VALUE as CURRENT
from ..config.data_keys import RANDOM_LTD_MAX_VALUE as MAX
from ..config.data_keys import RANDOM_LTD_MIN_VALUE as MIN
from ..config.data_keys import RANDOM_LTD_SAMPLE_INDEX as SAMPLE_INDEX
from ..config.data_keys import RANDOM_LTD_SCHEDULE_CONFIG as SCHEDULE_CONFIG
from ..config.data_keys import RANDOM_LTD_SCHEDULER_TYPE as SCHEDULE_TYPE
from ..optim import random_ltd as ltd
from .checkpointing import CheckpointMethods

__all__ = ["RANDOM_LTD_KEY", "RandomLTD", "RandomLTDScheduler", "RandomLayerTokenDrop"]

# RANDOM_LTD_KEY: the scheduler's state's name among the engine's checkpoint parts (DeepSpeed's checkpoint key too)
_DISABLED = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
_SAVED = (CONSUMED, CURR_STEP, CURRENT, MIN, MAX)


class RandomLTDScheduler:
    """DeepSpeed's `RandomLTDScheduler`: the kept sequence length and the layer-tokens consumed, in its `state` dict
    (DeepSpeed's keys), updated once per training forward of the engine (`update_seq(global_steps)`).

    Attributes:
      model_layer_num, random_ltd_layer_num: the model's layers and how many of them drop tokens.
      global_batch_size: sequences per optimizer step (the engine sets it to `train_batch_size`).
      state: `min_value`, `max_value`, `current_value`, `schedule_config`, `schedule_type`, `consumed_layer_tokens`,
        `current_steps`; while a micro-batch runs, `sample_idx` and `attention_mask` (the first wrapped layer's
        draw, which the others reuse).
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        """Args:
        config: the validated `random_ltd` block (`engine.random_ltd_config()`), with `global_batch_size`.

        Raises:
          NotImplementedError: `layer_token_lr_schedule.enabled` (DeepSpeed's "Work In Progress" too).
        """
        self.state: dict[str, Any] = {}
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        self.reset_to_init()
        if config["layer_token_lr_schedule"]["enabled"]:
            raise NotImplementedError(
                "random_ltd.layer_token_lr_schedule.enabled: the layer-token learning-rate schedule is not "
                "implemented (DeepSpeed 0.19.8 raises NotImplementedError too)"
            )

    def reset_to_init(self) -> None:
        """The state at step -1: the minimum kept length, nothing consumed."""
        if self.config_schedule is not None:
            for key in (MIN, MAX, SCHEDULE_CONFIG, SCHEDULE_TYPE):
                self.state[key] = self.config_schedule[key]
            self.state[CURRENT] = self.config_schedule[MIN]
        self.state[CONSUMED] = 0
        self.state[CURR_STEP] = -1

    def get_value(self, global_steps: int) -> int:
        """The schedule's kept length at `global_steps` (`fzero.optim.random_ltd.FixedLinear`), from the state's
        current minimum and maximum."""
        if self.state[SCHEDULE_TYPE] != "fixed_linear":
            raise RuntimeError(f"Unsupported random LTD schedule type {self.state[SCHEDULE_TYPE]!r}: 'fixed_linear'")
        cfg = self.state[SCHEDULE_CONFIG]
        return ltd.FixedLinear(self.state[MIN], self.state[MAX], cfg["require_steps"], cfg["seq_per_step"])(
            global_steps
        )

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The layer-tokens consumed after `train_iters` steps from this state (DeepSpeed's; it advances the state)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[CONSUMED]

    def get_current_seq(self) -> int:
        return self.state[CURRENT]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[CURRENT] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        """DeepSpeed's: the kept length at `global_steps` (until it reaches the maximum), and, once per step, that
        step's layer-tokens added to `consumed_layer_tokens`."""
        if self.state[CURRENT] < self.state[MAX]:
            self.state[CURRENT] = self.get_value(global_steps)
        if global_steps != self.state[CURR_STEP]:
            self.state[CONSUMED] += ltd.layer_tokens(
                self.state[CURRENT], max_value=self.state[MAX], total_layers=self.model_layer_num,
                dropping_layers=self.random_ltd_layer_num, batch=self.global_batch_size,
            )  # fmt: skip
            self.state[CURR_STEP] = global_steps

    def state_dict(self) -> dict[str, int]:
        """The saved state (DeepSpeed's five keys; JSON integers)."""
        return {key: self.state[key] for key in _SAVED}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s keys.

        Raises:
          KeyError: one of them is missing (named).
        """
        missing = [key for key in _SAVED if key not in state_dict]
        if missing:
            raise KeyError(f"random-LTD scheduler state misses {missing} (expected the keys {list(_SAVED)})")
        for key in _SAVED:
            self.state[key] = state_dict[key]


class RandomLayerTokenDrop(nn.Module):
    """DeepSpeed's random-LTD layer wrapper: once configured (`init_config`, by `engine.random_ltd_initialize()`),
    a training forward runs `layer` on the scheduler's kept tokens only (see the module docstring).

    The wrapper shares `layer`'s parameter, buffer and submodule tables, so every path below it is the layer's own
    (`random_ltd_layer` is the layer, an attribute, not a child); `train()` / `eval()` reach the layer too.
    """

    random_ltd_layer: nn.Module

    def __init__(self, layer: nn.Module) -> None:
        """Args:
        layer: the layer to wrap (e.g. a transformer block); its forward takes the hidden states first."""
        super().__init__()
        if isinstance(layer, RandomLayerTokenDrop):
            raise ValueError("RandomLayerTokenDrop: the layer is wrapped already")
        # the layer's own tables, the same dict objects: its paths, hooks on its submodules and `.to()` are unchanged
        for table in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, table, getattr(layer, table))
        object.__setattr__(self, "random_ltd_layer", layer)  # (an attribute: a child would change every path)
        self.training = layer.training
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.max_length: int | None = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False
        self.random_ltd_layer_id = -1
        self._mask_slot: int | None = None

    def init_config(self, config: Mapping[str, Any], scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        """Configure the wrapper (DeepSpeed's; `engine.random_ltd_initialize()` calls it).

        Args:
          config: the validated `random_ltd` block.
          scheduler: the engine's scheduler.
          random_ltd_layer_id: this layer's place among the wrapped layers (0 draws the tokens).

        Raises:
          NotImplementedError: a `hidden_state_order` or `model_type` DeepSpeed does not support.
        """
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state[MAX]
        self.mask_name = config["model_mask_name"]
        self.micro_bs = config.get("micro_batch_size")
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        order, self.model_type = config["hidden_state_order"], config["model_type"]
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise NotImplementedError(f"random_ltd.hidden_state_order {order!r}: 'batch_seq_dim' or 'seq_batch_dim'")
        if self.model_type not in ("encoder", "decoder"):
            raise NotImplementedError(f"random_ltd.model_type {self.model_type!r}: 'encoder' or 'decoder'")
        self.batch_first = order == "batch_seq_dim"
        self._mask_slot = self._positional_slot(self.mask_name)

    def _positional_slot(self, name: str | None) -> int | None:
        """Where argument `name` of the layer's forward sits among the positional arguments after the hidden states
        (None: keyword only, or not a parameter)."""
        if name is None:
            return None
        try:
            params = list(inspect.signature(self.random_ltd_layer.forward).parameters.values())
        except (TypeError, ValueError):
            return None
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return positional.index(name) - 1 if name in positional[1:] else None

    def get_bsh(self, hidden_stats: Tensor) -> None:
        self.curr_seq, self.curr_micro_batch = hidden_stats.size()[1], hidden_stats.size()[0]

    def get_sbh(self, hidden_stats: Tensor) -> None:
        self.curr_seq, self.curr_micro_batch = hidden_stats.size()[0], hidden_stats.size()[1]

    def train(self, mode: bool = True) -> RandomLayerTokenDrop:
        super().train(mode)
        self.random_ltd_layer.training = mode  # (its children are this module's: set already)
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.random_ltd_layer._save_to_state_dict(destination, prefix, keep_vars)  # (the layer's own extra state)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self.random_ltd_layer._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return f"layer={type(self.random_ltd_layer).__name__}"

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        """The layer on the kept tokens (training, configured, fewer kept than the sequence), else the layer.

        Raises:
          NotImplementedError: the layer returned neither a tensor nor a tuple starting with one.
          ValueError: an encoder without its attention mask.
        """
        scheduler = self.random_ltd_scheduler
        if scheduler is not None:
            self.reserved_length = scheduler.get_current_seq()
            (self.get_bsh if self.batch_first else self.get_sbh)(hidden_states)
        layer = self.random_ltd_layer
        if not (self.training and scheduler is not None and self.reserved_length < self.curr_seq):
            return layer(hidden_states, *args, **kwargs)
        slot = self._mask_slot
        in_args = slot is not None and self.mask_name not in kwargs and slot < len(args)
        mask = None
        if in_args:
            assert slot is not None  # (in_args)
            mask = args[slot]
        elif self.mask_name is not None:
            mask = kwargs.get(self.mask_name)
        if self.random_ltd_layer_id == 0:
            indices, part_mask = self._sample(hidden_states, mask)
            scheduler.state[SAMPLE_INDEX], scheduler.state[ATTENTION_MASK] = indices, part_mask
        else:
            indices, part_mask = scheduler.state[SAMPLE_INDEX], scheduler.state[ATTENTION_MASK]
        if self.mask_name is not None:
            part = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
            if in_args:
                assert slot is not None  # (in_args)
                args = (*args[:slot], part, *args[slot + 1 :])
            elif self.mask_name in kwargs:
                kwargs[self.mask_name] = part
        rows = indices[self.random_ltd_layer_id]
        part_hidden = ltd.gather_tokens(hidden_states, rows, batch_first=self.batch_first)
        outputs = layer(part_hidden, *args, **kwargs)
        if isinstance(outputs, Tensor):
            return ltd.scatter_tokens(hidden_states, outputs, rows, batch_first=self.batch_first)
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], Tensor):
            merged = ltd.scatter_tokens(hidden_states, outputs[0], rows, batch_first=self.batch_first)
            return (merged, *outputs[1:])
        raise NotImplementedError(
            f"RandomLayerTokenDrop: {type(layer).__name__} returned {type(outputs).__name__}; random-LTD supports "
            "layers returning a tensor or a tuple whose first item is the hidden states (as DeepSpeed's)"
        )

    def _sample(self, hidden_states: Tensor, mask: Tensor | None) -> tuple[Tensor, Any]:
        """The kept tokens of every wrapped layer `[layers, batch, kept]` and their mask (DeepSpeed's
        `gpt_sample_tokens` / `bert_sample_tokens`)."""
        kept, seq, batch, layers = self.reserved_length, self.curr_seq, self.curr_micro_batch, self.random_ltd_num_layer
        indices = ltd.sample_tokens(kept, seq, batch, layers, device=hidden_states.device)
        if self.model_type == "decoder":
            return indices, ltd.causal_mask(mask, kept)
        if mask is None:
            raise ValueError(
                f"random-LTD with model_type 'encoder' needs the attention mask: the layer's argument "
                f"{self.mask_name!r} (random_ltd.model_mask_name) was not passed"
            )
        return indices, [ltd.gather_mask(mask, indices[i]) for i in range(layers)]


# ---------------------------------------------------------------------------------------------- the engine's mixin
class RandomLTD(CheckpointMethods):
    """The engine's `random_ltd_*` methods and the scheduler's place in its forward and checkpoints (a mixin of
    `fzero.Engine`, before `CheckpointMethods`; the engine provides `config`, `module` and `global_steps`)."""

    config: Any
    global_steps: int
    _micro: Any

    @property
    def module(self) -> nn.Module:  # (the engine's)
        raise NotImplementedError

    def random_ltd_enabled(self) -> bool:
        """Whether the config enables random-LTD (`data_efficiency.data_routing.random_ltd.enabled`; DeepSpeed reads
        that flag alone)."""
        return bool(self._random_ltd_block()["enabled"])

    def _random_ltd_block(self) -> Mapping[str, Any]:
        efficiency = self.config.values.get("data_efficiency") or {}
        routing = efficiency.get("data_routing") or {}
        return routing.get("random_ltd") or _DISABLED

    def random_ltd_config(self) -> dict[str, Any]:
        """The `random_ltd` block, with `global_batch_size` and `micro_batch_size` set from the engine's batch
        sizes once random-LTD is enabled (as DeepSpeed's engine sets them)."""
        cached = self.__dict__.get("_random_ltd_cfg")
        if cached is not None:
            return cached
        cfg = dict(self._random_ltd_block())
        if cfg["enabled"]:
            cfg["global_batch_size"] = self.config.train_batch_size
            cfg["micro_batch_size"] = self.config.micro_batch
            self.__dict__["_random_ltd_cfg"] = cfg
        return cfg

    @property
    def random_ltd_scheduler(self) -> RandomLTDScheduler:
        """The engine's `RandomLTDScheduler` (random-LTD enabled only)."""
        scheduler = self.__dict__.get("_random_ltd_scheduler")
        if scheduler is None:
            if not self.random_ltd_enabled():
                raise RuntimeError(
                    "engine.random_ltd_scheduler: random-LTD is not enabled in the config "
                    "(data_efficiency.data_routing.random_ltd.enabled)"
                )
            scheduler = self.__dict__["_random_ltd_scheduler"] = RandomLTDScheduler(self.random_ltd_config())
        return scheduler

    @random_ltd_scheduler.setter
    def random_ltd_scheduler(self, scheduler: RandomLTDScheduler) -> None:
        self.__dict__["_random_ltd_scheduler"] = scheduler

    def random_ltd_initialize(self) -> None:
        """Configure the model's `RandomLayerTokenDrop` wrappers (`convert_to_random_ltd` calls it): in
        `named_modules()` order, a wrapper whose path contains the next of the sorted `random_ltd_layer_id` (as a
        substring, DeepSpeed's rule) gets the next layer index.

        Raises:
          RuntimeError: random-LTD is not enabled, or a forward of the engine is in flight (before its `step()`).
          ValueError: the number of wrappers configured is not `random_ltd_layer_num`.
        """
        if not self.random_ltd_enabled():
            raise RuntimeError(
                "random_ltd_initialize(): random-LTD is not enabled in the config: set "
                "data_efficiency.data_routing.random_ltd.enabled (DeepSpeed asserts it)"
            )
        if self._micro is not None:
            raise RuntimeError(
                "random_ltd_initialize(): called between an engine(...) forward and its engine.step(); wrap the "
                "layers before training or between steps"
            )
        cfg = self.random_ltd_config()
        queue = deque(sorted(cfg["random_ltd_layer_id"]))
        count, wrapped = 0, []
        for name, layer in self.module.named_modules():
            if isinstance(layer, RandomLayerTokenDrop):
                wrapped.append(name)
                if queue and str(queue[0]) in name:
                    layer.init_config(cfg, self.random_ltd_scheduler, count)
                    queue.popleft()
                    count += 1
        if cfg["random_ltd_layer_num"] != count:
            raise ValueError(
                f"random_ltd.random_ltd_layer_num is {cfg['random_ltd_layer_num']} but {count} wrapped layers matched "
                f"random_ltd_layer_id {cfg['random_ltd_layer_id']} (a wrapped layer matches where its path contains "
                f"the next id, in order; wrapped: {wrapped[:6]}{' ...' if len(wrapped) > 6 else ''})"
            )

    def _random_ltd_forward(self) -> None:
        """The scheduler's update at a training forward of the engine (DeepSpeed's `_forward_prologue`)."""
        if self.module.training and self.random_ltd_enabled():
            self.random_ltd_scheduler.update_seq(self.global_steps)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _checkpoint_parts(self) -> dict[str, Any]:
        """`CheckpointMethods._checkpoint_parts`, with the scheduler's state (`"random_ltd"`) where random-LTD is
        enabled (see the module docstring)."""
        parts = super()._checkpoint_parts()
        if self.random_ltd_enabled():
            parts[RANDOM_LTD_KEY] = self.random_ltd_scheduler.state_dict()
        return parts

    def _restore_checkpoint_parts(self, parts: Mapping[str, Any], where: str) -> None:
        """`CheckpointMethods._restore_checkpoint_parts`: the scheduler's state, where the checkpoint has one and
        random-LTD is enabled.

        Raises:
          KeyError: the saved state misses one of the scheduler's keys (naming the checkpoint and the keys).
        """
        super()._restore_checkpoint_parts(parts, where)
        saved = parts.get(RANDOM_LTD_KEY)
        if saved is not None and self.random_ltd_enabled():
            try:
                self.random_ltd_scheduler.load_state_dict(saved)
            except KeyError as e:
                raise KeyError(f"{where}: {e.args[0]}") from None

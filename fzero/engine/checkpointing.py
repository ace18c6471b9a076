"""DeepSpeed's `engine.save_checkpoint` / `engine.load_checkpoint` (`CheckpointMethods`, the engine's), on top of
`fzero.save` / `fzero.load`.

There is one checkpoint format (see ``docs/checkpoints.md``); the engine adds what only it knows to the format's
JSON fields:

    user_state = {"client_state": <the caller's client_state>,
                  "engine": {"format": "fzero-engine", "version": 1, "global_steps": ..., "global_samples": ...,
                             "micro_steps": ..., "skipped_steps": ..., "gradient_accumulation_steps": ..., ...,
                             "parts": {"random_ltd": ..., "curriculum_legacy": ..., "data_sampler": ...}}}
    config     = the validated DeepSpeed config (every key, defaults filled in)
    data_position = micro_steps (micro-batches each rank has consumed)

`parts` holds the JSON state of the engine's parts that run beside the training state, by name: the random-LTD
scheduler's (`fzero.engine.random_ltd`), the legacy curriculum scheduler's and the curriculum data sampler's
(`fzero.engine.curriculum`), each where the config enables it (`_checkpoint_parts`, which those mixins extend).
`load_checkpoint` gives each part its state back (`_restore_checkpoint_parts`) unless `load_module_only`; a part the
loading engine does not run is ignored, and a record without `parts` (written before it existed) restores none. The
caller's `client_state` is the caller's alone: no key of it is reserved.

Everything numeric (parameters, optimizer moments and update count, hence the LR schedule, the accumulation window,
the loss scale) is a leaf of the `TrainState`, saved and resharded by the format. Which leaves a load takes:

    load_module_only=True          params, compute, frozen/*, buffers/*           (the rest: the engine's own)
    load_optimizer_states=False    everything but the optimizer's state (tx_state/shard_update/*)
    default                        everything

`save_checkpoint(exclude_frozen_parameters=True)` (how PEFT saves) writes the state without its frozen parameters:
the checkpoint's layout has none (`without_frozen`), so `fzero.consolidate` gives the trainable parameters and the
buffers, and `load_checkpoint(..., load_module_strict=False)` loads the rest, the frozen parameters staying the
engine's own (the live model's), as DeepSpeed's does; with `load_module_strict=True` that load raises, as
DeepSpeed's does (its model's state_dict misses them).

At stages 1-3 rank 0 also writes `zero_to_fp32.py` beside the tagged checkpoints, as DeepSpeed does: fzero's
(`fzero.engine.zero_to_fp32`), which consolidates a checkpoint into safetensors with `fzero.consolidate`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ..checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    SaveHandle,
    read_manifest,
    rng,
)
from ..checkpoint import load as fzero_load
from ..checkpoint import resolve as resolve_checkpoint
from ..checkpoint import save as fzero_save
from ..checkpoint.coord import Coordinator
from ..state import TrainState
from .counters import Checkpointable, EngineCounters

__all__ = ["ENGINE_FORMAT", "CheckpointMethods", "check_json", "optimizer_prefix", "without_frozen"]

ENGINE_FORMAT = "fzero-engine"
ENGINE_VERSION = 1
_MODULE_ROOTS = ("params", "compute", "frozen", "buffers")


class _Engine(Checkpointable, Protocol):
    """What the checkpoints read: `Checkpointable`, and the state of the engine's parts (`CheckpointMethods`)."""

    def _checkpoint_parts(self) -> dict[str, Any]: ...

    def _restore_checkpoint_parts(self, parts: Mapping[str, Any], where: str) -> None: ...


def check_json(value: Any, where: str) -> None:
    """Raise if `value` would not come back from JSON as it went in, naming the offending key.

    Accepted: None, bool, int, finite float, str, lists and tuples of these (tuples come back as lists), and dicts
    with string keys. Anything else (a tensor, a NumPy scalar, NaN, an int key) raises.

    Raises:
      TypeError: a value or key of another type; ValueError: NaN or infinity.
    """
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}: JSON has no NaN or infinity (store it as a string)")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}): JSON keys are strings, and it would come "
                    "back as one; use str keys"
                )
            check_json(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]")
        return
    hint = " (use .item() or .tolist())" if isinstance(value, torch.Tensor) else ""
    raise TypeError(
        f"{where} is a {type(value).__name__}, which is not JSON-serialisable{hint}: checkpoints never pickle; "
        "store numbers, strings, lists and dicts"
    )


# ------------------------------------------------------------------------------------------------------------ save
def _hypers(engine: Checkpointable) -> list[dict[str, Any]]:
    """The hyper-parameters a client scheduler moves (lr, betas), per param group, as JSON."""
    groups = []
    for group in engine.optimizer.param_groups:
        g: dict[str, Any] = {}
        if "lr" in group:
            g["lr"] = float(group["lr"])
        if "betas" in group:
            g["betas"] = [float(b) for b in group["betas"]]
        groups.append(g)
    return groups


def _record(engine: _Engine) -> dict[str, Any]:
    """What the engine knows beyond the `TrainState`: DeepSpeed's counters, the open window's losses and the state
    of its parts (see the module docstring)."""
    scheduler = None
    if engine.client_scheduler is not None and hasattr(engine.client_scheduler, "state_dict"):
        scheduler = engine.client_scheduler.state_dict()
        check_json(scheduler, "lr_scheduler.state_dict()")
    parts = engine._checkpoint_parts()
    check_json(parts, "the engine's parts' state")
    return {
        "format": ENGINE_FORMAT,
        "version": ENGINE_VERSION,
        **engine.counters.to_json(),
        "gradient_accumulation_steps": engine.config.gas,
        "train_batch_size": engine.config.train_batch_size,
        "world": engine.mesh.world,
        "stage": engine.config.stage,
        "overflow": bool(engine.optimizer.overflow),
        "param_groups": _hypers(engine),
        "lr_scheduler": scheduler,
        "parts": parts,
    }


def _agree_on_tag(engine: Checkpointable, tag: str) -> None:
    """DeepSpeed validates the tag across ranks; different tags would make the ranks write different directories."""
    if len(engine.mesh.local_ranks) == engine.mesh.world:  # (this process holds every rank: one tag)
        return
    coord = Coordinator(engine.mesh, distributed=True, world=engine.mesh.world, device=engine.state.params.device)
    tags = coord.exchange(tag)
    if len(set(tags)) != 1:
        raise CheckpointError(
            f"save_checkpoint: the ranks passed different tags ({', '.join(map(repr, tags))}, by rank); every rank "
            "must save under the same tag"
        )


def without_frozen(state: TrainState) -> TrainState:
    """`state` without its frozen parameters: no `frozen` leaf, and a layout without them (nor their tied names),
    so that a checkpoint of it describes the trainable model only."""
    layout = state.layout
    if layout.frozen_layout is None:
        return state
    names = {leaf.name for leaf in layout.frozen_layout.leaves}
    aliases = tuple((alias, name) for alias, name in layout.aliases if name not in names)
    return state.replace(frozen=None, layout=dataclasses.replace(layout, frozen_layout=None, aliases=aliases))


def _write_script(save_dir: str | os.PathLike[str]) -> None:
    """fzero's `zero_to_fp32.py` into `save_dir`, executable, as DeepSpeed copies its own there."""
    source = Path(__file__).with_name("zero_to_fp32.py")  # (copied as a file, never imported here)
    target = Path(save_dir) / "zero_to_fp32.py"
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------------ load
def _is_module(key: str) -> bool:
    return key.split("/", 1)[0] in _MODULE_ROOTS


def optimizer_prefix(state: Any) -> str | None:
    """The checkpoint keys' prefix of the optimizer's state (the plan's `update` role, whatever its name), e.g.
    ``"tx_state/shard_update/"``; None for a chain without one."""
    path = state.plan.path_of("update")
    return None if path is None else "/".join(("tx_state", *path)) + "/"


def _optimizer_keys(state: Any) -> Any:
    """Whether a checkpoint key is the optimizer's state."""
    prefix = optimizer_prefix(state)
    return lambda key: prefix is not None and key.startswith(prefix)


def _accumulated(state: Any) -> int | None:
    """The chain's micro-steps held since the last boundary (None without accumulation)."""
    acc = state.plan.state_of(state.tx_state, "accumulate")
    return None if acc is None or not hasattr(acc, "count") else int(acc.count)


def _counters(engine: Checkpointable, record: dict[str, Any] | None, step: int, tag: str) -> dict[str, int]:
    """The engine's counters after the load: the saved ones (re-based when the accumulation steps changed)."""
    gas = engine.config.gas
    if record is None:  # a plain fzero.save checkpoint: the state's micro-step count is all there is
        micro = step
        saved_gas = gas
        record = {"global_steps": micro // gas, "skipped_steps": 0, "applied_updates": micro // gas}
        record["global_samples"] = record["global_steps"] * engine.config.train_batch_size
    else:
        micro, saved_gas = record["micro_steps"], record["gradient_accumulation_steps"]
    if saved_gas != gas:
        if micro % saved_gas:
            raise IncompatibleCheckpointError(
                f"checkpoint {tag!r} was saved inside a gradient accumulation window (micro-step {micro % saved_gas} "
                f"of {saved_gas}); this engine accumulates {gas}: load it with gradient_accumulation_steps="
                f"{saved_gas}, or save at an accumulation boundary"
            )
        micro = record["global_steps"] * gas  # the boundary falls where the new accumulation expects it
    return {
        "global_steps": record["global_steps"],
        "global_samples": record["global_samples"],
        "micro_steps": micro,
        "skipped_steps": record["skipped_steps"],
        "applied_updates": record["applied_updates"],
    }


def _engine_record(user_state: Any, where: str) -> tuple[dict[str, Any] | None, Any]:
    """The engine block and the client state of a checkpoint's user state (None, user state: a plain save)."""
    if isinstance(user_state, dict) and isinstance(user_state.get("engine"), dict):
        record = user_state["engine"]
        if record.get("format") != ENGINE_FORMAT:
            raise IncompatibleCheckpointError(f"{where}: user_state['engine'] is not an fzero engine record")
        if not isinstance(record.get("version"), int) or record["version"] > ENGINE_VERSION:
            raise IncompatibleCheckpointError(
                f"{where}: engine record version {record.get('version')!r}; this fzero reads up to {ENGINE_VERSION}"
            )
        return record, user_state.get("client_state", {})
    return None, user_state


def _check_frozen_excluded(path: Path, state: TrainState, strict: bool) -> None:
    """A checkpoint without the frozen parameters loads only with `load_module_strict=False` (DeepSpeed's rule)."""
    if strict:
        assert state.layout.frozen_layout is not None  # (the caller's condition)
        names = [leaf.name for leaf in state.layout.frozen_layout.leaves]
        shown = ", ".join(map(repr, names[:5])) + (" ..." if len(names) > 5 else "")
        raise IncompatibleCheckpointError(
            f"{path} was saved without the frozen parameters (save_checkpoint(exclude_frozen_parameters=True)): it "
            f"misses {shown}; load it with load_checkpoint(..., load_module_strict=False) to keep the model's own "
            "(DeepSpeed's rule too)"
        )


# --------------------------------------------------------------------------------------------------- the methods
class CheckpointMethods:
    """DeepSpeed's `save_checkpoint` and `load_checkpoint`, for an engine (`Checkpointable`: `fzero.Engine`)."""

    pending_checkpoint: SaveHandle | None = None  # the background save in flight (`save_checkpoint(blocking=False)`)

    def _checkpoint_parts(self) -> dict[str, Any]:
        """The JSON state of the engine's parts beside the training state, by name (the record's `parts`; see the
        module docstring). None here: a mixin with a part of its own adds its entry to `super()`'s."""
        return {}

    def _restore_checkpoint_parts(self, parts: Mapping[str, Any], where: str) -> None:
        """Give the engine's parts their saved state (`parts`, from checkpoint `where`, named in errors). None here:
        a mixin with a part of its own takes its entry, where it runs, and calls `super()`."""

    def wait_for_checkpoint(self) -> Path | None:
        """fzero only: wait for the engine's background save, if any (every rank calls it: they raise alike).

        Returns:
          Its checkpoint directory; None when no save was in flight.

        Raises:
          CheckpointError: the save failed; nothing became visible.
        """
        handle, self.pending_checkpoint = self.pending_checkpoint, None
        return None if handle is None else handle.wait()

    def save_checkpoint(
        self: _Engine,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        overwrite: bool = True,
        blocking: bool | None = None,
    ) -> bool:
        """DeepSpeed's `save_checkpoint`: the training state, the counters, the config and `client_state`, written
        with `fzero.save` to ``save_dir/tag`` (every rank calls it; see ``docs/checkpoints.md``).

        Allowed after any `step()`, inside an accumulation window too (the window's partial sums are part of the
        state); not between a `backward` and its `step` (those gradients are not).

        Args:
          save_dir: the root of tagged checkpoints.
          tag: the checkpoint's name (`str(tag)`); default ``global_step{global_steps}``, as DeepSpeed's.
          client_state: a JSON-serialisable dict, returned by `load_checkpoint` (rank 0's is kept; tuples come
            back as lists).
          save_latest: point ``save_dir/latest`` at this checkpoint.
          exclude_frozen_parameters: leave the frozen parameters out (see the module docstring).
          overwrite: fzero only: replace an existing checkpoint of the same tag (atomically), as DeepSpeed writes
            over it; False makes that an error.
          blocking: fzero only: False returns once the state is copied to host memory and writes it in the
            background (`fzero.save(blocking=False)`; `engine.pending_checkpoint` is its handle); default: the
            config's ``checkpoint.writer.decoupled``, as DeepSpeed's decoupled writer. A background save's failure
            is raised by the engine's next `save_checkpoint`, `load_checkpoint` or `destroy` (and printed when it
            happens), on every rank alike.

        Returns:
          True, as DeepSpeed's (the checkpoint is ``save_dir/tag``; errors raise).
        """
        self.check_between_steps("save_checkpoint")
        self.wait_for_checkpoint()
        client_state = {} if client_state is None else client_state
        if not isinstance(client_state, Mapping):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
        check_json(client_state, "client_state")
        # DeepSpeed's default, and str(tag)
        tag = f"global_step{self.counters.global_steps}" if tag is None else str(tag)
        _agree_on_tag(self, tag)
        user_state = {"client_state": dict(client_state), "engine": _record(self)}
        check_json(self.config.values, "config")
        if blocking is None:
            blocking = not (self.config["checkpoint"]["writer"] or {}).get("decoupled", False)
        saved = fzero_save(
            without_frozen(self.state) if exclude_frozen_parameters else self.state,
            save_dir,
            mesh=self.mesh,  # (read only where the ranks run in processes of their own: `fzero.save`)
            tag=tag,
            data_position=self.counters.micro_steps,
            user_state=user_state,
            config=self.config.values,
            latest=save_latest,
            overwrite=overwrite,
            blocking=blocking,
        )
        self.pending_checkpoint = None if blocking else saved
        if self.config.stage >= 1 and self.mesh.rank == 0:  # (DeepSpeed writes it with its ZeRO checkpoint files)
            _write_script(save_dir)
        return True

    def load_checkpoint(
        self: _Engine,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
        *,
        restore_rng: bool | None = None,
        verify: bool = True,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's `load_checkpoint`, from any world size and stage (the format reshards).

        Args:
          load_dir: the root of tagged checkpoints (or one checkpoint directory).
          tag: which checkpoint; None: the one ``load_dir/latest`` names.
          load_module_strict: False lets a checkpoint saved with `exclude_frozen_parameters=True` load, the frozen
            parameters staying the engine's; True refuses it, as DeepSpeed's does. Either way the checkpoint must
            be of this model (fzero loads whole flat buffers, not a subset of another model's tensors).
          load_optimizer_states: False keeps the engine's optimizer state (moments and applied-update count, so a
            config LR schedule restarts with it; a warning says so) and loads the rest.
          load_lr_scheduler_states: a client scheduler's `state_dict` is loaded with it. The config's schedules are
            functions of the optimizer's applied-update count: False with the optimizer state loaded raises (the
            two cannot be separated).
          load_module_only: load the parameters, frozen parameters and buffers only; the optimizer state, loss
            scale, accumulation window, counters and schedule stay the engine's.
          custom_load_fn: not supported (must be None).
          restore_rng: fzero only: restore this process's random generators (default: unless `load_module_only`),
            so that a resumed run draws what the uninterrupted one would.
          verify: fzero only: check every file's sha256 first.

        Returns:
          `(path, client_state)`: the checkpoint's directory and the saved `client_state`; `(None, None)` with a
          warning when there is no checkpoint (no ``latest``, or no such tag), as DeepSpeed does.
        """
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported: fzero loads the state itself"
            )
        self.check_between_steps("load_checkpoint")
        self.wait_for_checkpoint()
        configured = self.client_scheduler is None and self.config["scheduler"] is not None
        if configured and not load_module_only and load_optimizer_states and not load_lr_scheduler_states:
            raise ValueError(
                "load_checkpoint(load_lr_scheduler_states=False) with the config's scheduler: the learning rate is "
                "a function of the optimizer's applied-update count, which is part of the optimizer state; it "
                "restarts only with the optimizer (load_optimizer_states=False) or load_module_only=True"
            )
        if configured and not load_module_only and not load_optimizer_states and load_lr_scheduler_states:
            warnings.warn(
                "load_checkpoint(load_optimizer_states=False): the optimizer's applied-update count starts again at 0, "
                "and with it the config's LR schedule (a function of that count): the schedule cannot be kept without "
                "the optimizer state",
                UserWarning,
                stacklevel=2,
            )
        if load_module_only:
            select = _is_module
        elif not load_optimizer_states:
            optimizer = _optimizer_keys(self.state)
            select = lambda key: not optimizer(key)  # noqa: E731
        else:
            select = None
        tag = None if tag is None else str(tag)
        try:
            path = resolve_checkpoint(load_dir, tag)
            like = self.state
            if read_manifest(path).layout.frozen_layout is None and like.layout.frozen_layout is not None:
                _check_frozen_excluded(path, like, load_module_strict)
                like = without_frozen(like)
            state, extra = fzero_load(path, like, self.mesh, select=select, verify=verify)
        except CheckpointNotFoundError as e:  # DeepSpeed warns and returns (None, None) when there is nothing to load
            warnings.warn(f"load_checkpoint: nothing loaded, {e}", UserWarning, stacklevel=2)
            return None, None
        if like is not self.state:  # the frozen parameters: the engine's own
            state = state.replace(frozen=self.state.frozen, layout=self.state.layout)
        where = extra["path"]
        record, client_state = _engine_record(extra["user_state"], where)
        if record is None and not load_module_only:
            warnings.warn(
                f"{where} was not saved by engine.save_checkpoint: the counters are derived from its micro-step count "
                f"({extra['step']}), assuming no skipped steps",
                UserWarning,
                stacklevel=2,
            )
        counters = None if load_module_only else _counters(self, record, extra["step"], extra["tag"])
        if counters is not None:
            held = _accumulated(state)
            if held is not None and held != counters["micro_steps"] % self.config.gas:
                raise IncompatibleCheckpointError(
                    f"{where}: its accumulator holds {held} micro-steps, but micro_steps {counters['micro_steps']} "
                    f"puts the engine at micro-step {counters['micro_steps'] % self.config.gas} of {self.config.gas}"
                )
        # everything checked: apply (the parts first: a saved state that is not theirs raises before the rest)
        if record is not None and not load_module_only:
            self._restore_checkpoint_parts(record.get("parts") or {}, str(where))
        if counters is not None and record is not None:
            self.optimizer.overflow = bool(record["overflow"])
        client_scheduled = self.client_scheduler is not None and not load_module_only and load_lr_scheduler_states
        if record is not None and (client_scheduled or (load_optimizer_states and not load_module_only)):
            for group, saved in zip(self.optimizer.param_groups, record["param_groups"], strict=False):
                group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        if client_scheduled and record is not None and record.get("lr_scheduler") is not None:
            self.client_scheduler.load_state_dict(record["lr_scheduler"])
        self.restore(state, None if counters is None else EngineCounters.from_json(counters, record))
        if restore_rng if restore_rng is not None else not load_module_only:
            rng.restore(extra["rng"])
        return where, client_state

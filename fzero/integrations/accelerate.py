"""Hugging Face Accelerate on fzero: `Accelerator(fzero_config=...)`.

Accelerate's `Accelerator` drives DeepSpeed through its own code path (`DistributedType.DEEPSPEED`:
`prepare` calls `deepspeed.initialize`, `backward` calls the engine's `set_gradient_accumulation_boundary`,
`backward` and, at the boundary, `step`; checkpoints go through the engine's `save_checkpoint` and
`load_checkpoint`). This subclass runs that same path with fzero's shell answering `import deepspeed`
(`fzero.deepspeed.alias`), so every Accelerate call a DeepSpeed script makes behaves as it does under DeepSpeed:

    from fzero.integrations.accelerate import Accelerator

    accelerator = Accelerator(fzero_config="ds_config.json", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)  # fzero's engine steps at the accumulation boundary, as DeepSpeed's does
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

Two things differ from Accelerate's DeepSpeed path, both refusals where it would go on silently: an
`Accelerator(gradient_accumulation_steps=N)` that contradicts the config's `gradient_accumulation_steps` (Accelerate
warns and takes the config's), and `clip_grad_norm_(max_norm)` against a different `gradient_clipping` in the config
(Accelerate returns the engine's norm and ignores `max_norm`: the clipping is the engine's, with the config's value).

On a machine without CUDA, Accelerate's DeepSpeed path has no process group (its launcher expects one accelerator
per process); the subclass sets up the CPU processes as Accelerate does for its own CPU runs (gloo, the launcher's
environment) and marks them as DeepSpeed's, which fzero runs on the CPU. Accelerate and transformers check that the
`deepspeed` distribution is installed before taking their DeepSpeed path: it must be (`pip install fzero[integrations]`
pins the tested version); its code is not run while the alias holds.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType

from ..config import load_json
from ..deepspeed.alias import alias_deepspeed

__all__ = ["Accelerator", "hold_deepspeed_path", "load_config", "prepare_cpu_state"]

_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"


def load_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed JSON config, as a new dict (a path is read; a dict is copied, since the frameworks fill it in).

    Raises:
      FileNotFoundError / ConfigError (a ValueError): the file is missing, or is not a JSON object (naming it).
    """
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    return load_json(config)


def prepare_cpu_state(cpu: bool = False, **kwargs: Any) -> bool:
    """Set up Accelerate's process state for DeepSpeed's path on the CPU, where Accelerate's own setup cannot.

    With CUDA (and `cpu=False`) Accelerate sets up DeepSpeed's processes itself: nothing is done. Otherwise the
    processes are set up as for Accelerate's CPU runs (gloo; `torchrun`'s or MPI's environment; a group of one for a
    single process, as DeepSpeed makes), then marked as DeepSpeed's, so that `Accelerator` and transformers'
    `Trainer` take their DeepSpeed path.

    Args:
      cpu: Accelerate's `cpu` flag (force the CPU even where CUDA is present).
      **kwargs: `PartialState`'s arguments (`backend`, `timeout`).

    Returns:
      Whether it made the process group (of one process), which the caller destroys if it gives up.
    """
    if torch.cuda.is_available() and not cpu:
        return False
    state = PartialState(cpu=True, **kwargs)
    made = False
    if state.distributed_type == DistributedType.NO and not dist.is_initialized():
        # one process: DeepSpeed's `init_distributed` makes a group of one, which the frameworks' DeepSpeed paths
        # then use (transformers gathers the logged loss over it); an in-process store, no port to collide on
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        made = True
    if state.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU):
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    return made


def hold_deepspeed_path() -> Callable[[], None]:
    """Take fzero's alias for `import deepspeed`, and note Accelerate's `ACCELERATE_USE_DEEPSPEED`; returns the
    function that releases both: the alias, and the variable as it was (Accelerate sets it for the process whenever
    it is given a DeepSpeed plugin, so a later plain `Trainer` or `Accelerator` in the same process would take the
    DeepSpeed path too)."""
    release = alias_deepspeed()
    before = os.environ.get(_USE_DEEPSPEED)

    def release_both() -> None:
        release()
        if before is None:
            os.environ.pop(_USE_DEEPSPEED, None)
        else:
            os.environ[_USE_DEEPSPEED] = before

    return release_both


def _check_accumulation(config: dict[str, Any], steps: int | None) -> None:
    ours = config.get("gradient_accumulation_steps", "auto")
    if steps is not None and steps != 1 and ours != "auto" and ours != steps:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}) contradicts the fzero_config's "
            f'"gradient_accumulation_steps": {ours}; give one of them (or "auto" in the config)'
        )


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` running DeepSpeed's path on fzero.

    Args:
      *args: Accelerate's `Accelerator` arguments.
      fzero_config: a DeepSpeed JSON config (dict or path); `"auto"` values are filled by Accelerate from the
        prepared objects and these arguments, as for DeepSpeed.
      **kwargs: Accelerate's `Accelerator` keyword arguments, but `deepspeed_plugin(s)` (the config is fzero's).

    Raises:
      ValueError: a `deepspeed_plugin` was also given, or an argument contradicts the config (naming both).
    """

    def __init__(self, *args: Any, fzero_config: dict[str, Any] | str | os.PathLike[str], **kwargs: Any) -> None:
        for key in ("deepspeed_plugin", "deepspeed_plugins"):
            if kwargs.get(key) is not None:
                raise ValueError(f"Accelerator: give the DeepSpeed config as fzero_config=, not {key}=")
        config = load_config(fzero_config)
        steps = kwargs.get("gradient_accumulation_steps")
        _check_accumulation(config, steps)
        release = weakref.finalize(self, hold_deepspeed_path())  # held while the accelerator lives
        made = False
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=config, gradient_accumulation_steps=steps if steps else None)
            # `cpu=True` goes to the state set up here: Accelerate itself would then leave DeepSpeed's path
            cpu = bool(kwargs.pop("cpu", False))
            if AcceleratorState._shared_state == {}:  # a second Accelerator reuses the first one's state
                made = prepare_cpu_state(cpu)
            super().__init__(*args, deepspeed_plugin=plugin, **kwargs)
        except BaseException:
            release()
            if made:
                AcceleratorState._reset_state(reset_partial_state=True)
                dist.destroy_process_group()
            raise

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The gradient norm of the last step (Accelerate's DeepSpeed path): clipping is the engine's, at the
        config's `gradient_clipping`, which `max_norm` and `norm_type` must match.

        Raises:
          ValueError: `max_norm` differs from the config's `gradient_clipping`, or `norm_type` is not 2.
        """
        configured = self.deepspeed_plugin.deepspeed_config.get("gradient_clipping", 0.0)
        if float(norm_type) != 2.0 or float(max_norm) != float(configured or 0.0):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): fzero's engine clips the L2 norm at "
                f'the fzero_config\'s "gradient_clipping" ({configured}) when it steps; set "gradient_clipping" to '
                f'{max_norm} (or "auto" with Accelerator\'s DeepSpeed plugin) instead'
            )
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

"""Hugging Face's `Trainer` on fzero: `FzeroTrainingArguments(fzero_config=...)` and `FzeroTrainer`.

`Trainer` drives DeepSpeed itself when `TrainingArguments(deepspeed=...)` is given: it fills the config's `"auto"`
values from the arguments (and refuses values that contradict them), builds the model under `zero.Init` in
`from_pretrained` at ZeRO-3, calls `deepspeed.initialize` through Accelerate, and saves, resumes and consolidates
through the engine. `FzeroTrainingArguments` takes the config as `fzero_config=` and holds
`fzero.deepspeed.alias.alias_deepspeed()` for as long as it lives, so that all of that runs on fzero's shell:

    from transformers import AutoModelForCausalLM
    from fzero.integrations.transformers import FzeroTrainer, FzeroTrainingArguments

    args = FzeroTrainingArguments(output_dir="out", fzero_config="ds_config.json", max_steps=100)
    model = AutoModelForCausalLM.from_pretrained("path")  # sharded as it loads at ZeRO-3: args exist first
    trainer = FzeroTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    trainer.save_model()  # the Hugging Face format, consolidated

As under DeepSpeed, `trainer.model_wrapped` is the engine and the arguments must exist before the model is loaded
for ZeRO-3 to shard it from the start. `FzeroTrainer` is `Trainer` with one check more: its arguments are fzero's
(`FzeroTrainer(args=TrainingArguments(...), fzero_config=...)` converts them). On a machine without CUDA the
processes are set up as Accelerate does for the CPU and marked as DeepSpeed's (`fzero.integrations.accelerate`).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from transformers import Trainer, TrainingArguments

from .accelerate import hold_deepspeed_path, load_config, prepare_cpu_state

__all__ = ["FzeroTrainer", "FzeroTrainingArguments"]


@dataclass
class FzeroTrainingArguments(TrainingArguments):
    """`TrainingArguments` whose DeepSpeed config fzero trains with.

    Args:
      fzero_config: a DeepSpeed JSON config (dict or path); `"auto"` values are filled from these arguments as
        Hugging Face does for DeepSpeed, and a value that contradicts them is refused, naming both.
      **kwargs: `TrainingArguments`' own, but `deepspeed` (the config is `fzero_config`).

    Raises:
      ValueError: no `fzero_config`, `deepspeed` given too, or the config contradicts an argument.
    """

    fzero_config: dict[str, Any] | str | os.PathLike[str] | None = field(
        default=None,
        metadata={"help": "a DeepSpeed JSON config (dict or path) that fzero trains with"},
    )

    def __post_init__(self) -> None:
        if self.fzero_config is None:
            raise ValueError("FzeroTrainingArguments: give the DeepSpeed config as fzero_config=")
        if not isinstance(self.fzero_config, dict):
            self.fzero_config = os.fspath(self.fzero_config)
        config = load_config(self.fzero_config)
        if self.deepspeed is not None and self.deepspeed != config:  # (a copy of these arguments has it: equal)
            raise ValueError("FzeroTrainingArguments: give the DeepSpeed config as fzero_config=, not deepspeed=")
        release = weakref.finalize(self, hold_deepspeed_path())  # held while these arguments live
        self.deepspeed = config
        try:
            super().__post_init__()
            # transformers collects these here but raises only when training starts: raise them now
            if self.hf_deepspeed_config.mismatches:
                raise ValueError(
                    "FzeroTrainingArguments: the fzero_config contradicts the arguments (set these config values to "
                    '"auto" or to the arguments\' values):\n' + "\n".join(self.hf_deepspeed_config.mismatches)
                )
        except BaseException:
            release()
            AcceleratorState._reset_state(reset_partial_state=True)
            if self.__dict__.get("_fzero_made_group"):
                dist.destroy_process_group()
            raise

    @cached_property
    def _setup_devices(self) -> torch.device:
        if torch.cuda.is_available() and not self.use_cpu:
            return TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined]
        AcceleratorState._reset_state(reset_partial_state=True)
        made = prepare_cpu_state(cpu=True, backend=self.ddp_backend, timeout=timedelta(seconds=self.ddp_timeout))
        self.__dict__["_fzero_made_group"] = made  # (destroyed again if these arguments are refused)
        # the state just prepared, not a new one (by now an AcceleratorConfig: __post_init__ converted it)
        self.accelerator_config.use_configured_state = True  # type: ignore[union-attr]
        return TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined]


def as_fzero_arguments(args: TrainingArguments, fzero_config: dict[str, Any] | str | os.PathLike[str]) -> Any:
    """`args` as `FzeroTrainingArguments` with `fzero_config` (every other argument kept)."""
    if args.deepspeed is not None:
        raise ValueError("FzeroTrainer: the TrainingArguments have deepspeed= set; give the config as fzero_config=")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return FzeroTrainingArguments(**values, fzero_config=fzero_config)  # (its __post_init__ reads the config)


class FzeroTrainer(Trainer):
    """`transformers.Trainer` training with fzero (its DeepSpeed path, on fzero's shell).

    Args:
      *args: `Trainer`'s.
      fzero_config: the DeepSpeed config, when `args` are plain `TrainingArguments` (they are converted; load the
        model after creating `FzeroTrainingArguments` instead for ZeRO-3 to shard it as it loads).
      **kwargs: `Trainer`'s.

    Raises:
      ValueError: neither `FzeroTrainingArguments` nor `fzero_config` given, or both.
    """

    def __init__(self, *args: Any, fzero_config: dict[str, Any] | str | os.PathLike[str] | None = None, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(targs, FzeroTrainingArguments):
            if fzero_config is not None:
                raise ValueError("FzeroTrainer: fzero_config= given and the FzeroTrainingArguments have one: give one")
        elif fzero_config is None:
            raise ValueError("FzeroTrainer: give FzeroTrainingArguments(fzero_config=...) or fzero_config=")
        else:
            converted = as_fzero_arguments(targs or TrainingArguments(output_dir="trainer_output"), fzero_config)
            if len(args) > 1:
                args = (args[0], converted, *args[2:])
            else:
                kwargs["args"] = converted
        super().__init__(*args, **kwargs)

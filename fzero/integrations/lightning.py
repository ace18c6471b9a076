"""Lightning on fzero: `lightning.Trainer(strategy=FzeroStrategy(config=...))`.

Lightning's own `DeepSpeedStrategy` drives DeepSpeed through `deepspeed.initialize`, the engine's `backward` and
`step`, and its `save_checkpoint` / `load_checkpoint`. `FzeroStrategy` is that strategy, run with fzero's shell
answering `import deepspeed` (`fzero.deepspeed.alias`, held while the strategy lives), so a `LightningModule` trains
on fzero unchanged: its `configure_optimizers` (one optimizer, optionally one scheduler), `ModelCheckpoint`,
`trainer.save_checkpoint`, `trainer.fit(ckpt_path=...)`, on the CPU (gloo) as on CUDA:

    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from fzero.integrations.lightning import FzeroStrategy

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    def make_trainer():
        return lightning.Trainer(
            strategy=FzeroStrategy(config=config), accelerator="cpu", devices=2,  # or accelerator="gpu"
            accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=6,
            callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=-1, every_n_train_steps=3)],
        )

    trainer = make_trainer()
    trainer.fit(module, loader)                             # module: any LightningModule
    full = trainer.strategy.lightning_module_state_dict()   # the consolidated parameters, on every rank
    trainer.save_checkpoint("final.ckpt")                   # a directory: fzero's checkpoint, tag "checkpoint"
    make_trainer().fit(module, loader, ckpt_path="ckpts/epoch=0-step=3.ckpt")  # resumes bitwise

(Resume from checkpoints saved on a train batch's end, as above: Lightning 2.6 resumes one saved at an epoch's
end, `ModelCheckpoint(every_n_epochs=1)`, with the wrong batch under `max_steps`, under `strategy="ddp"` too.)

What differs from Lightning's `DeepSpeedStrategy`:

- the CPU is accepted (DeepSpeed's strategy refuses anything but CUDA); CPU processes use gloo;
- the config's `gradient_accumulation_steps`, `gradient_clipping` and `train_micro_batch_size_per_gpu` may be
  given, or `"auto"`: `"auto"` (or absent) takes the Trainer's `accumulate_grad_batches` and `gradient_clip_val` and
  the train loader's batch size; a value that contradicts the Trainer's raises a `ValueError` naming both, before
  the engine is built (Lightning refuses any accumulation in the config, and silently prefers the config's clipping);
  `fp16.enabled` / `bf16.enabled` against the Trainer's `precision` likewise (`"auto"`: from the precision);
- the loss is averaged over the accumulated micro-batches once: Lightning divides the loss by
  `accumulate_grad_batches` before `backward` and DeepSpeed's `engine.backward` divides it again (its
  `scale_wrt_gas`), so under Lightning's own strategy the gradient is the mean divided by `accumulate_grad_batches`
  (visible once clipping is active); here `engine.backward(loss, scale_wrt_gas=False)` keeps the mean, so a run
  matches Lightning's `strategy="ddp"` with the same arguments;
- `lightning_module_state_dict()` is the consolidated (full, unsharded) parameters and buffers, at every stage (an
  all-gather at stage 3: every rank calls it, as `trainer.save_checkpoint` does);
- an optimizer and `scheduler` in the config (`configure_optimizers` returning None): the engine steps the schedule
  and restores it with the optimizer's update count; Lightning's calls on it (step, state) do nothing;
- `load_full_weights=True` is refused (Lightning would unpickle a single `torch.save` file);
- checkpoints are fzero's format (`fzero.engine.checkpointing`: safetensors and JSON, never pickle): a Lightning
  checkpoint path is a directory holding the tag `checkpoint`, as under DeepSpeed; Lightning's own entries (loops,
  callbacks, scheduler state, hyper-parameters) are the checkpoint's `client_state`, their tensors encoded as JSON
  (`_to_json`).

Lightning's `DeepSpeedStrategy` checks that the `deepspeed` distribution is installed before it starts; it need not
be here (its code is never run while the alias holds).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import deepspeed as fabric_deepspeed
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies import deepspeed as pl_deepspeed
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..deepspeed.alias import alias_deepspeed
from ..engine import Engine, SchedulerView

__all__ = ["FzeroStrategy"]

_AUTO = "auto"


@contextlib.contextmanager
def _deepspeed_requirement_met() -> Iterator[None]:
    """Let `DeepSpeedStrategy.__init__` pass its check that the `deepspeed` distribution (>= 0.16) is installed:
    fzero's shell answers `import deepspeed` instead. The check's cached answers are restored afterwards."""
    caches = {id(c): c for c in (pl_deepspeed._DEEPSPEED_AVAILABLE, pl_deepspeed._DEEPSPEED_GREATER_EQUAL_0_16,
                                 fabric_deepspeed._DEEPSPEED_AVAILABLE)}.values()  # fmt: skip
    saved = [(c, dict(c.__dict__)) for c in caches]
    for cache in caches:
        if not cache:
            cache.available = True
    try:
        yield
    finally:
        for cache, attrs in saved:
            cache.__dict__.clear()
            cache.__dict__.update(attrs)


def _load_config(config: Any) -> Any:
    """A copy of a config dict (Lightning fills its `"auto"` values in place); a path is read by Lightning."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    return config


class FzeroStrategy(DeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy` on fzero (see the module docstring for what differs).

    Args:
      config: the DeepSpeed JSON config (dict, or path of a JSON file); None: Lightning's defaults from the
        keyword arguments (`stage=2`, ...), as `DeepSpeedStrategy` builds them.
      **kwargs: `DeepSpeedStrategy`'s other arguments (`accelerator`, `parallel_devices`, `cluster_environment`,
        `process_group_backend`, `timeout`, `load_full_weights`, `exclude_frozen_parameters`, ...).

    Raises:
      ValueError (at `trainer.fit`, before the engine is built): the config contradicts the Trainer's
        `accumulate_grad_batches`, `gradient_clip_val`, the train loader's batch size or `precision`.
      RuntimeError (at `trainer.fit`): an accelerator other than the CPU or CUDA.
    """

    strategy_name = "fzero"

    def __init__(self, config: dict[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        if kwargs.get("load_full_weights"):
            raise ValueError(
                "FzeroStrategy(load_full_weights=True): Lightning would read a single torch.save file (pickle), "
                "which fzero never loads; load the weights into the module before fit (safetensors), or resume "
                "from a checkpoint directory this strategy saved"
            )
        # held for the strategy's life: Lightning imports `deepspeed` in its methods (init, zero.Init, checkpoints)
        release = alias_deepspeed()
        weakref.finalize(self, release)
        with _deepspeed_requirement_met():
            super().__init__(config=_load_config(config), **kwargs)

    # ---------------------------------------------------------------------------------------------- devices
    def setup_environment(self) -> None:
        """DDP's environment set-up, on the CPU or CUDA (Lightning's DeepSpeed strategy accepts CUDA only)."""
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise RuntimeError(
                f"FzeroStrategy runs on the CPU or CUDA, but the Trainer's accelerator is "
                f"{type(self.accelerator).__name__}: pass accelerator='cpu' or 'gpu'"
            )
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """DeepSpeed's process-group set-up; on the CPU every process's device is `cpu` (no index to check)."""
        assert self.parallel_devices is not None
        if self.root_device.type == "cuda":
            fabric_deepspeed._validate_device_index_selection(self.parallel_devices)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    # ---------------------------------------------------------------------------------------------- config
    def _format_config(self) -> None:
        assert isinstance(self.config, dict)
        if self.lightning_module is not None:
            self._reconcile_precision(self.precision_plugin.precision)
        super()._format_config()

    def _reconcile_precision(self, precision: str) -> None:
        """Resolve `fp16.enabled` / `bf16.enabled` `"auto"` from the Trainer's precision, and refuse a config whose
        enabled half type is not the precision's (Lightning's default "32-true" takes the config's)."""
        assert isinstance(self.config, dict)
        wanted = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}.get(precision)
        for kind in ("fp16", "bf16"):
            block = self.config.get(kind)
            if not isinstance(block, dict):
                continue
            if block.get("enabled", False) == _AUTO:
                block["enabled"] = wanted == kind
            if block.get("enabled", False) and wanted is not None and wanted != kind:
                raise ValueError(
                    f'Trainer(precision="{precision}") contradicts the fzero config\'s "{kind}": {{"enabled": true}}; '
                    f'use precision="{"16-mixed" if kind == "fp16" else "bf16-mixed"}" (or leave the Trainer\'s '
                    f'default), or set "{kind}.enabled" to "auto"'
                )

    def _format_batch_size_and_grad_accum_config(self) -> None:
        """The config's accumulation, clipping and micro-batch: given, `"auto"` or absent (the Trainer's)."""
        assert isinstance(self.config, dict)
        if self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        clip = float(trainer.gradient_clip_val or 0.0)
        self._agree("gradient_accumulation_steps", trainer.accumulate_grad_batches, "accumulate_grad_batches")
        self._agree("gradient_clipping", clip, "gradient_clip_val", given=trainer.gradient_clip_val is not None)
        batch = self._loader_batch_size()
        if self.config.get("train_micro_batch_size_per_gpu", _AUTO) == _AUTO:
            self.config["train_micro_batch_size_per_gpu"] = batch or 1
        elif batch is not None and self.config["train_micro_batch_size_per_gpu"] != batch:
            raise ValueError(
                f"the train loader's batch size {batch} contradicts the fzero config's "
                f'"train_micro_batch_size_per_gpu": {self.config["train_micro_batch_size_per_gpu"]}; set it to '
                f'"auto" (or {batch})'
            )
        if self.config.get("train_batch_size") == _AUTO:
            del self.config["train_batch_size"]  # (fzero derives it from the micro-batch, accumulation and world)

    def _agree(self, key: str, trainer_value: Any, trainer_arg: str, given: bool = True) -> None:
        """Fill the config's `key` from the Trainer's `trainer_arg` (`"auto"` or absent), or check they agree."""
        assert isinstance(self.config, dict)
        ours = self.config.get(key, _AUTO)
        if ours == _AUTO:
            self.config[key] = trainer_value
        elif given and ours != trainer_value:
            raise ValueError(
                f'Trainer({trainer_arg}={trainer_value}) contradicts the fzero config\'s "{key}": {ours}; give one '
                f'of them (or "auto" in the config)'
            )

    def _loader_batch_size(self) -> int | None:
        """The train loader's batch size, where Lightning can tell it before training (else None)."""
        assert self.lightning_module is not None
        source = self.lightning_module.trainer.fit_loop._data_source
        if not source.is_defined():
            return None
        sampler = getattr(source.dataloader(), "batch_sampler", None)
        size = getattr(sampler, "batch_size", None)
        return size if isinstance(size, int) else None

    # ---------------------------------------------------------------------------------------------- training
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's automatic optimization already divided the loss by `accumulate_grad_batches`: the engine
        sums the micro-batches' gradients instead of dividing again (see the module docstring)."""
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _initialize_deepspeed_train(self, model: torch.nn.Module) -> None:
        super()._initialize_deepspeed_train(model)
        # the config's `scheduler` block: the engine steps it after every applied update and restores it with the
        # optimizer's update count; Lightning's calls (step, state_dict, load_state_dict) must not touch it
        for cfg in self.lr_scheduler_configs:
            if isinstance(cfg.scheduler, SchedulerView):
                cfg.scheduler = _EngineSchedule(cfg.scheduler)  # type: ignore[assignment]

    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        assert isinstance(self.config, dict)
        if self.zero_stage_3:  # (Lightning reads it unguarded; DeepSpeed's default)
            self.config.setdefault("zero_allow_untested_optimizer", True)
        super()._initialize_deepspeed_inference(model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consolidated parameters (fp32 master, full shapes) and buffers, keyed as the LightningModule's
        `state_dict`; at stage 3 this all-gathers, so every rank calls it (and every rank gets it)."""
        if isinstance(self.model, Engine):
            return self.model.module_state_dict()
        return super().lightning_module_state_dict()

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """The engine's checkpoint (fzero's format) at the directory `filepath`, Lightning's entries as its
        `client_state` (tensors encoded as JSON)."""
        encoded = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        super().save_checkpoint(_to_json(encoded, "checkpoint"), filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The engine's state from the checkpoint directory (with the optimizer's when fitting), and Lightning's
        entries back from its `client_state`. As `DeepSpeedStrategy.load_checkpoint`, but a config `scheduler`
        is restored with the optimizer (it is a function of its update count; fzero's engine refuses to separate
        them); a client scheduler's state is Lightning's to restore.

        Raises:
          FileNotFoundError: `checkpoint_path` is not a checkpoint directory (Lightning's message).
          MisconfigurationException: the engine found nothing to load there.
        """
        fabric_deepspeed._validate_checkpoint_directory(checkpoint_path)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.deepspeed_engine.load_checkpoint(
            checkpoint_path,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=fitting,
            load_module_strict=self.lightning_module.strict_loading,
        )
        if client_state is None:
            raise MisconfigurationException(f"fzero found no checkpoint to load at {checkpoint_path}")
        return _from_json(client_state)


class _EngineSchedule:
    """The config's schedule as Lightning's scheduler: Lightning steps it at every boundary, saves its
    `state_dict` and loads it on resume; the engine already does all three (the schedule is a function of the
    optimizer's applied updates, part of the engine's checkpoint), so stepping and loading do nothing here."""

    def __init__(self, view: SchedulerView) -> None:
        self.view = view

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass  # (the engine stepped it with its update)

    def state_dict(self) -> dict[str, int]:
        return self.view.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass  # (the engine's checkpoint restored the update count it is a function of)

    def get_last_lr(self) -> list[float]:
        return self.view.get_last_lr()


# ---------------------------------------------------------------------------------------------- client_state JSON
_TENSOR = "__fzero_tensor__"  # marks an encoded tensor in a checkpoint's client_state
_FLOAT = "__fzero_float__"  # marks a float JSON has no number for (inf, -inf, nan)
_DTYPES = {torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool}


def _number(x: Any) -> Any:
    return {_FLOAT: repr(x)} if isinstance(x, float) and not math.isfinite(x) else x


def _to_json(value: Any, where: str) -> Any:
    """`value` with its tensors as `{_TENSOR: dtype, "shape": [...], "data": [...]}` (exact: every float32 is a
    double), non-finite floats as `{_FLOAT: "inf"}` and tuples as lists: what the engine's JSON `client_state`
    holds (Lightning's ModelCheckpoint keeps its scores as tensors, `inf` before any). Other values go as they
    are; the engine names any it cannot store.

    Raises:
      TypeError: a tensor of a dtype this encoding does not carry (naming where it is).
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise TypeError(f"{where} is a {value.dtype} tensor: a checkpoint's client_state holds real tensors only")
        t = value.detach().cpu()
        flat = (t.double() if t.is_floating_point() else t).reshape(-1).tolist()
        return {
            _TENSOR: str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": [_number(x) for x in flat],
        }
    if isinstance(value, Mapping):
        return {k: _to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    return _number(value)


def _from_json(value: Any) -> Any:
    """`_to_json`'s encodings back (tensors, non-finite floats)."""
    if isinstance(value, Mapping):
        if _FLOAT in value:
            return float(value[_FLOAT])
        if _TENSOR in value:
            data = [_from_json(x) for x in value["data"]]
            return torch.tensor(data, dtype=getattr(torch, value[_TENSOR])).reshape(value["shape"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value

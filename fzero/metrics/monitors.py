"""DeepSpeed's monitors: the config blocks `tensorboard`, `wandb`, `csv_monitor` and `comet`.

DeepSpeed 0.19.8 (`deepspeed/monitor/`) writes *events* `(name, value, global_samples)` to each enabled backend,
on global rank 0 only, at every gradient accumulation boundary (whatever `steps_per_print` is). The engine
(`fzero.Engine`) builds the same events with `boundary_events` and hands them to a `MonitorMaster`:

    Train/Samples/lr                  the learning rate of the next update (`engine.get_lr()[0]` after the step)
    Train/Samples/loss_scale          the loss scale after the step (fp16 only)
    Train/Samples/elapsed_time_ms_forward, _backward, _step
                                      the window's forward/backward/step milliseconds (`wall_clock_breakdown`)
    Train/Samples/train_loss          the window's mean micro-batch loss, averaged over the ranks

all at x = `global_samples` after the step. One writer per backend, each with the backend's own library:

- `TensorBoardWriter`: `torch.utils.tensorboard.SummaryWriter` in `output_path/job_name` (package `tensorboard`);
- `WandbWriter`: one `wandb.init(project, group, entity=team)` run; `WANDB_MODE=offline` and the other `WANDB_*`
  variables apply as usual (package `wandb`);
- `CSVWriter`: `output_path/job_name/<name with / as _>.csv`, a `step,<last part of the name>` header, then one
  `step,value` row per event (no package);
- `CometWriter`: `comet_ml.start(...)`, an event sent once its samples advanced `samples_log_interval` since that
  name was last sent (package `comet_ml`).

The packages come with `pip install "fzero[monitor]"`; a block enabled without its package is an `ImportError`
saying so.

Example:
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     master = MonitorMaster({"csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"}})
    ...     master.write_events(boundary_events(16, lr=0.5, loss=2.25))
    ...     master.close()
    ...     print(open(os.path.join(out, "run", "Train_Samples_train_loss.csv")).read().strip())
    step,train_loss
    16,2.25
"""

from __future__ import annotations

import atexit
import csv
import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "BACKENDS",
    "CSVWriter",
    "CometWriter",
    "Event",
    "MonitorMaster",
    "TensorBoardWriter",
    "WandbWriter",
    "Writer",
    "boundary_events",
]

Event = tuple[str, float, int]
"""DeepSpeed's event: `(name, value, step)`, the step being the engine's `global_samples`."""

BACKENDS = ("tensorboard", "wandb", "csv_monitor", "comet")
"""The config blocks, in the order DeepSpeed's `MonitorMaster` writes to them."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
_EXTRA = 'pip install "fzero[monitor]"'


def boundary_events(
    samples: int,
    lr: float,
    loss: float,
    *,
    loss_scale: float | None = None,
    times_ms: Mapping[str, float] | None = None,
) -> list[Event]:
    """The events of one optimizer step, with DeepSpeed 0.19.8's names (its non-pipeline engine writes all but
    `train_loss`, which fzero adds with the pipeline engine's definition).

    Args:
      samples: the engine's `global_samples` after the step (the x-axis of every event).
      lr: the first param group's learning rate after the step (`engine.get_lr()[0]`).
      loss: the step's training loss (the accumulation window's mean micro-batch loss, averaged over the ranks).
      loss_scale: the loss scale after the step; None leaves the event out (DeepSpeed writes it under fp16 only).
      times_ms: `forward`, `backward`, `step` -> the window's milliseconds (`wall_clock_breakdown`), or None.

    Returns:
      The events, in DeepSpeed's order (lr, loss_scale, the wall-clock times), then train_loss.
    """
    events: list[Event] = [("Train/Samples/lr", float(lr), samples)]
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", float(loss_scale), samples))
    for name, ms in (times_ms or {}).items():
        events.append((f"Train/Samples/elapsed_time_ms_{name}", float(ms), samples))
    events.append(("Train/Samples/train_loss", float(loss), samples))
    return events


def _require(block: str) -> Any:
    """Import the package of config block `block`, or raise an ImportError naming the block and the extra."""
    package = _PACKAGES[block]
    try:
        # torch.utils.tensorboard imports tensorboard itself and fails the same way when it is missing
        module = importlib.import_module("torch.utils.tensorboard" if block == "tensorboard" else package)
    except ImportError as e:
        raise ImportError(
            f"the config's {block!r} monitor is enabled but the {package!r} package is not installed "
            f"({type(e).__name__}: {e}); install it with: {_EXTRA}"
        ) from e
    if block == "comet" and not hasattr(module, "start"):  # DeepSpeed's minimum, 3.41, brought comet_ml.start
        raise ImportError(f"the config's 'comet' monitor needs comet_ml >= 3.41; install it with: {_EXTRA}")
    return module


class Writer(Protocol):
    """One backend: `write_events` takes DeepSpeed's events, `close` flushes and releases it (idempotent)."""

    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


def _log_dir(block: Mapping[str, Any]) -> str:
    # DeepSpeed's os.path.join(output_path, job_name): with the default output_path "" the job's directory lies in
    # the working directory
    return os.path.join(block["output_path"], block["job_name"])


class TensorBoardWriter:
    """Scalars through `torch.utils.tensorboard.SummaryWriter(output_path/job_name)`, flushed after each batch of
    events (DeepSpeed's `TensorBoardMonitor`).

    Args:
      block: the validated `tensorboard` config block.
    """

    def __init__(self, block: Mapping[str, Any]) -> None:
        module = _require("tensorboard")
        self.log_dir = _log_dir(block)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer: Any = module.SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        if self._writer is None:
            return
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # as DeepSpeed: a crash loses nothing already reported

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter:
    """One Weights & Biases run, `wandb.init(project=project, group=group, entity=team)`, and
    `run.log({name: value}, step=step)` per event (DeepSpeed's `WandbMonitor`); `close` finishes the run.

    Args:
      block: the validated `wandb` config block.
    """

    def __init__(self, block: Mapping[str, Any]) -> None:
        wandb = _require("wandb")
        self._run: Any = wandb.init(project=block["project"], group=block["group"], entity=block["team"])

    def write_events(self, events: Sequence[Event]) -> None:
        if self._run is None:
            return
        for name, value, step in events:
            # events of one step share its history row: wandb commits the row when a later step arrives
            self._run.log({name: value}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()  # commits the last row and, offline, closes the run's .wandb file
            self._run = None


class CSVWriter:
    """DeepSpeed's `csvMonitor`: `output_path/job_name/<name, '/' and ' ' as '_'>.csv`, the header `step,<last part
    of the name>` the first time this process writes that name, then `step,value` rows, appended.

    Args:
      block: the validated `csv_monitor` config block.
    """

    def __init__(self, block: Mapping[str, Any]) -> None:
        self.log_dir = _log_dir(block)
        os.makedirs(self.log_dir, exist_ok=True)
        self._headed: set[str] = set()

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            # appended, opened per event as DeepSpeed does: every row is on disk once written
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="") as f:
                out = csv.writer(f)
                if filename not in self._headed:
                    self._headed.add(filename)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass  # nothing held open


class CometWriter:
    """A Comet experiment, `comet_ml.start(api_key, project, workspace, experiment_key, mode, online)` named
    `experiment_name` if given; an event is sent with `log_metric(name, value, step=samples)` when it is the first of
    its name or its samples advanced `samples_log_interval` since that name was last sent (DeepSpeed's
    `CometMonitor` and `EventsLogScheduler`). `close` ends the experiment.

    Args:
      block: the validated `comet` config block.
    """

    def __init__(self, block: Mapping[str, Any]) -> None:
        comet_ml = _require("comet")
        self.samples_log_interval = int(block["samples_log_interval"])
        self._last: dict[str, int] = {}
        self._experiment: Any = comet_ml.start(
            api_key=block["api_key"], project=block["project"], workspace=block["workspace"],
            experiment_key=block["experiment_key"], mode=block["mode"], online=block["online"],
        )  # fmt: skip
        if block["experiment_name"] is not None:
            self._experiment.set_name(block["experiment_name"])

    def _due(self, name: str, samples: int) -> bool:
        last = self._last.get(name)
        if last is None or samples - last >= self.samples_log_interval:
            self._last[name] = samples
            return True
        return False

    def write_events(self, events: Sequence[Event]) -> None:
        if self._experiment is None:
            return
        for name, value, step in events:
            if self._due(name, step):
                self._experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        if self._experiment is not None:
            self._experiment.end()
            self._experiment = None


_WRITERS: dict[str, type[Any]] = {
    "tensorboard": TensorBoardWriter,
    "wandb": WandbWriter,
    "csv_monitor": CSVWriter,
    "comet": CometWriter,
}


class MonitorMaster:
    """The enabled writers of a config (DeepSpeed's `MonitorMaster`), on the process that writes.

    Every process checks that the enabled backends' packages import, so a missing one stops all ranks at start
    rather than rank 0 alone while the others wait for it in a collective; only the writing process (`write`:
    global rank 0) creates a writer, so the others create no file, directory or run.

    Args:
      config: the validated config values (or any mapping holding some of the four blocks; absent ones are off).
      write: whether this process writes (global rank 0).

    Attributes:
      enabled: whether any monitor is enabled (DeepSpeed's `monitor.enabled`, the same on every rank).
      writers: block name -> writer, on the writing process.
    """

    def __init__(self, config: Mapping[str, Any], write: bool = True) -> None:
        blocks = {name: config[name] for name in BACKENDS if name in config and config[name]["enabled"]}
        self.enabled = bool(blocks)
        for name in blocks:
            if name in _PACKAGES:
                _require(name)
        self.writers: dict[str, Writer] = {}
        if not write:
            return
        try:
            for name, block in blocks.items():
                self.writers[name] = _WRITERS[name](block)
        except BaseException:
            self.close()  # those already started (a wandb run, say) do not outlive the failed engine
            raise
        if self.writers:
            # the user may never call engine.close(): the writers still flush and finish at interpreter exit
            atexit.register(self.close)

    def write_events(self, events: Sequence[Event]) -> None:
        """Write `events` to every writer (nothing on a process that does not write)."""
        for writer in self.writers.values():
            writer.write_events(events)

    def close(self) -> None:
        """Flush and close every writer; a second call does nothing."""
        writers, self.writers = self.writers, {}
        if writers:
            atexit.unregister(self.close)
        failed: BaseException | None = None
        for writer in writers.values():
            try:
                writer.close()
            except Exception as e:  # the other writers still close
                failed = failed or e
        if failed is not None:
            raise failed

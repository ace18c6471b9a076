"""`Reporting`: what the engine reports after each optimizer step.

The monitor (`fzero.metrics.Monitor`) takes a record per optimizer step (its micro-steps' losses, learning rate,
loss scale, gradient norm, time, throughput) and prints DeepSpeed's progress line every `steps_per_print` steps,
on global rank 0; DeepSpeed's `tensorboard` / `wandb` / `csv_monitor` / `comet` blocks get their events every step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..config import Config
from ..mesh import RankMesh
from ..metrics import Monitor, transformer_flops
from ..metrics.monitors import MonitorMaster, boundary_events
from ..state import TrainState
from ..step.microstep import loss_scale
from .counters import EngineCounters

__all__ = ["Reporting"]


class Reporting:
    """The monitor of `fzero.Engine`, fed at every optimizer step."""

    config: Config
    state: TrainState
    mesh: RankMesh
    counters: EngineCounters
    monitor: Monitor
    global_steps: int
    global_samples: int
    _times: dict[str, float]  # seconds in forward, backward and step since the last report
    _t_step: float | None  # when the optimizer step being timed began (None: at its first forward)
    _last_record: dict[str, Any] | None

    if TYPE_CHECKING:  # (the engine's other parts)

        @property
        def global_rank(self) -> int: ...

        def get_lr(self) -> list[float]: ...

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The monitor's record of the last optimizer step (`fzero.metrics.Monitor.record`), None before one. Its
        loss is read from the device now if it was not yet (on a GPU, a wait for the work queued so far)."""
        if self._last_record is not None:
            self.monitor.read_losses()
        return self._last_record

    def _make_monitor(self, printer: Any) -> Monitor:
        m = self.config["fzero_metrics"]
        flops = None
        if m["seq_length"] and m["num_layers"] and m["hidden_size"]:
            flops = transformer_flops(
                self.state.layout.real_numel, m["num_layers"], m["hidden_size"], m["seq_length"], 1,
                m["activation_checkpointing"],
            )  # fmt: skip
        return Monitor(
            self.config.train_batch_size,
            self.mesh.world,
            steps_per_print=self.config.steps_per_print,
            jsonl=m["jsonl"],
            warmup_steps=m["warmup_steps"],
            seq_length=m["seq_length"],
            flops_per_sample=flops,
            enabled=self.global_rank == 0,
            printer=printer,
            # DeepSpeed's tensorboard / wandb / csv_monitor / comet blocks: written on global rank 0 only
            writers=MonitorMaster(self.config.values, write=self.global_rank == 0),
        )

    def _report(self, lr: list[float], metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        step_time = now - (self._t_step or now)
        self._t_step = now
        losses = self.counters.step_losses
        self.counters.step_losses = []
        device = losses[-1].device  # (a resumed window's first losses come from the checkpoint, on the CPU)
        values: dict[str, Any] = {
            # the micro-steps' losses as they are: the monitor reads them when it needs them (`Monitor.record`)
            "loss": torch.stack([x.to(device) for x in losses]),
            "lr": lr[0],  # DeepSpeed's monitors log get_lr()[0]
            "loss_scale": float(metrics["loss_scale"]),
            "skipped": bool(metrics["skipped"]),
            "grad_norm": metrics.get("grad_norm"),
        }
        if len(lr) > 1:
            values["lr_groups"] = lr  # DeepSpeed's progress line prints get_lr(): every group's
        times_ms = {k: v * 1e3 for k, v in self._times.items()} if self.config.wall_clock_breakdown else None
        if times_ms is not None:
            values.update({f"{k}_ms": v for k, v in times_ms.items()})
        self._times = dict.fromkeys(self._times, 0.0)
        record = self._last_record = self.monitor.record(self.global_steps, step_time, **values)
        writers = self.monitor.writers
        if writers is not None and writers.writers:  # every boundary, whatever steps_per_print, as DeepSpeed
            # DeepSpeed logs get_lr()[0] and the loss scale as they are after the step (the next update's)
            fp16 = self.config.precision == "fp16"
            self.monitor.read_losses()
            self.monitor.write_events(
                boundary_events(
                    self.global_samples, self.get_lr()[0], record["loss"],
                    loss_scale=loss_scale(self.state) if fp16 else None, times_ms=times_ms,
                )
            )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The run's totals so far (see `fzero.metrics.Monitor.summary`)."""
        return self.monitor.summary()

    def close(self) -> None:
        """Close the metrics file; flush and close the monitors (TensorBoard, W&B, CSV, Comet)."""
        self.monitor.close()

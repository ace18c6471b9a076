"""Training metrics as DeepSpeed users read them: step time, samples and tokens per second, TFLOPS, one console line
every `steps_per_print` steps, a JSONL file of every step, and a loss-curve PNG.

TFLOPS of a dense decoder-only transformer (`P` parameters, `L` layers, hidden size `h`, sequence length `s`, `B`
sequences per optimizer step on this rank):

    flops_per_step = (2 c P s + 4 c L h s^2) B            c = 3 (forward + backward), 4 with activation checkpointing

`2 P s` is the forward's matrix multiplications against the weights, `4 L h s^2` the attention scores and their
weighted sum; the backward costs twice the forward, and recomputing the forward once more under activation
checkpointing makes `c = 4`. Achieved TFLOPS = flops_per_step / step_time / 1e12, per rank.

The first `warmup_steps` optimizer steps (allocator growth, first-touch page faults, lazy initialisation) are left out
of every timing average.

Example:
    >>> transformer_flops(params=1e6, layers=4, hidden=128, seq=128, batch=8) / 1e9   # GFLOPs per step
    6.949306368
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .monitors import Event, MonitorMaster


_UNREAD = 100  # records whose losses may wait on the device: a bound on what they hold there


def transformer_flops(
    params: float, layers: int, hidden: int, seq: int, batch: float, activation_checkpointing: bool = False
) -> float:
    """FLOPs of one training step of a dense transformer: `(2 c P s + 4 c L h s^2) B` (see the module docstring).

    Args:
      params: parameters `P`.
      layers, hidden, seq: `L`, `h`, `s`.
      batch: sequences `B` the step processes (on the rank whose FLOPs you want).
      activation_checkpointing: `c = 4` instead of 3.
    """
    c = 4 if activation_checkpointing else 3
    return (2 * c * params * seq + 4 * c * layers * hidden * seq**2) * batch


@dataclass
class Throughput:
    """Step times, the first `warmup_steps` left out of the averages.

    Example:
        >>> t = Throughput(warmup_steps=1)
        >>> [t.add(s) for s in (5.0, 1.0, 3.0)]   # counted?
        [False, True, True]
        >>> t.timed_steps, t.mean(), t.median()
        (2, 2.0, 2.0)
    """

    warmup_steps: int = 2
    steps: int = 0
    times: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> bool:
        """Record one step's time; returns whether it counts (is past the warm-up)."""
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return False
        self.times.append(seconds)
        return True

    @property
    def timed_steps(self) -> int:
        return len(self.times)

    @property
    def total(self) -> float:
        return sum(self.times)

    def mean(self, last: int | None = None) -> float:
        """Mean of the timed steps (the `last` ones only, if given); nan before any."""
        times = self.times[-last:] if last else self.times
        return sum(times) / len(times) if times else math.nan

    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def format_line(record: dict[str, Any]) -> str:
    """One console line of a step record (keys as `Monitor.record` writes them; absent ones are left out).

    Example:
        >>> format_line({"step": 10, "loss": 2.5, "lr": 1e-4, "skipped": 0, "step_time": 0.12, "samples_per_s": 66.6})
        'step 10 | loss 2.5000 | lr 1.000e-04 | skipped 0 | 120.0 ms/step | 66.6 samples/s'
        >>> format_line({"step": 3, "loss": 1.0, "lr": 1e-4, "lr_groups": [1e-4, 1e-3]})
        'step 3 | loss 1.0000 | lr 1.000e-04, 1.000e-03'
    """
    parts = [f"step {record['step']}", f"loss {_fmt(record.get('loss'), '.4f')}"]
    if record.get("lr_groups"):  # one lr per param group, as DeepSpeed's progress line prints them
        parts.append("lr " + ", ".join(_fmt(lr, ".3e") for lr in record["lr_groups"]))
    elif "lr" in record:
        parts.append(f"lr {_fmt(record['lr'], '.3e')}")
    if "loss_scale" in record:
        parts.append(f"scale {_fmt(record['loss_scale'], 'g')}")
    if "skipped" in record:
        parts.append(f"skipped {record['skipped']}")
    if "grad_norm" in record:
        parts.append(f"grad norm {_fmt(record['grad_norm'], '.3f')}")
    if record.get("step_time") is not None:
        parts.append(f"{_fmt(record['step_time'] * 1e3, '.1f', 'warm-up')} ms/step")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{_fmt(record['tokens_per_s'], ',.0f')} tokens/s")
    elif record.get("samples_per_s") is not None:
        parts.append(f"{_fmt(record['samples_per_s'], '.1f')} samples/s")
    if record.get("tflops") is not None:
        parts.append(f"{_fmt(record['tflops'], '.3f')} TFLOPS")
    for name in ("forward_ms", "backward_ms", "step_ms"):
        if record.get(name) is not None:
            parts.append(f"{name.removesuffix('_ms')} {record[name]:.1f} ms")
    return " | ".join(parts)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL metrics file (a truncated last line, from a killed run, is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plot_loss_curve(
    records: Iterable[dict[str, Any]] | str | os.PathLike[str], png: str | os.PathLike[str], title: str | None = None
) -> Path:
    """Write the loss against the optimizer step (skipped steps marked) to a PNG; returns its path.

    Args:
      records: step records, or the path of a JSONL metrics file.
      png: where to write the image.
      title: the plot's title.
    """
    if isinstance(records, (str, os.PathLike)):
        records = read_jsonl(records)
    rows = [r for r in records if r.get("loss") is not None and math.isfinite(r["loss"])]
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2, label="loss")
        skipped = [r for r in rows if r.get("skipped")]
        if skipped:
            ax.scatter([r["step"] for r in skipped], [r["loss"] for r in skipped], c="red", s=12, label="skipped")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        out = Path(png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


class Monitor:
    """Per optimizer step: derive throughput and TFLOPS, print every `steps_per_print` steps, write JSONL.

    Args:
      samples_per_step: samples all ranks process per optimizer step (`train_batch_size`).
      world: data-parallel ranks (TFLOPS is reported per rank).
      steps_per_print: print a line every N steps (None: never).
      jsonl: path of the JSONL file to write (None: none); truncated when the monitor starts.
      warmup_steps: steps left out of the timings.
      seq_length: tokens per sample (enables tokens/s).
      flops_per_sample: training FLOPs per sample (enables TFLOPS), e.g. `transformer_flops(..., batch=1)`.
      enabled: whether this process reports at all (rank 0 only, normally).
      printer: where lines go (`print`; `tqdm.write` under a progress bar).
      writers: DeepSpeed's monitors (`fzero.metrics.monitors.MonitorMaster`) that `write_events` feeds, if any.
    """

    def __init__(
        self,
        samples_per_step: int,
        world: int = 1,
        *,
        steps_per_print: int | None = None,
        jsonl: str | os.PathLike[str] | None = None,
        warmup_steps: int = 2,
        seq_length: int | None = None,
        flops_per_sample: float | None = None,
        enabled: bool = True,
        printer: Callable[[str], Any] = print,
        writers: MonitorMaster | None = None,
    ) -> None:
        self.samples_per_step = samples_per_step
        self.world = world
        self.steps_per_print = steps_per_print
        self.seq_length = seq_length
        self.flops_per_sample = flops_per_sample
        self.enabled = enabled
        self.printer = printer
        self.writers = writers
        self.throughput = Throughput(warmup_steps)
        self.losses: list[float] = []
        self.skipped = 0
        self._window: list[dict[str, Any]] = []
        self._unread: list[dict[str, Any]] = []  # records whose loss is still the micro-steps' tensor
        self.jsonl = Path(jsonl) if jsonl is not None and enabled else None
        self._file = None
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.jsonl, "w")  # closed by close()

    def rates(self, step_time: float | None) -> dict[str, float | None]:
        """samples/s, tokens/s (all ranks) and TFLOPS (per rank) at `step_time` seconds per step."""
        if step_time is None or not step_time > 0:
            return {"samples_per_s": None, "tokens_per_s": None, "tflops": None}
        samples = self.samples_per_step / step_time
        tokens = samples * self.seq_length if self.seq_length else None
        tflops = samples / self.world * self.flops_per_sample / 1e12 if self.flops_per_sample else None
        return {"samples_per_s": samples, "tokens_per_s": tokens, "tflops": tflops}

    def record(self, step: int, step_time: float, **values: Any) -> dict[str, Any]:
        """Record optimizer step `step` (1-based) that took `step_time` seconds; `values` are the step's metrics
        (loss, lr, loss_scale, skipped, grad_norm, forward_ms, ...). Returns the record written.

        `loss` may be a tensor of the step's micro-step losses, left where they were computed: the record's loss
        becomes their mean (in float64) when it is first needed on the host (a line printed, a JSONL line written,
        `summary`, `read_losses`), for every such record at once, so that a GPU's step need not wait for its own
        end to report its loss (one wait per printed line, as DeepSpeed's engine reads its loss)."""
        timed = self.throughput.add(step_time)
        rec: dict[str, Any] = {"step": step, **values, "step_time": step_time, "timed": timed}
        rec.update(self.rates(step_time))
        loss = values.get("loss")
        if isinstance(loss, torch.Tensor):
            self._unread.append(rec)
        elif loss is not None:
            self.read_losses()  # (in step order)
            self.losses.append(float(loss))
        self.skipped += bool(values.get("skipped"))
        if len(self._unread) >= _UNREAD:
            self.read_losses()
        if not self.enabled:
            return rec
        if self._file is not None:
            self.read_losses()
            self._file.write(json.dumps(rec, default=float) + "\n")
            self._file.flush()
        self._window.append(rec)
        if self.steps_per_print and step % self.steps_per_print == 0:
            self.read_losses()
            self.printer(format_line(self._window_summary()))
            self._window = []
        return rec

    def read_losses(self) -> None:
        """Give every record whose loss is still its micro-steps' tensor its loss as a float: their mean, added in
        float64 in micro-step order. All such tensors are read in one transfer."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        values = torch.cat([r["loss"].reshape(-1) for r in unread]).tolist()
        start = 0
        for r in unread:
            n = r["loss"].numel()
            r["loss"] = sum(values[start : start + n]) / n
            self.losses.append(r["loss"])
            start += n

    def _window_summary(self) -> dict[str, Any]:
        """The latest record, with the timings averaged over the window's timed steps."""
        last = dict(self._window[-1])
        timed = [r for r in self._window if r["timed"]]
        last["skipped"] = self.skipped
        last["step_time"] = sum(r["step_time"] for r in timed) / len(timed) if timed else None
        last.update(self.rates(last["step_time"]))
        for name in ("forward_ms", "backward_ms", "step_ms"):
            if name in last and timed:
                last[name] = sum(r[name] for r in timed) / len(timed)
        return last

    def summary(self) -> dict[str, Any]:
        """Totals: first and final loss (mean of the last 5 steps), timed steps, mean step time and the rates."""
        self.read_losses()
        t = self.throughput
        tail = self.losses[-5:]
        out: dict[str, Any] = {
            "steps": t.steps,
            "timed_steps": t.timed_steps,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "skipped": self.skipped,
            "step_time": t.mean() if t.timed_steps else None,
        }
        out.update(self.rates(out["step_time"]))
        return out

    def write_events(self, events: Sequence[Event]) -> None:
        """Write `(name, value, global_samples)` events to the config's monitors (TensorBoard, W&B, CSV, Comet) on
        the process that writes them (DeepSpeed's `engine.monitor.write_events`); nothing without monitors."""
        if self.writers is not None:
            self.writers.write_events(events)

    def close(self) -> None:
        """Close the JSONL file and flush and close the monitors."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.writers is not None:
            self.writers.close()

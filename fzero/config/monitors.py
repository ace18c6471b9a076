"""The config's monitor blocks (`tensorboard`, `wandb`, `csv_monitor`, `comet`): DeepSpeed 0.19.8's keys, defaults
and meaning (its deepspeed/monitor/config.py). What is written, where and when: `fzero.metrics.monitors`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .schema import Bool, ConfigError, Field, Int, Nullable, Section, Str

__all__ = ["COMET", "CSV_MONITOR", "TENSORBOARD", "WANDB"]


class _Closed(Section):
    """A section whose unknown keys are errors naming them, as DeepSpeed's pydantic models (`extra="forbid"`) make
    them: a misspelt `output_path` must not silently send a run's logs elsewhere."""

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if isinstance(value, Mapping):
            for key in value:
                if isinstance(key, str) and key not in self.fields and key not in self.aliases:
                    where = f"{path}.{key}" if path else key
                    raise ConfigError(where, f"unknown key; {path or 'the block'} takes {', '.join(self.fields)}")
        return super().validate(value, path, unknown)


# DeepSpeed 0.19.8's deepspeed/monitor/config.py: the same keys and defaults. Written on global rank 0 only, once
# per optimizer step (fzero.metrics.monitors).
_ON = "write DeepSpeed's Train/Samples/* events every optimizer step (rank 0)"
_JOB = Field(Str(), "DeepSpeedJobName", effect="the run's directory under output_path")
TENSORBOARD = _Closed(
    {
        "enabled": Field(Bool(), False, effect=_ON + " with torch.utils.tensorboard (package tensorboard)"),
        "output_path": Field(Str(), "", effect="event files go to output_path/job_name ('': the working directory)"),
        "job_name": _JOB,
    }
)
WANDB = _Closed(
    {
        "enabled": Field(Bool(), False, effect=_ON + " to one Weights & Biases run (package wandb)"),
        "group": Field(Nullable(Str()), None, effect="wandb.init(group=...)"),
        "team": Field(Nullable(Str()), None, effect="wandb.init(entity=...)"),
        "project": Field(Str(), "deepspeed", effect="wandb.init(project=...)"),
    }
)
CSV_MONITOR = _Closed(
    {
        "enabled": Field(Bool(), False, effect=_ON + " as CSV files, one per event (no package needed)"),
        "output_path": Field(
            Str(), "", effect="files go to output_path/job_name/<event>.csv ('': the working directory)"
        ),
        "job_name": _JOB,
    }
)
COMET = _Closed(
    {
        "enabled": Field(Bool(), False, effect=_ON + " to a Comet experiment (package comet_ml)"),
        "samples_log_interval": Field(
            Int(), 100, effect="an event is sent when its samples advanced this much since it was last sent"
        ),
        "project": Field(Nullable(Str()), None, effect="comet_ml.start(project=...)"),
        "workspace": Field(Nullable(Str()), None, effect="comet_ml.start(workspace=...)"),
        "api_key": Field(Nullable(Str()), None, effect="comet_ml.start(api_key=...)"),
        "experiment_name": Field(Nullable(Str()), None, effect="the experiment's name (set_name)"),
        "experiment_key": Field(Nullable(Str()), None, effect="comet_ml.start(experiment_key=...)"),
        "online": Field(Nullable(Bool()), None, effect="comet_ml.start(online=...): false writes an offline archive"),
        "mode": Field(Nullable(Str(("get", "create", "get_or_create"))), None, effect="comet_ml.start(mode=...)"),
    }
)

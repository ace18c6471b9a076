"""fzero's monitor events against DeepSpeed 0.19.8's own (issue 23): both trainers on the same config with
`csv_monitor`, 2 gloo processes, gradient accumulation 2, `wall_clock_breakdown`, a WarmupLR schedule; what each
wrote, read back with the csv module.

DeepSpeed's non-pipeline engine writes `lr` and the five wall-clock events; fzero writes `lr`, the three times it
measures (forward, backward, step: its backward has no separate all-reduce epilogue) and `train_loss` (which 0.19.8
writes only from its pipeline engine). The shared events have the same names, header, x values (global samples) and
cadence (every boundary), and `lr` the same values, bitwise.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests import monitor_ds_worker as w
from tests.spawn import spawn


def events(job: Path) -> dict[str, tuple[list[str], list[list[str]]]]:
    out = {}
    for path in sorted(job.glob("*.csv")):
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        out[path.name] = (header, rows)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitors-deepspeed")
    for trainer in ("deepspeed", "fzero"):
        spawn(w.run, (2, str(tmp), trainer), 2)
    return tmp


@pytest.mark.timeout(600)
def test_the_events_are_deepspeeds(written):
    ds, fz = (events(written / t / "rank0" / "run") for t in ("deepspeed", "fzero"))
    assert set(ds) == {
        "Train_Samples_lr.csv", *(f"Train_Samples_elapsed_time_ms_{k}.csv"
                                  for k in ("forward", "backward", "backward_inner", "backward_allreduce", "step")),
    }  # fmt: skip
    unwritten = {
        "Train_Samples_elapsed_time_ms_backward_inner.csv",
        "Train_Samples_elapsed_time_ms_backward_allreduce.csv",
    }
    assert set(fz) == (set(ds) - unwritten) | {"Train_Samples_train_loss.csv"}
    samples = [str(w.GAS * w.MICRO * 2 * (i + 1)) for i in range(w.STEPS)]  # every boundary, x = global samples
    for name in set(ds) - unwritten:
        assert fz[name][0] == ds[name][0], name  # the header
        assert [r[0] for r in fz[name][1]] == [r[0] for r in ds[name][1]] == samples, name
    assert fz["Train_Samples_lr.csv"][1] == ds["Train_Samples_lr.csv"][1]  # the same values, as written


@pytest.mark.timeout(600)
def test_rank_one_writes_nothing_in_either(written):
    for trainer in ("deepspeed", "fzero"):
        assert not any((written / trainer / "rank1").iterdir()), trainer

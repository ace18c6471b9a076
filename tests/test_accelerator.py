"""The accelerator's choice (`fzero.host.accelerator`): DeepSpeed's `DS_ACCELERATOR` forces it, a bad value is named."""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero.host import accelerator


def test_cpu_is_forced_by_the_variable(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "CPU")
    assert accelerator.device() == torch.device("cpu") and accelerator.backend() == "gloo"


def test_unset_follows_cuda(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert accelerator.name() == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("value", ["xpu", "npu", "gpu"])
def test_another_accelerator_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("DS_ACCELERATOR", value)
    with pytest.raises(ValueError, match=f"DS_ACCELERATOR='{value}': fzero runs on cpu or cuda"):
        accelerator.name()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu_is_refused_and_initialize_says_so(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="DS_ACCELERATOR=cuda, but torch sees no CUDA device"):
        fzero.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})

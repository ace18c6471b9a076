"""An engine built without an optimizer (DeepSpeed-Chat's reference, reward and EMA models): forwards only.

DeepSpeed 0.19.8 answers in a process of its own (importing it sets up global state: `python -m
tests.test_engine_forward_only OUT PORT` runs `_deepspeed_answers`), fzero in this one, on the same model and input.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fzero.deepspeed as fz
from fzero.config import ConfigError
from tests.spawn import init_worker, report, spawn

ROOT = Path(__file__).resolve().parents[1]
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
CASES = [(stage, precision) for stage in range(4) for precision in ("fp32", "bf16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _input(precision: str) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(DTYPES[precision])


def _config(stage: int, precision: str) -> dict[str, Any]:
    """A config without an optimizer block (DeepSpeed-Chat's `get_eval_ds_config`, in short)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _error(fn: Any) -> str | None:
    """The type and message of what `fn()` raised, or None."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _answers(deepspeed: Any, stage: int, precision: str) -> dict[str, Any]:
    """What `deepspeed.initialize` without an optimizer gives for one case: its error, or the outputs and the errors
    of backward and step."""
    try:
        engine, _, _, scheduler = deepspeed.initialize(model=_model(), config=_config(stage, precision))
    except Exception as e:
        return {"initialize": f"{type(e).__name__}: {e}"}
    x = _input(precision)
    out = engine(x)
    with torch.no_grad():
        quiet = engine(x)
    engine.eval()
    evaluated = engine(x)
    engine.train()
    return {
        "initialize": None, "out": out.detach(), "no_grad": quiet, "eval": evaluated.detach(),
        "scheduler": scheduler,
        "backward": _error(lambda: engine.backward(out.float().sum())), "step": _error(engine.step),
    }  # fmt: skip


def _deepspeed_answers(out: str, port: str) -> None:
    """DeepSpeed's answers for every case, saved to `out` (run as `python -m tests.test_engine_forward_only`)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.save({f"{s}-{p}": _answers(deepspeed, s, p) for s, p in CASES}, out)


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSpeed 0.19.8's answers on its CPU accelerator."""
    out = tmp_path_factory.mktemp("deepspeed") / "answers.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.test_engine_forward_only", str(out), str(port)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


# ---------------------------------------------------------------------------------------------------- the forwards
@pytest.mark.parametrize(("stage", "precision"), CASES)
def test_forwards_are_the_plain_modules_and_deepspeeds(ds: dict[str, Any], stage: int, precision: str) -> None:
    """`engine(x)` with and without gradients, in train and eval mode, is the plain module's output bitwise (cast to
    bf16 where DeepSpeed casts it), and DeepSpeed's where DeepSpeed builds the engine: stages 0 and 3; at stages 1-2
    DeepSpeed asserts that the stage needs an optimizer, while fzero builds the engine (stage 0's parameters)."""
    want = copy.deepcopy(_model()).to(DTYPES[precision])(_input(precision)).detach()
    got = _answers(fz, stage, precision)
    theirs = ds[f"{stage}-{precision}"]
    assert got["initialize"] is None
    for key in ("out", "no_grad", "eval"):
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    if stage in (1, 2):
        assert theirs["initialize"] == f"AssertionError: zero stage {stage} requires an optimizer"
        return
    assert theirs["initialize"] is None
    for key in ("out", "no_grad", "eval"):
        assert torch.equal(theirs[key], want), key
    assert got["scheduler"] is None and theirs["scheduler"] is None
    # DeepSpeed refuses step always, and backward except under its bf16 stage-0 wrapper (around a DummyOptim), which
    # computes gradients no step can apply: "must provide optimizer during init in order to use ..." at stage 0
    # (runtime/engine.py:3395, 3588), an AttributeError of its DeepSpeedZeRoOffload at stage 3; fzero always refuses
    for key in ("backward", "step"):
        if stage == 0 and precision == "fp32":
            assert theirs[key] == f"AssertionError: must provide optimizer during init in order to use {key}"
        elif stage == 3:
            assert theirs[key] is not None and theirs[key].startswith("AttributeError")
        else:
            assert (theirs[key] is None) == (key == "backward")
        assert got[key] is not None and got[key].startswith("RuntimeError: engine.")
        assert "built without an optimizer" in got[key] and 'no "optimizer" block' in got[key]


def test_initialize_returns_no_optimizer_and_no_state_for_one() -> None:
    """The engine holds the parameters but no optimizer moments (stateless SGD's empty buffer)."""
    engine, optimizer, _, scheduler = fz.initialize(model=_model(), config=_config(0, "bf16"))
    assert optimizer is None and scheduler is None
    import optree

    leaves = [t for t in optree.tree_leaves(engine.state.tx_state, none_is_leaf=False) if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in leaves) < 16  # counters and scalars only


# ----------------------------------------------------------------------------------------------- the parameters
def test_saved_and_gathered_parameters_are_the_models_at_stage_3() -> None:
    """`GatheredParameters`, `module_state_dict()`, `save_16bit_model` and a checkpoint's round trip read the
    given model's values bitwise."""
    want = _model().state_dict()
    engine, *_ = fz.initialize(model=_model(), config=_config(3, "fp32"))
    with fz.zero.GatheredParameters(list(engine.module.parameters())):
        assert all(torch.equal(p, want[k]) for k, p in engine.module.named_parameters())
    assert all(torch.equal(v, want[k]) for k, v in engine.module_state_dict().items())
    with tempfile.TemporaryDirectory() as d:
        engine.save_16bit_model(d)
        from safetensors.torch import load_file

        saved = load_file(os.path.join(d, "model.safetensors"))
        assert saved.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in saved.items())
        engine.save_checkpoint(d, tag="t")
        other = _model()
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        loaded, *_ = fz.initialize(model=other, config=_config(3, "fp32"))
        loaded.load_checkpoint(d, tag="t")
        assert all(torch.equal(v, want[k]) for k, v in loaded.module_state_dict().items())


# ------------------------------------------------------------------------------------------------- refused asks
def test_a_scheduler_without_an_optimizer_is_refused() -> None:
    """DeepSpeed silently builds no scheduler without an optimizer; fzero says so."""
    cfg = {**_config(0, "fp32"), "scheduler": {"type": "WarmupLR", "params": {}}}
    with pytest.raises(ConfigError, match='"scheduler" block without an optimizer'):
        fz.initialize(model=_model(), config=cfg)
    with pytest.raises(ConfigError, match="lr_scheduler= without an optimizer"):
        fz.initialize(model=_model(), config=_config(0, "fp32"), lr_scheduler=lambda opt: None)


# ------------------------------------------------------------------------------------------------- two processes
def _two_ranks(rank: int, world: int, store: str, out_dir: str) -> None:
    init_worker(rank, world, store)
    engine, *_ = fz.initialize(model=_model(), config=_config(3, "fp32"))
    x = _input("fp32")
    with torch.no_grad():
        quiet = engine(x)
    out = engine(x)
    error = _error(lambda: engine.backward(out.sum()))
    full = engine.module_state_dict()
    report(rank, out_dir, {"out": out.tolist(), "no_grad": quiet.tolist(), "error": error,
                           "state": {k: v.tolist() for k, v in full.items()}})  # fmt: skip
    from fzero.host import process_group

    process_group.shutdown()


@pytest.mark.timeout(120)
def test_two_processes_at_stage_3(tmp_path: Path) -> None:
    """On 2 gloo ranks (each holding half the parameters) the forwards are the plain module's."""
    spawn(_two_ranks, (2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    import json

    got = json.loads((tmp_path / "results.json").read_text())
    model = _model()
    want = model(_input("fp32")).detach()
    assert torch.equal(torch.tensor(got["out"]), want) and torch.equal(torch.tensor(got["no_grad"]), want)
    assert got["error"].startswith("RuntimeError: engine.backward(loss): this engine was built without an optimizer")
    assert all(torch.equal(torch.tensor(v), model.state_dict()[k]) for k, v in got["state"].items())


if __name__ == "__main__":
    _deepspeed_answers(sys.argv[1], sys.argv[2])

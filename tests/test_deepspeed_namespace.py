"""`fzero.deepspeed`'s small modules against DeepSpeed 0.19.8 itself (CPU accelerator): accelerator, comm,
checkpointing, moe.utils, compression.helper, runtime (utils, lr_schedules, dataloader) and utils (logging, groups).

DeepSpeed answers in a process of its own (importing it sets up global state), fzero in this one, through the same
procedures (tests/deepspeed_namespace_worker.py); the collectives run side by side on one gloo group of 2 processes.
Every public name of those DeepSpeed modules is fzero's too or raises `NotImplementedError` naming it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fzero.deepspeed as fz
from fzero.deepspeed import checkpointing, comm
from fzero.deepspeed.accelerator import get_accelerator
from fzero.deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from fzero.deepspeed.runtime import lr_schedules
from fzero.deepspeed.runtime import utils as runtime_utils
from tests import deepspeed_namespace_worker as w
from tests.bounds import assert_adam_close
from tests.spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
# what the launcher sets: the reference runs as a plain process
_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, timeout: float = 300, accelerator: str = "cpu") -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER}
    env.update(DS_ACCELERATOR=accelerator, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.deepspeed_namespace_worker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """DeepSpeed's answers (tests/deepspeed_namespace_worker.py `reference`)."""
    out = tmp_path_factory.mktemp("deepspeed") / "reference.json"
    _run("reference", str(out), str(_free_port()))
    return json.loads(out.read_text())


def _refused(obj, name: str) -> str | None:
    """None if `obj.name` exists, "missing" if it raises AttributeError, else its `NotImplementedError`'s message."""
    try:
        getattr(obj, name)
    except NotImplementedError as e:
        return str(e)
    except AttributeError:
        return "missing"
    return None


# ----------------------------------------------------------------------------------------------------- the names
@pytest.mark.timeout(600)
def test_every_deepspeed_name_is_there_or_refused_by_name(ds):
    """Each public name of DeepSpeed's modules (and each attribute of its CPU accelerator) exists in fzero's, or
    raises NotImplementedError naming the DeepSpeed name and saying what to use; never an AttributeError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (compression.helper's deprecation, as DeepSpeed's)
        targets = {path: w.module(fz, path) for path in w.MODULES}
    refused, wrong = 0, []
    for path, names in ds["names"].items():
        for name in names:
            if path == "utils" and name in fz.utils._TENSOR_FRAGMENT:  # (tests/test_deepspeed_zero.py's)
                continue
            message = _refused(targets[path], name)
            refused += message is not None
            if message is not None and not message.startswith(f"deepspeed.{path}.{name} is not supported by fzero: "):
                wrong.append(f"deepspeed.{path}.{name}: {message}")
    acc = get_accelerator()
    for name in ds["accelerator_names"]:
        message = _refused(acc, name)
        refused += message is not None
        if message is not None and f"CPU_Accelerator.{name} is not supported by fzero: " not in message:
            wrong.append(f"CPU_Accelerator.{name}: {message}")
    for name in fz._UNSUPPORTED:  # (DeepSpeed's top-level names fzero lacks)
        with pytest.raises(NotImplementedError, match=rf"^deepspeed\.{name} is not supported by fzero: "):
            getattr(fz, name)
    assert not wrong, wrong
    assert refused > 100  # (the check ran: DeepSpeed's internals are refused, not copied)
    with pytest.raises(AttributeError, match="nor has 'deepspeed.comm'"):
        comm.no_such_function  # noqa: B018 (a typo stays an AttributeError)


def test_utils_imports_the_safe_accessors_when_first_asked():
    tensor_fragment = importlib.import_module("fzero.deepspeed.utils.tensor_fragment")
    for name in fz.utils._TENSOR_FRAGMENT:
        assert getattr(fz.utils, name) is getattr(tensor_fragment, name), name


# --------------------------------------------------------------------------------------------------- accelerator
def test_the_accelerator_answers_as_deepspeeds_cpu_accelerator(ds, monkeypatch):
    acc = get_accelerator()
    assert acc is fz.get_accelerator() is get_accelerator()  # (one object, as DeepSpeed's)
    with torch.random.fork_rng():
        assert w.accelerator_answers(acc) == ds["accelerator"]
    monkeypatch.setenv("LOCAL_RANK", "0")  # (restored after the test: current_device sets and unsets it)
    assert w.current_device(acc) == ds["current_device"]  # (DeepSpeed's: the LOCAL_RANK string when set)
    # memory: the resident set size (psutil's, which DeepSpeed reads), its peak, and the host's memory
    import psutil

    assert abs(acc.memory_allocated() - psutil.Process().memory_info().rss) < 64 << 20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() == psutil.virtual_memory().total
    assert abs(acc.available_memory() - psutil.virtual_memory().available) < 256 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.timeout(300)
def test_the_cuda_accelerator_answers_as_deepspeeds(tmp_path):
    out = tmp_path / "cuda.json"
    _run("reference_cuda", str(out), accelerator="cuda")
    assert w.cuda_answers(CUDA_Accelerator()) == json.loads(out.read_text())


def test_the_accelerator_refuses_what_fzero_does_not_build(monkeypatch):
    acc = get_accelerator()
    refused = r"deepspeed\.accelerator\.cpu_accelerator\.CPU_Accelerator\.create_op_builder is not supported by fzero"
    with pytest.raises(NotImplementedError, match=refused + r": .*fzero\.deepspeed\.ops"):
        acc.create_op_builder("CPUAdamBuilder")
    with pytest.raises(NotImplementedError, match="deepspeed.accelerator.set_accelerator .* DS_ACCELERATOR"):
        fz.accelerator.set_accelerator  # noqa: B018
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert acc.device_count() == 3


# ---------------------------------------------------------------------------------------------- logging, helpers
def test_log_dist_logs_as_deepspeeds_before_a_group_exists(ds):
    assert w.log_dist_messages(fz.utils) == ds["log_dist"]
    assert fz.utils.logger is logging.getLogger("DeepSpeed")
    assert fz.utils.logger.level == logging.WARNING and not fz.utils.logger.propagate


def test_see_memory_usage_prints_deepspeeds_lines(ds):
    assert w.see_memory_usage_format(runtime_utils) == ds["see_memory_usage"]


def test_runtime_helpers_and_attribute_paths_as_deepspeeds(ds):
    assert w.runtime_helpers(runtime_utils) == ds["runtime"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        helper = importlib.import_module("fzero.deepspeed.compression.helper")
    with pytest.warns(FutureWarning, match="deepspeed.compression.helper is deprecated"):
        importlib.reload(helper)  # (its import warns, as DeepSpeed's)
    assert w.attribute_paths(helper) == ds["attributes"]
    assert fz.utils.recursive_getattr is helper.recursive_getattr


def test_moe_helpers_return_dense_groups_as_deepspeed(ds):
    assert w.moe_split(fz.moe.utils) == ds["moe"]
    expert = nn.Parameter(torch.zeros(2))
    expert.allreduce = False  # (how DeepSpeed's MoE layers mark an expert's parameter)
    with pytest.raises(NotImplementedError, match="1 parameter.* marked as an expert's"):
        fz.moe.utils.split_params_into_different_moe_groups_for_optimizer([{"params": [expert], "name": "g"}])


# ------------------------------------------------------------------------------------------------- checkpointing
def test_checkpoint_recomputes_the_same_gradients(ds):
    """DeepSpeed's checkpoint (with dropout and a keyword tensor input), fzero's and none: bitwise the same
    gradients of the parameters and of both inputs."""
    assert ds["checkpoint"] == ds["no_checkpoint"]
    assert w.checkpoint_grads(checkpointing.checkpoint) == ds["checkpoint"]

    def non_reentrant(block, x, scale):
        return checkpointing.non_reentrant_checkpoint(block, x, scale)

    assert w.checkpoint_grads(non_reentrant) == ds["checkpoint"]


def test_checkpointing_configure_refuses_what_fzero_cannot_honour(tmp_path):
    try:
        checkpointing.configure(None, synchronize=True, num_checkpoints=4)
        assert checkpointing.is_configured() and checkpointing.SYNCHRONIZE and checkpointing.num_layers == 4
        assert w.checkpoint_grads(checkpointing.checkpoint) == w.checkpoint_grads(None)
        for option in ("partition_activations", "contiguous_checkpointing", "checkpoint_in_cpu", "profile"):
            with pytest.raises(NotImplementedError, match=rf"configure\({option}=True\) is not supported by fzero"):
                checkpointing.configure(None, **{option: True})
        config = {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True}}
        with pytest.raises(NotImplementedError, match="cpu_checkpointing"):
            checkpointing.configure(None, deepspeed_config=config)

        class MPU:
            def get_model_parallel_world_size(self) -> int:
                return 2

        with pytest.raises(NotImplementedError, match="model-parallel world size of 2"):
            checkpointing.configure(MPU())
    finally:
        checkpointing.configure(None)  # (the module's defaults, for later tests)


# ----------------------------------------------------------------------------------------------------- schedules
def test_scheduler_objects_write_deepspeeds_learning_rates(ds):
    """WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle (per-group values, betas, step(k), load_state_dict):
    bitwise DeepSpeed's learning rates and betas in the optimizer's groups."""
    assert w.schedule_traces(lr_schedules) == ds["schedules"]
    with pytest.raises(NotImplementedError, match="deepspeed.runtime.lr_schedules.LRRangeTest"):
        lr_schedules.LRRangeTest  # noqa: B018


def _tensors(params: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([float.fromhex(v) for v in values], dtype=torch.float64) for k, values in params.items()}


def test_the_engine_trains_as_deepspeeds_with_a_client_scheduler_and_checkpoints(ds):
    """fzero.deepspeed.initialize with a client scheduler object (WarmupDecayLR; OneCycle, which sets the betas too)
    on a model whose blocks go through checkpointing.checkpoint: bitwise the run with the config's scheduler block
    on the model without checkpoints; against DeepSpeed's engine with its own scheduler object and checkpoint, the
    learning rates bitwise and the parameters within Adam's step bound (the two engines' AdamW steps round apart by
    an ulp after a few steps, with or without schedules and checkpoints: tests/bounds.py's kind 3)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fzero's notes on config keys it reads differently)
        for schedule in w.ENGINE_SCHEDULES:
            client = w.engine_run(fz, schedule, lr_schedules, checkpointing.checkpoint)
            assert client == w.engine_run(fz, schedule), schedule
            if schedule == "WarmupDecayLR":
                assert client["lrs"] == ds["engine"]["lrs"]
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    start = {k: v.double().flatten() for k, v in w.Checkpointed(None).state_dict().items()}
                got, ref = _tensors(client["params"]), _tensors(ds["engine"]["params"])
                assert_adam_close(got, ref, start, w.ENGINE_LR, w.ENGINE_STEPS)


# ----------------------------------------------------------------------------------------------------- processes
@pytest.mark.timeout(600)
def test_one_rank_without_a_launcher(ds, tmp_path):
    """fzero's init_distributed in a plain process makes the one-rank group a launcher's single process has under
    DeepSpeed: rank 0 of 1, local rank 0, gloo; log_dist then logs as rank 0."""
    out = tmp_path / "fzero.json"
    _run("fzero_one_rank", str(out))
    assert json.loads(out.read_text()) == ds["one_rank"]


@pytest.mark.timeout(600)
def test_collectives_on_two_ranks_are_deepspeeds(tmp_path):
    """On one gloo group of 2 processes: rank, world size, local rank, all_reduce (sum, avg, max; DeepSpeed's and
    torch's ReduceOp; async), all_gather (list and tensor), reduce_scatter, broadcast, all_to_all, send/recv, batched
    isend/irecv, all_gather_object, barrier, a new group: bitwise DeepSpeed's results; log_dist and the data-parallel
    group queries alike on each rank."""
    spawn(w.two_ranks, (2, str(tmp_path)), 2)
    everyone = json.loads((tmp_path / "results.json").read_text())
    for rank, results in enumerate(everyone):
        assert results["fzero"] == results["deepspeed"], rank
        assert results["fzero"]["comm"]["rank"] == rank
    assert everyone[0]["fzero"]["log_dist"] != everyone[1]["fzero"]["log_dist"]  # (ranks=[0] / [1] differ)

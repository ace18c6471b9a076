"""The DeepSpeed-compatible engine: the documentation's seed example (1 process and 2 gloo processes), bitwise
equality with the functional `train_step` for every stage and precision, DeepSpeed's semantics (gradient
accumulation, `scale_wrt_gas`, double backward, counters, skipped steps, schedules) and its errors."""

from __future__ import annotations

import argparse
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.config import ConfigError, UnsupportedConfigError
from fzero.metrics import read_jsonl
from tests import engine_worker
from tests.bounds import assert_adam_close
from tests.spawn import spawn
from tests.support import mlp


def _params(engine) -> dict[str, torch.Tensor]:
    return engine.module_state_dict()


# ------------------------------------------------------------------------------------------------ the seed example
def test_seed_example_single_process():
    engine, returned = engine_worker.seed_example(fzero, steps=12)
    assert repr(engine.mesh) == "SimRank(rank=0 of SimMesh(world=1))"
    assert engine.train_micro_batch_size_per_gpu() == 8  # 32 / (4 * 1)
    assert (engine.micro_steps, engine.global_steps, engine.global_samples) == (12, 3, 96)
    # fp16 starts at 2**16: the first boundary overflows (hysteresis 2 keeps the scale), the second halves it
    assert engine.skipped_steps == 2 and engine.optimizer.cur_scale == 2.0**15
    assert engine.loss_scale() == 0.0  # DeepSpeed's: the configured fp16.loss_scale (0: dynamic)
    assert engine.applied_updates() == 1 and engine.get_lr() == [1e-4]
    assert all(math.isfinite(r) for r in returned)
    assert isinstance(engine.optimizer, torch.optim.Optimizer) and engine.optimizer.kind == "adamw"


def test_seed_example_double_backward_variant():
    twice, returned = engine_worker.seed_example(fzero, steps=16, retain_graph=True)
    plain, _ = engine_worker.seed_example(fzero, steps=16)
    assert (twice.global_steps, twice.micro_steps) == (4, 16) and twice.applied_updates() > 0
    assert all(math.isfinite(r) for r in returned)
    assert not all(torch.equal(v, _params(plain)[k]) for k, v in _params(twice).items())


@pytest.mark.parametrize("stage", [0, 2])
def test_second_backward_accumulates_like_torch(stage):
    """`backward(loss, retain_graph=True); backward(loss)` adds both gradients into the micro-step's, as DeepSpeed
    (whose gradients accumulate in `.grad`) and torch do: bitwise plain torch SGD on one rank."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    engine, *_ = fzero.initialize(model=model, config=_sgd_config(1, zero_optimization={"stage": stage}))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    for x, y in _regression(n=3):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss, retain_graph=True)
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        opt.step()
    assert all(torch.equal(_params(engine)[k], v) for k, v in ref.state_dict().items())


@pytest.mark.timeout(600)
def test_seed_example_and_equivalence_on_two_gloo_processes(tmp_path):
    spawn(engine_worker.run, (2, str(tmp_path)), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    for variant, r in results["seed"].items():
        assert r["mesh"] == "DistMesh(world=2, rank=0, backend=gloo)", variant
        assert r["micro_batch"] == 4  # 32 / (4 * 2)
        assert (r["micro_steps"], r["global_steps"], r["global_samples"]) == (16, 4, 128)
        assert r["skipped_steps"] < 4  # at least one update applied
        assert r["same_on_all_ranks"], variant
    assert results["seed"]["retain_graph"]["params"] != results["seed"]["plain"]["params"]
    for case, r in results["cases"].items():
        assert r["mesh"] == "DistMesh(world=2, rank=0, backend=gloo)"
        assert r["differ"] == {}, case  # the engine adds no arithmetic: bitwise train_step's parameters
        assert r["global_steps"] == 3
        assert r["module_empty"] == case.startswith("3-"), case


# --------------------------------------------------------------------------------- engine == functional train_step
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_equals_train_step_gpt(stage, precision):
    r = engine_worker.compare_with_train_step(stage, precision, 2, "gpt")
    assert r["differ"] == {}
    assert r["global_steps"] == 3


@settings(max_examples=12)
@given(stage=st.integers(0, 3), precision=st.sampled_from(["fp32", "bf16", "fp16"]), gas=st.integers(1, 3))
def test_engine_equals_train_step_mlp(stage, precision, gas):
    r = engine_worker.compare_with_train_step(stage, precision, gas, "mlp")
    assert r["differ"] == {}


# --------------------------------------------------------------------------------------- DeepSpeed's semantics
def _regression(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _sgd_config(gas: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}  # fmt: skip


@pytest.mark.parametrize("scale_wrt_gas", [True, False])
def test_gradient_accumulation_mean_or_sum_like_deepspeed(scale_wrt_gas):
    """DeepSpeed divides each micro-batch's gradients by GAS (the mean); `scale_wrt_gas=False` leaves their sum.
    The reference is plain torch: `(loss / GAS).backward()` per micro-batch, or `loss.backward()`."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    engine, *_ = fzero.initialize(model=model, config=_sgd_config(2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    for i, (x, y) in enumerate(_regression()):
        loss = F.mse_loss(engine(x), y)
        out = engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        assert torch.equal(out, loss.detach() / 2 if scale_wrt_gas else loss.detach())
        engine.step()
        ref_loss = F.mse_loss(ref(x), y)
        (ref_loss / 2 if scale_wrt_gas else ref_loss).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    got = _params(engine)
    for name, value in ref.state_dict().items():
        # bitwise either way: GAS = 2 is a power of two, so halving is exact (no subnormals here) and scales every
        # term of the backward exactly: (g1 + g2) / 2 == g1 / 2 + g2 / 2, (2 g1 + 2 g2) / 2 == g1 + g2
        assert torch.equal(got[name], value), name


def test_counters_and_boundary_follow_deepspeed():
    engine, *_ = fzero.initialize(model=mlp([5, 7, 3], 0), config=_sgd_config(3))
    boundaries = []
    for x, y in _regression(n=6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    assert boundaries == [False, False, True, False, False, True]
    assert (engine.micro_steps, engine.global_steps, engine.global_samples, engine.skipped_steps) == (6, 2, 24, 0)
    assert engine.gradient_accumulation_steps() == 3 and engine.train_batch_size() == 12
    assert engine.zero_optimization_stage() == 0 and engine.get_global_grad_norm() > 0


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_skipped_step_advances_global_steps_but_not_the_schedule(precision):
    """An inf loss on one boundary: `skipped_steps` and `global_steps` advance, the optimizer's update count and
    so the learning rate schedule do not (DeepSpeed steps its scheduler on applied updates only)."""
    cfg = _sgd_config(1, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear",
                                                                    "warmup_max_lr": 0.1}})  # fmt: skip
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, _, _, scheduler = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg)
    schedule = fzero.optim.warmup_lr(0.0, 0.1, 4, "linear")
    lrs, skipped = [], []
    for i, (x, y) in enumerate(_regression(n=6)):
        lrs.append(engine.get_lr()[0])
        x = x.half() if precision == "fp16" else x
        loss = F.mse_loss(engine(x).float(), y) * (math.inf if i == 2 else 1.0)
        engine.backward(loss)
        engine.step()
        skipped.append(engine.optimizer.overflow)
        assert engine.was_step_applied() == (i != 2)
    assert skipped == [False, False, True, False, False, False]
    assert (engine.global_steps, engine.skipped_steps, engine.applied_updates()) == (6, 1, 5)
    assert lrs == [schedule(n) for n in (0, 1, 2, 2, 3, 4)]  # the skipped step used, and kept, update 2's lr
    assert scheduler.last_batch_iteration == 4
    with pytest.raises(RuntimeError, match="do not call lr_scheduler.step"):
        scheduler.step()


def test_client_torch_optimizer_and_scheduler_match_torch():
    """A client `torch.optim.AdamW` with a torch `LambdaLR`: the engine reads the learning rate the scheduler
    sets and steps the scheduler after each applied update; bitwise plain torch (one rank: the same kernels)."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0}
    engine, eng_opt, _, eng_sched = fzero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    assert eng_opt is opt and eng_sched is sched
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda n: 1.0 / (n + 1))
    for x, y in _regression(n=4):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    assert engine.get_lr() == ref_sched.get_last_lr()
    for name, value in ref.state_dict().items():
        assert torch.equal(_params(engine)[name], value), name


def test_adam_is_adamw_unless_adam_w_mode_false():
    def run(params):
        cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "optimizer": {"type": "Adam", "params": params}}
        engine, opt, _, _ = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg)
        for x, y in _regression(n=2):
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        return opt.kind, _params(engine)

    def torch_run(cls):
        ref = mlp([5, 7, 3], 0)
        opt = cls(ref.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
        for x, y in _regression(n=2):
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            opt.step()
        return ref.state_dict()

    # on the CPU the config's Adam runs the native fused kernel (as DeepSpeed runs its fused or CPU Adam): within
    # the kernel's float32 bound (tests/test_native.py); `torch_adam` runs torch's ops: bitwise
    kind, got = run({"lr": 0.01, "weight_decay": 0.1})
    want = torch_run(torch.optim.AdamW)
    assert kind == "adamw"
    assert_adam_close(got, want, mlp([5, 7, 3], 0).state_dict(), 0.01, 2)
    kind, got = run({"lr": 0.01, "weight_decay": 0.1, "torch_adam": True})
    assert kind == "adamw" and all(torch.equal(got[k], v) for k, v in want.items())
    kind, got = run({"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False, "torch_adam": True})
    assert kind == "adam" and all(torch.equal(got[k], v) for k, v in torch_run(torch.optim.Adam).items())


def test_direct_scaled_backward_equals_engine_backward():
    """DeepSpeed's manual path `engine.scale(loss).backward()` gives the gradients `engine.backward(loss)` gives."""
    cfg = {"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": 128},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}  # fmt: skip
    a, *_ = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg)
    b, *_ = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg)
    for x, y in _regression(n=3):
        a.backward(F.mse_loss(a(x.half()).float(), y))
        a.step()
        b.scale(F.mse_loss(b(x.half()).float(), y)).backward()
        b.step()
    assert all(torch.equal(v, _params(b)[k]) for k, v in _params(a).items())


def test_module_tracks_the_state_and_train_eval_reach_it():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))
    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 1}}}
    engine, *_ = fzero.initialize(model=model, config=cfg)
    for x, y in _regression(n=2):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    consolidated = engine.module_state_dict()
    live = engine.module.state_dict()
    assert all(torch.equal(live[k], v) for k, v in consolidated.items())  # BatchNorm statistics included
    assert int(live["1.num_batches_tracked"]) == 2
    engine.eval()
    assert not engine.module.training
    with torch.no_grad():
        engine(torch.randn(3, 5))
    assert int(engine.module.state_dict()["1.num_batches_tracked"]) == 2


def test_training_data_and_args_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    parser = fzero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    data = torch.utils.data.TensorDataset(torch.randn(20, 5), torch.randn(20, 3))
    _, _, loader, scheduler = fzero.initialize(args=args, model=mlp([5, 3], 0), training_data=data)
    assert scheduler is None and [len(x) for x, _ in loader] == [6, 6, 6, 2]
    with pytest.raises(ValueError, match="Not sure how to proceed"):
        fzero.initialize(args=args, model=mlp([5, 3], 0), config={"train_batch_size": 2})


def test_metrics_jsonl_and_console_line(tmp_path):
    lines: list[str] = []
    cfg = _sgd_config(2, steps_per_print=2, wall_clock_breakdown=True,
                      fzero_metrics={"jsonl": str(tmp_path / "m.jsonl"), "warmup_steps": 1})  # fmt: skip
    engine, *_ = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg, printer=lines.append)
    for x, y in _regression(n=8):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    engine.close()
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["timed"] for r in records] == [False, True, True, True]
    assert all(r["samples_per_s"] == pytest.approx(8 / r["step_time"]) for r in records)
    assert {"loss", "lr", "loss_scale", "skipped", "grad_norm", "forward_ms", "backward_ms", "step_ms"} <= set(
        records[0]
    )
    assert len(lines) == 2 and lines[0].startswith("step 2 | loss ") and "samples/s" in lines[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_optimizer_config(stage):
    """`offload_optimizer.device: cpu` runs the CPU Adam kernel in the same preset chain: the parameters agree with
    the torch-op AdamW run (the kernel's fused multiply-adds, a different but fixed operation order) within
    tests/bounds.py's float32 check."""
    runs = []
    for device in ("none", "cpu"):
        cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
        engine, *_ = fzero.initialize(model=mlp([5, 7, 3], 0), config=cfg)
        for x, y in _regression(n=6):
            engine.backward(F.mse_loss(engine(x.bfloat16()).float(), y))
            engine.step()
        runs.append(_params(engine))
    assert_adam_close(runs[1], runs[0], mlp([5, 7, 3], 0).state_dict(), 1e-2, 3)


# ------------------------------------------------------------------------------------------------------- errors
def test_errors_are_clear():
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = fzero.initialize(model=mlp([5, 3], 0), config=cfg)
    with pytest.raises(RuntimeError, match="no engine\\(...\\) forward"):
        engine.backward(torch.tensor(1.0, requires_grad=True))
    with pytest.raises(RuntimeError, match="call engine.backward"):
        engine.step()
    out = engine(torch.randn(4, 5))
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(out)
    with pytest.raises(RuntimeError, match="call engine.step\\(\\), not optimizer.step"):
        engine.optimizer.step()
    with pytest.raises(ValueError, match="requires a model"):
        fzero.initialize(config=cfg)
    forward_only, *_ = fzero.initialize(model=mlp([5, 3], 0), config={"train_batch_size": 4})  # no optimizer
    with pytest.raises(RuntimeError, match="built without an optimizer"):  # (tests/test_engine_forward_only.py)
        forward_only.step()
    model = mlp([5, 7, 3], 0)
    with pytest.raises(ValueError, match="'2.weight' \\(and 1 more\\) requires grad but is in no param group"):
        fzero.initialize(model=model, model_parameters=list(model.parameters())[:2], config=cfg)
    with pytest.raises(UnsupportedConfigError, match="RMSprop is not supported"):
        fzero.initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters()), config={"train_batch_size": 4})
    with pytest.raises(ConfigError, match="zero_optimization.stage: expected an integer in \\[0, 3\\], got 7"):
        fzero.initialize(model=model, config={**cfg, "zero_optimization": {"stage": 7}})


@pytest.mark.timeout(600)
def test_stage3_step_without_backward_raises_on_two_processes(tmp_path):
    """At stage 3 the engine's gradients arrive unit by unit during the backward: a step with no backward must not
    apply an update from the zeros it would otherwise reduce."""
    spawn(engine_worker.no_backward, (2, str(tmp_path)), 2)

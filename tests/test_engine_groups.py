"""Param groups through the DeepSpeed-compatible engine, and the details found side by side with DeepSpeed 0.19.8.

- `model_parameters` as group dicts with the config's optimizer, and client `torch.optim` AdamW / Adam / SGD with
  several groups, against plain `torch.optim` with the same groups: bitwise at world 1 (one micro-step: the same
  kernels on the same values, docs/equivalence.md); the view's groups mirror the user's; `get_lr()` / `get_mom()`
  one entry per group, as DeepSpeed's; a client scheduler drives each group; the config's schedulers drive every
  group as DeepSpeed's do (against the transcription of its schedulers in tests/test_schedules.py).
- The errors: a parameter in two groups, a trainable one in none (DeepSpeed's rule said), unknown hyper keys,
  tensors that are not the model's; frozen parameters and empty groups as DeepSpeed treats them.
- `torch_adam` (torch.optim.AdamW's defaults), the bf16 master option, `save_checkpoint`'s True, the console line.
- On 2 gloo processes (tests/groups_engine_worker.py): the Hugging Face Trainer's grouping on a tiny GPT-2 at stages
  2 and 3.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.config import ConfigError, UnsupportedConfigError
from fzero.metrics import read_jsonl
from tests import groups_engine_worker
from tests.bounds import assert_adam_close, assert_within
from tests.spawn import spawn
from tests.support import mlp
from tests.test_schedules import deepspeed_values

STEPS = 4


def _data(n: int = STEPS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _groups(model: nn.Module) -> list[dict]:
    """Three groups with different lr / weight_decay / betas / eps, and keys of the user's own."""
    p = dict(model.named_parameters())
    return [
        {"params": [p["0.weight"], p["2.weight"]], "weight_decay": 0.1, "name": "decay"},
        {"params": [p["0.bias"]], "lr": 3e-2, "betas": (0.8, 0.99), "weight_decay": 0.0, "name": "bias", "tag": 7},
        {"params": [p["2.bias"]], "eps": 1e-6, "weight_decay": 0.0},
    ]


def _train(engine, data):
    lrs = []
    for x, y in data:
        lrs.append(engine.get_lr())
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return lrs


def _torch(model, opt, data, sched=None, lrs_of=None):
    """Plain torch on the same data; `lrs_of(k)` sets each group's lr before update k (a schedule written out)."""
    for k, (x, y) in enumerate(data):
        if lrs_of is not None:
            for group, lr in zip(opt.param_groups, lrs_of(k), strict=True):
                group["lr"] = lr
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model.state_dict()


def _bitwise(engine, want):
    got = engine.module_state_dict()
    differ = [k for k, v in want.items() if not torch.equal(got[k], v)]
    assert not differ, differ


def _config(opt="AdamW", fused=False, **extra):
    """`torch_adam` unless `fused`: torch's ops, bitwise torch.optim (the CPU default is the native fused kernel);
    weight decay 0 where no group sets it (DeepSpeed's default, which `torch_adam` would make torch's 0.01)."""
    adam = {"lr": 1e-2, "torch_adam": not fused, "weight_decay": 0.0}
    params = adam if opt != "SGD" else {"lr": 0.1, "momentum": 0.9}
    # off: DeepSpeed 0.19.3+ clips at 1.0 by default
    return {"train_batch_size": 4, "gradient_clipping": 0.0, "optimizer": {"type": opt, "params": params}, **extra}


# ---------------------------------------------------------------------------------------- model_parameters dicts
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_parameters_groups_equal_torch_adamw(stage):
    """Config AdamW over three group dicts: bitwise `torch.optim.AdamW` with the same groups (world 1); the view has
    one group per user group, in order, with the user's keys, the values each group trains with."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    cfg = _config(zero_optimization={"stage": stage})
    engine, opt, _, _ = fzero.initialize(model=model, model_parameters=_groups(model), config=cfg)
    assert [(g.get("name"), g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in opt.param_groups] == [
        ("decay", 1e-2, 0.1, (0.9, 0.999), 1e-8), ("bias", 3e-2, 0.0, (0.8, 0.99), 1e-8),
        (None, 1e-2, 0.0, (0.9, 0.999), 1e-6),
    ]  # fmt: skip
    assert opt.param_groups[1]["tag"] == 7 and opt.param_groups[1]["params"] == [model[0].bias]
    lrs = _train(engine, _data())
    assert lrs == [[1e-2, 3e-2, 1e-2]] * STEPS
    assert engine.get_mom() == [(0.9, 0.999), (0.8, 0.99), (0.9, 0.999)]
    _bitwise(engine, _torch(ref, torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, foreach=False), _data()))


def test_groups_with_offload_run_the_c_kernel_per_group():
    """`offload_optimizer.device: cpu` with groups: the native kernel's grouped step against torch AdamW with the same
    groups, within tests/bounds.py's float32 check (the kernel's fused multiply-adds: a fixed but different
    operation order)."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    cfg = _config(fused=True, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    engine, *_ = fzero.initialize(model=model, model_parameters=_groups(model), config=cfg)
    _train(engine, _data())
    want = _torch(ref, torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, foreach=False), _data())
    assert_adam_close(engine.module_state_dict(), want, mlp([5, 7, 3], 0).state_dict(), 3e-2, STEPS, (0.8, 0.99))


def test_sgd_groups_and_get_mom_reads_momentum():
    """Config SGD with per-group momentum and lr: bitwise torch SGD; `get_mom()` is each group's momentum (DeepSpeed
    reads `momentum` for a config SGD)."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    p = dict(model.named_parameters())
    groups = lambda p: [{"params": [p["0.weight"], p["0.bias"]], "momentum": 0.5},  # noqa: E731
                        {"params": [p["2.weight"], p["2.bias"]], "lr": 0.05, "nesterov": True}]  # fmt: skip
    engine, *_ = fzero.initialize(model=model, model_parameters=groups(p), config=_config("SGD"))
    _train(engine, _data())
    assert engine.get_mom() == [0.5, 0.9] and engine.get_lr() == [0.1, 0.05]
    want = _torch(ref, torch.optim.SGD(groups(dict(ref.named_parameters())), lr=0.1, momentum=0.9, foreach=False),
                  _data())  # fmt: skip
    _bitwise(engine, want)


@pytest.mark.parametrize(
    "scheduler",
    [
        {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_min_lr": [1e-4, 0.0, 1e-3]}},  # max: own lr
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                             "warmup_max_lr": [2e-2, 5e-2, 1e-2], "warmup_type": "linear"}},
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
        {"type": "OneCycle", "params": {"cycle_min_lr": [1e-3, 2e-3, 1e-3], "cycle_max_lr": 3e-2,
                                        "cycle_first_step_size": 2, "cycle_min_mom": [0.8, 0.85, 0.8]}},
    ],
    ids=lambda s: s["type"],
)  # fmt: skip
def test_config_schedulers_drive_every_group_as_deepspeeds(scheduler):
    """Every DeepSpeed scheduler over three groups: `get_lr()` (and OneCycle's `get_mom()`) before each update equal
    DeepSpeed's scheduler (tests/test_schedules.py's transcription) on those groups, bitwise, and the training
    equals torch AdamW with those per-group learning rates (and betas) written into its groups."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    engine, opt, _, sched = fzero.initialize(model=model, model_parameters=_groups(model),
                                             config=_config(scheduler=scheduler))  # fmt: skip
    steps = 7
    want = deepspeed_values(scheduler["type"], scheduler["params"], [1e-2, 3e-2, 1e-2], updates=steps)
    got, moms = [], []
    for x, y in _data(steps):
        got.append(engine.get_lr())
        assert [g["lr"] for g in opt.param_groups] == got[-1]  # the view shows the next update's values
        moms.append([m[0] for m in engine.get_mom()])
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    assert got == [lrs for lrs, _ in want]
    if scheduler["type"] == "OneCycle":
        assert moms == [m for _, m in want]
    assert sched.get_lr() == engine.get_lr()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, foreach=False)

    def lrs_of(k):
        if want[k][1] is not None:  # OneCycle: beta1 per group, beta2 0.99
            for group, m in zip(ref_opt.param_groups, want[k][1], strict=True):
                group["betas"] = (m, 0.99)
        return want[k][0]

    _bitwise(engine, _torch(ref, ref_opt, _data(steps), lrs_of=lrs_of))


def test_client_scheduler_on_the_view_drives_each_group():
    """A client scheduler built on the returned optimizer (`lr_scheduler=callable`, as DeepSpeed calls it with its
    optimizer): a `LambdaLR` with one lambda per group changes group i's lr, which group i trains with."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    lambdas = [lambda n: 1.0 / (n + 1), lambda n: 0.5**n, lambda n: 1.0]
    make = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambdas)  # noqa: E731
    engine, *_ = fzero.initialize(model=model, model_parameters=_groups(model), config=_config(), lr_scheduler=make)
    lrs = _train(engine, _data())
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, weight_decay=0.0, foreach=False)
    ref_sched = make(ref_opt)
    _bitwise(engine, _torch(ref, ref_opt, _data(), sched=ref_sched))
    assert lrs[1] == [1e-2 / 2, 3e-2 / 2, 1e-2] and engine.get_lr() == ref_sched.get_last_lr()


def test_the_view_refuses_a_group_added_after_initialize_and_imports_no_dynamo():
    """The view's groups are the engine's: a group added afterwards would silently not train, so
    `add_param_group` refuses it (naming what to do); building the view does not import `torch._dynamo` (torch's
    own `add_param_group` would: 72 MiB resident for a view that never steps), in a fresh interpreter."""
    model = mlp([5, 7, 3], 0)
    _, optimizer, *_ = fzero.initialize(model=model, model_parameters=_groups(model), config=_config())
    with pytest.raises(RuntimeError, match="add_param_group: the engine trains the parameters given"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in _groups(model)]
    code = (
        "import sys, torch, fzero\n"
        "m = torch.nn.Linear(3, 2)\n"
        "fzero.initialize(model=m, config={'train_micro_batch_size_per_gpu': 1, "
        "'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}}, mesh=fzero.SimMesh(1))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------------------- client torch.optim groups
@pytest.mark.parametrize("scheduled", [True, False])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_client_optimizer_groups(cls, scheduled):
    """A client AdamW / Adam / SGD with several groups, with a `LambdaLR` per group or none: bitwise the same torch
    run; `get_lr()` is each group's lr (the scheduler's `get_last_lr()`); `get_mom()` as DeepSpeed reads it for a
    client optimizer (betas, 0.0 where a group has none: SGD)."""
    kw = {"momentum": 0.9} if cls is torch.optim.SGD else {"weight_decay": 0.05}

    def groups(m):
        p = dict(m.named_parameters())
        return [{"params": [p["0.weight"], p["2.weight"]]}, {"params": [p["0.bias"], p["2.bias"]], "lr": 0.03,
                                                              "weight_decay": 0.0}]  # fmt: skip

    lambdas = [lambda n: 0.9**n, lambda n: 1.0 / (n + 1)]
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    opt = cls(groups(model), lr=0.01, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas) if scheduled else None
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0}
    engine, eng_opt, _, eng_sched = fzero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    assert eng_opt is opt and eng_sched is sched
    _train(engine, _data())
    ref_opt = cls(groups(ref), lr=0.01, foreach=False, **kw)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambdas) if scheduled else None
    _bitwise(engine, _torch(ref, ref_opt, _data(), sched=ref_sched))
    assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups] and len(engine.get_lr()) == 2
    assert engine.get_mom() == ([0.0, 0.0] if cls is torch.optim.SGD else [(0.9, 0.999)] * 2)


def test_config_scheduler_on_a_client_optimizer_uses_each_groups_lr():
    """DeepSpeed builds the config's scheduler on a client optimizer: WarmupCosineLR scales each group's own lr."""
    model = mlp([5, 7, 3], 0)
    p = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p["0.weight"], p["0.bias"]]}, {"params": [p["2.weight"], p["2.bias"]],
                                                                          "lr": 0.1}], lr=0.01)  # fmt: skip
    scheduler = {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 2}}
    engine, *_ = fzero.initialize(model=model, optimizer=opt, config={"train_batch_size": 4, "scheduler": scheduler})
    lrs = _train(engine, _data(6))
    assert lrs == [g for g, _ in deepspeed_values("WarmupCosineLR", scheduler["params"], [0.01, 0.1], updates=6)]
    assert [g["lr"] for g in opt.param_groups] == engine.get_lr()  # written into the client's groups, as DeepSpeed


# ------------------------------------------------------------------------------------- frozen, empty, the errors
def test_frozen_parameters_in_groups_are_ignored_and_empty_groups_dropped():
    """Frozen parameters inside a group are ignored and a group without parameters is dropped (DeepSpeed's rules):
    the trainable ones train as torch trains them (torch skips parameters without gradients); `get_lr()` has one
    entry per group with parameters; a group with only frozen ones stays and trains nothing."""
    model = mlp([5, 7, 3], 0)
    model[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)

    def groups(m):
        p = dict(m.named_parameters())
        return [{"params": [p["0.weight"], p["2.weight"]], "weight_decay": 0.1}, {"params": [], "lr": 9.0},
                {"params": [p["0.bias"], p["2.bias"]], "lr": 0.03}]  # fmt: skip

    engine, opt, _, _ = fzero.initialize(model=model, model_parameters=groups(model), config=_config())
    assert len(opt.param_groups) == 2 and engine.get_lr() == [1e-2, 3e-2]
    _train(engine, _data())
    _bitwise(engine, _torch(ref, torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.0, foreach=False), _data()))
    frozen_only = [{"params": [model[0].weight], "lr": 5.0}, {"params": [model[0].bias, model[2].weight,
                                                                          model[2].bias]}]  # fmt: skip
    engine, *_ = fzero.initialize(model=model, model_parameters=frozen_only, config=_config())
    assert engine.get_lr() == [5.0, 1e-2]


def test_group_errors_name_what_is_wrong():
    model = mlp([5, 7, 3], 0)
    w0, b0, w2, b2 = (dict(model.named_parameters())[k] for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
    init = lambda groups, **kw: fzero.initialize(model=model, model_parameters=groups, config=_config(**kw))  # noqa: E731
    with pytest.raises(ValueError, match=r"parameter '0.bias' is in param groups 0 and 1 of model_parameters"):
        init([{"params": [w0, b0]}, {"params": [b0, w2, b2]}])
    with pytest.raises(ValueError, match=r"parameter '0.weight' is twice in param group 0"):
        init([{"params": [w0, w0, b0, w2, b2]}])
    with pytest.raises(ValueError, match=r"'2.bias' requires grad but is in no param group .* DeepSpeed 0.19 would "
                                         r"silently leave it untrained"):  # fmt: skip
        init([{"params": [w0, b0, w2]}])
    with pytest.raises(ValueError, match=r"model_parameters\[1\] holds a tensor of shape \(3,\) that is not a param"):
        init([{"params": [w0, b0, w2, b2]}, {"params": [nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(ValueError, match=r"model_parameters\[1\] sets 'momentum', 'amsgrad': not a hyper-parameter "
                                         r"of AdamW, which takes lr, betas, eps, weight_decay"):  # fmt: skip
        init([{"params": [w0, b0]}, {"params": [w2, b2], "momentum": 0.9, "amsgrad": True}])
    with pytest.raises(ValueError, match=r"sets 'weight_deacy' \(did you mean 'weight_decay'\?\)"):
        init([{"params": [w0, b0]}, {"params": [w2, b2], "weight_deacy": 0.0}])
    with pytest.raises(ValueError, match=r"model_parameters\[1\]: invalid learning rate: -1"):
        init([{"params": [w0, b0]}, {"params": [w2, b2], "lr": -1.0}])
    with pytest.raises(ValueError, match=r"model_parameters\[1\]: betas must be a pair"):
        init([{"params": [w0, b0]}, {"params": [w2, b2], "betas": [0.9]}])
    with pytest.raises(TypeError, match=r"not a set"):
        init([{"params": {w0, b0}}, {"params": [w2, b2]}])
    with pytest.raises(TypeError, match=r"mixes param-group dicts and tensors"):
        init([{"params": [w0, b0]}, w2, b2])
    with pytest.raises(ValueError, match=r'model_parameters\[0\] has no "params"'):
        init([{"lr": 0.1}])
    with pytest.raises(ConfigError, match=r"scheduler.params.cycle_max_lr: expected 2 values \(one per param group"):
        init(
            [{"params": [w0, b0]}, {"params": [w2, b2]}],
            scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": [0.1, 0.2, 0.3]}},
        )
    adam = torch.optim.Adam([{"params": [w0, b0]}, {"params": [w2, b2], "decoupled_weight_decay": True}])
    with pytest.raises(UnsupportedConfigError, match="differ in decoupled_weight_decay"):
        fzero.initialize(model=model, optimizer=adam, config={"train_batch_size": 4})
    amsgrad = torch.optim.AdamW([{"params": [w0, b0]}, {"params": [w2, b2], "amsgrad": True}])
    with pytest.raises(UnsupportedConfigError, match="param groups 0 and 1 of AdamW differ in amsgrad"):
        fzero.initialize(model=model, optimizer=amsgrad, config={"train_batch_size": 4})
    maximize = torch.optim.AdamW([{"params": [w0, b0]}, {"params": [w2, b2], "maximize": True}])
    with pytest.raises(UnsupportedConfigError, match=r"AdamW\(maximize=True\) is not supported \(param group 1\)"):
        fzero.initialize(model=model, optimizer=maximize, config={"train_batch_size": 4})
    missing = torch.optim.SGD([{"params": [w0, b0, w2]}], lr=0.1)
    with pytest.raises(ValueError, match=r"'2.bias' requires grad but is in no param group of the client optim"):
        fzero.initialize(model=model, optimizer=missing, config={"train_batch_size": 4})


# ---------------------------------------------------------------------------------------------------- torch_adam
@pytest.mark.parametrize(
    ("params", "torch_cls", "torch_kw", "offload"),
    [
        ({"torch_adam": True}, torch.optim.AdamW, {}, False),  # torch.optim.AdamW's own default weight decay, 0.01
        ({"torch_adam": True}, torch.optim.AdamW, {}, True),
        ({}, torch.optim.AdamW, {"weight_decay": 0.0}, False),  # DeepSpeed's FusedAdam / CPU Adam: 0
        ({"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, {}, False),  # torch.optim.Adam, default 0
        ({"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, {}, True),
        ({"torch_adam": True, "weight_decay": 0.2}, torch.optim.AdamW, {"weight_decay": 0.2}, False),
        ({"torch_adam": True, "amsgrad": True}, torch.optim.AdamW, {"amsgrad": True}, True),  # torch's AMSGrad
    ],
)
def test_torch_adam_trains_as_deepspeeds_torch_optimizer(params, torch_cls, torch_kw, offload):
    """`optimizer.params.torch_adam` makes DeepSpeed build `torch.optim.AdamW` (or `Adam` without `adam_w_mode`)
    from the config's params, whose defaults then apply: the same config trains bitwise like that torch optimizer
    (with optimizer offload too: torch's arithmetic, not the C kernel)."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu" if offload else "none"}}
    cfg = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, **params}},
        "zero_optimization": zero,
    }
    engine, opt, _, _ = fzero.initialize(model=model, config=cfg)
    _train(engine, _data())
    want = _torch(ref, torch_cls(ref.parameters(), lr=0.05, foreach=False, **torch_kw), _data())
    if params.get("torch_adam"):
        _bitwise(engine, want)
    else:  # DeepSpeed's fused Adam's counterpart, the native kernel: within its float32 bound (tests/test_native.py)
        assert_adam_close(engine.module_state_dict(), want, mlp([5, 7, 3], 0).state_dict(), 0.05, STEPS)
    assert opt.param_groups[0]["weight_decay"] == torch_kw.get("weight_decay", 0.01 if torch_cls is torch.optim.AdamW
                                                                else 0.0)  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adagrad(
            ps, lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2, foreach=False
        ),
        lambda ps: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=False),
    ],
    ids=["adagrad", "adamw-amsgrad"],
)
def test_client_adagrad_and_amsgrad_train_bitwise_as_torch(make):
    """A client `torch.optim.Adagrad`, or Adam(W) with `amsgrad`, trains bitwise as itself (stage 2)."""
    model = mlp([5, 7, 3], 0)
    ref = copy.deepcopy(model)
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}
    engine, *_ = fzero.initialize(model=model, optimizer=make(model.parameters()), config=cfg)
    _train(engine, _data())
    _bitwise(engine, _torch(ref, make(ref.parameters()), _data()))


# ---------------------------------------------------------------------------------------- the bf16 master option
@pytest.mark.parametrize("stage", [2, 3])
def test_round_initial_master_starts_from_the_bf16_weights(stage):
    """`fzero_precision.round_initial_master`: the fp32 master starts from `w.bfloat16().float()`, as DeepSpeed's
    (which casts the module first); by default it is the model's own fp32 weights. The compute copy is the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = {**_config(), "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    default, *_ = fzero.initialize(model=copy.deepcopy(model), config=cfg)
    assert all(torch.equal(default.module_state_dict()[k], v) for k, v in original.items())
    rounded = {k: v.bfloat16().float() for k, v in original.items()}
    assert any(not torch.equal(rounded[k], v) for k, v in original.items())
    ds, *_ = fzero.initialize(model=copy.deepcopy(model), config={**cfg, "fzero_precision": {"round_initial_master":
                                                                                             True}})  # fmt: skip
    assert all(torch.equal(ds.module_state_dict()[k], v) for k, v in rounded.items())
    assert torch.equal(ds.state.compute, default.state.compute)  # bf16(w) either way
    fp32, *_ = fzero.initialize(model=copy.deepcopy(model), config={**_config(), "fzero_precision": {
        "round_initial_master": True}})  # fmt: skip
    assert all(torch.equal(fp32.module_state_dict()[k], v) for k, v in original.items())  # no effect under fp32


def test_round_params_in_the_functional_core():
    """The core-level mechanism the key maps to: `fzero.init(round_params(model, "bf16"), ...)`."""
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    want = {k: v.detach().bfloat16().float() for k, v in model.state_dict().items()}
    state = fzero.init(fzero.precision.round_params(model, "bf16"), fzero.zero2(fzero.adamw(), precision="bf16"),
                       fzero.SimMesh(2))  # fmt: skip
    got = fzero.state_dict(state)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    with pytest.raises(TypeError, match="floating torch.dtype"):
        fzero.precision.round_params(model, torch.int8)


# --------------------------------------------------------------------------------- checkpoints and the console
def test_groups_checkpoint_resume_is_bitwise(tmp_path):
    """With groups and a per-group schedule: `save_checkpoint` returns True (DeepSpeed's value); a fresh engine that
    loads it continues bitwise like the uninterrupted one (groups come from names, not from the saved offsets)."""
    scheduler = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}
    cfg = _config(scheduler=scheduler, zero_optimization={"stage": 2})
    data = _data(6)
    a_model = mlp([5, 7, 3], 0)
    a, *_ = fzero.initialize(model=a_model, model_parameters=_groups(a_model), config=cfg)
    _train(a, data[:3])
    assert a.save_checkpoint(tmp_path) is True
    _train(a, data[3:])
    b_model = mlp([5, 7, 3], 1)
    b, *_ = fzero.initialize(model=b_model, model_parameters=_groups(b_model), config=cfg)
    b.load_checkpoint(tmp_path)
    assert b.get_lr() == deepspeed_values("WarmupLR", scheduler["params"], [1e-2, 3e-2, 1e-2], updates=4)[3][0]
    _train(b, data[3:])
    _bitwise(b, a.module_state_dict())
    assert b.get_lr() == a.get_lr()


def test_console_line_and_jsonl_show_every_groups_lr(tmp_path):
    """DeepSpeed's progress line prints `lr=[...]` (every group's), its monitors `get_lr()[0]`: the JSONL keeps
    `lr` (group 0) and adds `lr_groups`; the console line shows them all."""
    lines: list[str] = []
    model = mlp([5, 7, 3], 0)
    cfg = _config(steps_per_print=2, fzero_metrics={"jsonl": str(tmp_path / "m.jsonl")})
    engine, *_ = fzero.initialize(model=model, model_parameters=_groups(model), config=cfg, printer=lines.append)
    _train(engine, _data())
    engine.close()
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [(r["lr"], r["lr_groups"]) for r in records] == [(1e-2, [1e-2, 3e-2, 1e-2])] * STEPS
    assert len(lines) == 2 and "| lr 1.000e-02, 3.000e-02, 1.000e-02 |" in lines[0]


# --------------------------------------------------------------------------------------------- 2 gloo processes
@pytest.mark.timeout(240)
def test_hf_trainer_grouping_on_two_gloo_processes(tmp_path):
    """The Hugging Face Trainer's two groups (decay names from `get_parameter_names(model, [nn.LayerNorm], ...)`
    as transformers 5's `Trainer.get_decay_parameter_names` builds them: no biases, no norms) on a tiny GPT-2,
    through the engine at stages 2 and 3 on 2 gloo processes: as `model_parameters` with the config's AdamW, and as
    a client AdamW with per-group lrs and a per-group `LambdaLR`. Each equals plain `torch.optim.AdamW` with the same
    groups on the full batch within tests/bounds.py's float32 check (the reduction order differs, per rank then
    over ranks), stage 3 equals stage 2 bitwise, and the ranks agree."""
    pytest.importorskip("transformers")
    spawn(groups_engine_worker.run, (2, str(tmp_path)), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["decay_names_agree"]  # transformers 5's patterns == the classic [nn.LayerNorm] minus biases
    for case in ("config", "client"):
        s2, s3 = results[f"{case}-2"], results[f"{case}-3"]
        assert s3["params"] == s2["params"], case
        assert s2["same_on_ranks"] and s3["same_on_ranks"], case
        assert_within(s2["vs_reference"])
        assert s2["lrs"] == s2["reference_lrs"], case
        assert len(s2["view_groups"]) == 2

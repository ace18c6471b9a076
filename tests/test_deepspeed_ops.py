"""`fzero.deepspeed.ops`: DeepSpeed's optimizer classes over fzero's optimizers, on their own and through
`fzero.initialize`.

Against DeepSpeed 0.19.8 itself: its CPU classes (`DeepSpeedCPUAdam`, `DeepSpeedCPUAdagrad`, `DeepSpeedCPULion`,
which build a C++ extension with ninja and gcc on first use) run in a subprocess on the CPU accelerator, on the same
parameters and gradients, two param groups, several steps (`deepspeed_side`; a case whose op does not build is
skipped, saying why). Building DeepSpeed's three ops takes 3-8 minutes each on 2 cores, beyond what a CI run can
spend, so those comparisons run with `FZERO_DEEPSPEED_OPS=1` (`FZERO_DEEPSPEED_OPS=1 .venv/bin/python -m pytest
tests/test_deepspeed_ops.py`; the ops are cached in torch's extensions directory after the first run) and are
skipped otherwise, saying so; the classes' signatures are compared with DeepSpeed's on every run (importing
DeepSpeed's classes builds nothing). DeepSpeed's fused classes need CUDA: `FusedAdam` is held against
`torch.optim.AdamW` / `Adam`, `FusedLamb` against a float64 transcription of DeepSpeed's kernel
(tests/test_lamb.py), and in CPU memory both `FusedAdam` and `FusedLion` run the CPU kernel the CPU class runs.

Through `fzero.initialize(optimizer=...)` each class trains bitwise as the config `optimizer` block it is (the same
fzero optimizer, read from the same table), on one process and on 2 gloo processes (one spawn for every case).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import fzero
import fzero.deepspeed as deepspeed
from fzero.config import ConfigError, UnsupportedConfigError
from fzero.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from fzero.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from fzero.deepspeed.ops.lamb import FusedLamb
from fzero.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from tests.bounds import U64, assert_adam_close
from tests.engine_optim_worker import optimizer_name
from tests.spawn import init_worker, spawn
from tests.test_lamb import transcription

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 1500  # seconds: DeepSpeed's three CPU ops took 3-8 minutes each on 2 busy cores
STEPS = 3
SHAPES = [(4, 3), (7,), (33,), (130, 9)]  # below, at and above the kernels' vector widths, and their tails
VECTORS = [(4, 4), (16,), (48,), (128, 9)]  # whole AVX-512 vectors (and AVX2 ones): no scalar remainder
SECOND = {"lr": 3e-2, "weight_decay": 0.0}  # the second param group's own values

# name: (package under deepspeed.ops, class, keyword arguments, parameter shapes)
DS_CASES: dict[str, tuple[str, str, dict, list]] = {
    "cpu-adamw": ("adam", "DeepSpeedCPUAdam", {"lr": 1e-2, "weight_decay": 0.1}, SHAPES),
    "cpu-adam-l2": ("adam", "DeepSpeedCPUAdam", {"lr": 1e-2, "weight_decay": 0.1, "adamw_mode": False}, SHAPES),
    "cpu-adam-no-bias-correction": ("adam", "DeepSpeedCPUAdam", {"lr": 1e-3, "bias_correction": False}, SHAPES),
    "cpu-adagrad": ("adagrad", "DeepSpeedCPUAdagrad", {"lr": 0.1, "weight_decay": 0.1}, VECTORS),
    "cpu-lion": ("lion", "DeepSpeedCPULion", {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}, SHAPES),
}
CLASSES = {"adam": ["DeepSpeedCPUAdam", "FusedAdam"], "lamb": ["FusedLamb"], "lion": ["DeepSpeedCPULion", "FusedLion"],
           "adagrad": ["DeepSpeedCPUAdagrad"]}  # fmt: skip


def draws(shapes: list, steps: int = STEPS, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The initial parameters of `shapes`, and each step's gradients: a list per step."""
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    return start, [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(steps)]


def train(cls, kwargs: dict, shapes: list, steps: int = STEPS, dtype: torch.dtype = torch.float32, seed: int = 0):
    """`cls` on `draws`' parameters in two param groups (the second with `SECOND`'s values), `steps` steps of its
    gradients; returns the parameters and the optimizer."""
    start, grads = draws(shapes, steps, dtype, seed)
    ps = [nn.Parameter(x) for x in start]
    opt = cls([{"params": ps[:2]}, {"params": ps[2:], **SECOND}], **kwargs)
    for step in grads:
        for p, grad in zip(ps, step, strict=True):
            p.grad = grad
        opt.step()
    return ps, opt


def result(ps: list, opt) -> dict[str, torch.Tensor]:
    """The parameters and every state entry, by parameter number and DeepSpeed's key (`step` as a tensor)."""
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(ps)}
    for i, p in enumerate(ps):
        for key, value in opt.state[p].items():
            out[f"p{i}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def deepspeed_side(out_dir: str, build: bool = True) -> None:
    """In a subprocess (DeepSpeed's CPU accelerator): every `DS_CASES` case with DeepSpeed's own class (with `build`),
    saved as `<case>.safetensors`, and `deepspeed.json`: the cases whose op did not build, and the classes'
    signatures."""
    unavailable, signatures = {}, {}
    for name, (package, cls, kwargs, shapes) in DS_CASES.items() if build else ():
        try:
            ps, opt = train(getattr(importlib.import_module(f"deepspeed.ops.{package}"), cls), kwargs, shapes)
        except RuntimeError as e:
            if "failed to build/load" not in str(e):
                raise
            unavailable[name] = f"{e} ({e.__cause__!r})"
            continue
        save_file(result(ps, opt), os.path.join(out_dir, f"{name}.safetensors"))
    for package, names in CLASSES.items():
        module = importlib.import_module(f"deepspeed.ops.{package}")
        for cls in names:
            params = inspect.signature(getattr(module, cls).__init__).parameters.values()
            signatures[cls] = [[p.name, repr(p.default)] for p in params]
    with open(os.path.join(out_dir, "deepspeed.json"), "w") as f:
        json.dump({"unavailable": unavailable, "signatures": signatures}, f)


BUILD = os.environ.get("FZERO_DEEPSPEED_OPS") == "1"  # build DeepSpeed's CPU ops and compare with them


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """`deepspeed_side`'s directory and report. With `BUILD`, the first run builds DeepSpeed's ops (minutes on 2
    cores; cached in torch's extensions directory after it); without, only the signatures are read."""
    out = tmp_path_factory.mktemp("deepspeed_ops")
    code = ("import sys; from tests.test_deepspeed_ops import deepspeed_side; "
            f"deepspeed_side(sys.argv[1], build={BUILD})")  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        # an interrupt, not a kill: torch releases its build lock on the way out (a killed build leaves the lock,
        # and every later build of that op waits for it forever)
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        pytest.skip(f"DeepSpeed's CPU ops did not build within {BUILD_TIMEOUT} s")
    assert proc.returncode == 0, err[-6000:]
    return out, json.loads((out / "deepspeed.json").read_text())


def fzero_class(package: str, cls: str):
    return getattr(importlib.import_module(f"fzero.deepspeed.ops.{package}"), cls)


# ---------------------------------------------------------------------------------------------- against DeepSpeed
@pytest.mark.timeout(BUILD_TIMEOUT + 300)
def test_signatures_are_deepspeeds(deepspeed_runs):
    """Every class takes DeepSpeed's arguments, by name, in order, with DeepSpeed's defaults."""
    _, info = deepspeed_runs
    for package, names in CLASSES.items():
        for cls in names:
            params = inspect.signature(fzero_class(package, cls).__init__).parameters.values()
            assert [[p.name, repr(p.default)] for p in params] == info["signatures"][cls], cls


U32 = 2.0**-24


@pytest.mark.timeout(BUILD_TIMEOUT + 300)
@pytest.mark.parametrize("case", list(DS_CASES))
def test_cpu_classes_against_deepspeeds(deepspeed_runs, case):
    """DeepSpeed's class and fzero's, on the same parameters and gradients in two groups for `STEPS` steps: the same
    state keys per parameter (`step`, `exp_avg`, `exp_avg_sq`: DeepSpeed's CPU Lion keeps an unused `exp_avg_sq`,
    zeros, and so does fzero's), the same step counts, and the same values where the kernels compute alike, else
    within a bound derived from where they differ:

    - Adagrad: DeepSpeed's vector loops (AVX2, AVX-512) and every path of fzero's perform `fma(p, wd, g)`,
      `fma(g, g, s)`, `sqrt`, `+ eps`, `/`, `fma(q, -lr, p)` per element in float32: bitwise, on tensors of whole
      vectors. (DeepSpeed's scalar loop for a tensor's last `numel % 8` or `% 16` elements is plain C++ that gcc
      contracts as it chooses, and also writes the update into the gradient: on this project's machine it rounded
      2 of the 11 such elements with weight decay 1 ulp apart from fzero's.)
    - Lion: the same operations, but DeepSpeed computes its scalars in float32 (`1.0f - beta`, `1.0f - lr * wd`),
      fzero in double rounded once (`fzero.optim.lion`'s notes). Where both take the same sign of `c` (every
      element here: a sign taken otherwise would move `p` by `2 lr`), each step of each side is within rounding
      of the exact step: for the momentum `m <- b m + (1 - b) g`, DeepSpeed's `b` and `1 - b` (off by `u b`, as
      `1 - fl(b)` is exact), its product and fma, against fzero's `b`, `1 - b`, product and fma: `8 u G` per step
      with `G = max_t |g_t|` (`|m| <= G`: a convex combination of the gradients); for `p <- p decay - lr sign(c)`
      the two `decay`s (within `3 u` of each other) and the two fmas: `5 u P` per step with `P = |p_0| + T lr`
      (`|p_t| <= |p_{t-1}| + lr`). A difference made in an earlier step is multiplied by `b` or `decay` (<= 1),
      so after `T` steps: `8 u G T` and `5 u P T`, per element.
    - Adam: the kernels order the operations differently (DeepSpeed `fma(g, 1 - b1, m b1)`, fzero
      `fma(b1, m, (1 - b1) g)`, ...), so the project's float32 bound for differently fused Adams
      (tests/bounds.py: `adam_drift`, and the mean difference under the detection threshold)."""
    if not BUILD:
        pytest.skip("DeepSpeed's CPU ops take minutes each to build: run with FZERO_DEEPSPEED_OPS=1")
    out, info = deepspeed_runs
    if case in info["unavailable"]:
        pytest.skip(f"DeepSpeed's op did not build here: {info['unavailable'][case]}")
    package, cls, kwargs, shapes = DS_CASES[case]
    want = load_file(out / f"{case}.safetensors")
    got = result(*train(fzero_class(package, cls), kwargs, shapes))
    assert sorted(got) == sorted(want)
    steps = {k: int(v) for k, v in want.items() if k.endswith(".step")}
    assert steps == {k: int(v) for k, v in got.items() if k.endswith(".step")} == dict.fromkeys(steps, STEPS)
    start, grads = draws(shapes)
    params = [f"p{i}" for i in range(len(shapes))]
    if package == "adagrad":
        assert [k for k in got if not torch.equal(got[k], want[k])] == []
    elif package == "lion":
        for i, name in enumerate(params):
            lr = SECOND["lr"] if i >= 2 else kwargs["lr"]
            size_g = torch.stack([step[i].abs() for step in grads]).amax(0)
            size_p = start[i].abs() + STEPS * lr
            assert ((got[name] - want[name]).abs() <= 5 * U32 * size_p * STEPS).all(), name
            assert ((got[f"{name}.exp_avg"] - want[f"{name}.exp_avg"]).abs() <= 8 * U32 * size_g * STEPS).all(), name
        assert all(got[k].eq(0).all() and want[k].eq(0).all() for k in got if k.endswith("exp_avg_sq"))
    else:
        lr = max(kwargs["lr"], SECOND["lr"])
        if not kwargs.get("bias_correction", True):
            # adam_ratio bounds the corrected step m_hat / sqrt(v_hat); uncorrected, m / sqrt(v) is that times
            # (1 - b1^t) / sqrt(1 - b2^t), at most 4.95 for t <= 3 (default betas): charged to the lr
            lr *= max((1 - 0.9**t) / (1 - 0.999**t) ** 0.5 for t in range(1, STEPS + 1))
        start_of = {name: x for name, x in zip(params, start, strict=True)}
        assert_adam_close({k: got[k] for k in params}, {k: want[k] for k in params}, start_of, lr, STEPS)


# ------------------------------------------------------------------- DeepSpeed's fused classes (CUDA only there)
def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def params_of(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in out.items() if "." not in k}


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_in_cpu_memory(adam_w_mode):
    """FusedAdam on parameters in CPU memory runs the kernel DeepSpeedCPUAdam runs (`fzero.adamw(fused=True)` picks
    it by the master weights' device, as the engine does for the config's Adam block): bitwise DeepSpeedCPUAdam,
    state included; and `torch.optim.AdamW` (`adam_w_mode=False`: `torch.optim.Adam`, an L2 penalty) within the
    project's float32 bound for differently fused Adams (tests/bounds.py)."""
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    fused = result(*train(FusedAdam, {**kw, "adam_w_mode": adam_w_mode}, SHAPES))
    assert differing(fused, result(*train(DeepSpeedCPUAdam, {**kw, "adamw_mode": adam_w_mode}, SHAPES))) == []
    ps, _ = train(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, kw, SHAPES)
    start = params_of(result(*train(FusedAdam, kw, SHAPES, steps=0)))
    assert_adam_close(params_of(fused), {f"p{i}": p.detach() for i, p in enumerate(ps)}, start, SECOND["lr"], STEPS)


LAMB = {"lr": 2e-2, "weight_decay": 0.1, "max_coeff": 0.3, "min_coeff": 0.02}


@pytest.mark.parametrize("options", [{}, {"eps_inside_sqrt": True, "bias_correction": False}])
def test_fused_lamb_is_the_kernel_per_parameter(options):
    """float32: each parameter's update is `fzero.lamb`'s on that parameter alone, bitwise (the trust ratio of each
    whole tensor, as DeepSpeed's kernel is called per parameter). float64: within tests/test_lamb.py's bound of
    DeepSpeed's kernel transcribed (the two differ only in the order of the norms' additions)."""
    got = result(*train(FusedLamb, {**LAMB, **options}, SHAPES))
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g) for s in SHAPES]
    opts = [fzero.lamb(**{**LAMB, **(SECOND if i >= 2 else {})}, **options) for i in range(len(ps))]
    states = [opt.init(p) for opt, p in zip(opts, ps, strict=True)]
    for _ in range(STEPS):
        for i, p in enumerate(ps):
            ps[i], states[i] = opts[i].update(torch.randn(p.shape, generator=g), states[i], p)
    assert differing(params_of(got), {f"p{i}": p for i, p in enumerate(ps)}) == []

    got64 = params_of(result(*train(FusedLamb, {**LAMB, **options}, SHAPES, dtype=torch.float64)))
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    ref = [(w, torch.zeros_like(w), torch.zeros_like(w)) for w in start]
    h = {"betas": (0.9, 0.999), "eps": 1e-8, "bias_correction": True, "eps_inside_sqrt": False, **LAMB, **options}
    for t in range(1, STEPS + 1):
        for i, (w, _, _) in enumerate(ref):
            grad = torch.randn(w.shape, generator=g, dtype=torch.float64)
            ref[i] = transcription(*ref[i], grad, t, {**h, **(SECOND if i >= 2 else {})})
    for i, (want, *_) in enumerate(ref):
        n = want.numel()
        gamma = n * U64 / (1 - n * U64)
        moved = (want - start[i]).abs().max().item()
        bound = STEPS * (2 * gamma * moved + 16 * U64 * max(want.abs().max().item(), 1.0)) * 2
        assert (got64[f"p{i}"] - want).abs().max().item() <= bound, i


def test_fused_lion_in_cpu_memory_is_the_cpu_kernel():
    """FusedLion on parameters in CPU memory runs `fzero.cpu_lion`, as the engine runs the config's Lion block on a
    CPU: bitwise DeepSpeedCPULion (held against DeepSpeed's own above), but for the unused `exp_avg_sq` that
    DeepSpeed's CPU Lion keeps and its FusedLion does not."""
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    fused = result(*train(FusedLion, kw, SHAPES))
    cpu = result(*train(DeepSpeedCPULion, kw, SHAPES))
    assert differing(fused, {k: v for k, v in cpu.items() if not k.endswith("exp_avg_sq")}) == []
    assert all(v.eq(0).all() for k, v in cpu.items() if k.endswith("exp_avg_sq"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_classes_on_a_gpu():
    """On a GPU, FusedAdam is torch's fused kernel (bitwise `torch.optim.AdamW(fused=True)`), FusedLion `fzero.lion`
    (bitwise its update on each parameter)."""
    kw = {"lr": 1e-2, "weight_decay": 0.1}

    def on_gpu(cls, kwargs):
        g = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]
        opt = cls([{"params": ps[:2]}, {"params": ps[2:], **SECOND}], **kwargs)
        for _ in range(STEPS):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()
        return [p.detach().cpu() for p in ps]

    for a, b in zip(on_gpu(FusedAdam, kw), on_gpu(torch.optim.AdamW, {**kw, "fused": True}), strict=True):
        assert torch.equal(a, b)
    lion_kw = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).cuda() for s in SHAPES]
    opts = [fzero.lion(**{**lion_kw, **(SECOND if i >= 2 else {})}) for i in range(len(ps))]
    states = [opt.init(p) for opt, p in zip(opts, ps, strict=True)]
    for _ in range(STEPS):
        for i, p in enumerate(ps):
            ps[i], states[i] = opts[i].update(torch.randn(p.shape, generator=g).cuda(), states[i], p)
    for a, b in zip(on_gpu(FusedLion, lion_kw), ps, strict=True):
        assert torch.equal(a, b.cpu())


# ------------------------------------------------------------------------------------------ as torch optimizers
@pytest.mark.parametrize("cls", [DeepSpeedCPUAdam, FusedAdam, FusedLamb, DeepSpeedCPULion, FusedLion,
                                 DeepSpeedCPUAdagrad])  # fmt: skip
def test_a_plain_torch_optimizer(cls):
    """A training loop's habits: a closure's loss is returned; parameters without a gradient are left alone (no
    state); `state_dict()` / `load_state_dict()` resume bitwise; a scheduler's lr is read at the next step;
    non-contiguous parameters are updated in place like contiguous ones."""
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(5, 4, generator=g).t())  # not contiguous
    frozen = nn.Parameter(torch.randn(3, generator=g))
    grads = [torch.randn(4, 5, generator=g) for _ in range(4)]

    def run(resume: bool) -> torch.Tensor:
        p = nn.Parameter(w.detach().clone())
        q = nn.Parameter(frozen.detach().clone())
        opt = cls([p, q], lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
        for i, grad in enumerate(grads):
            if resume and i == 2:
                saved = opt.state_dict()
                opt = cls([p, q], lr=1e-2)
                opt.load_state_dict(saved)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1), last_epoch=i - 1)
            p.grad = grad.clone()
            assert opt.step(lambda: torch.tensor(7.0)) == 7.0
            sched.step()
        assert q not in opt.state and torch.equal(q, frozen)
        return p.detach().clone()

    assert torch.equal(run(False), run(True))
    contiguous = nn.Parameter(w.detach().contiguous())
    p = nn.Parameter(w.detach().clone())
    for q in (contiguous, p):
        q.grad = grads[0].clone()
        cls([q], lr=1e-2).step()
    assert not p.is_contiguous() and torch.equal(p, contiguous)


# ------------------------------------------------------------------------------------------------ fzero.initialize
def block(kind: str, params: dict) -> dict:
    """A config `optimizer` block (lists for tuples, as JSON has them)."""
    return {"type": kind, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}}


_ADAM = {"lr": 1e-2, "weight_decay": 0.05}
_NO_BIAS_CORRECTION = {"lr": 1e-3, "weight_decay": 0.05, "bias_correction": False}
_LAMB = {**LAMB, "eps_inside_sqrt": True}
_LION = {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
_ADAGRAD = {"lr": 5e-2, "weight_decay": 0.01, "eps": 1e-8}
# name: (class, its keyword arguments, the config block it is, the fzero optimizer the engine runs on a CPU run)
ENGINE_CASES: dict[str, tuple[Any, dict, dict, str]] = {
    "DeepSpeedCPUAdam": (DeepSpeedCPUAdam, _ADAM, block("Adam", _ADAM), "cpu_adamw"),
    "DeepSpeedCPUAdam-l2": (
        DeepSpeedCPUAdam,
        {**_ADAM, "adamw_mode": False},
        block("Adam", {**_ADAM, "adam_w_mode": False}),
        "cpu_adam",
    ),
    "FusedAdam-no-bias-correction": (FusedAdam, _NO_BIAS_CORRECTION, block("Adam", _NO_BIAS_CORRECTION), "cpu_adamw"),
    "FusedLamb": (FusedLamb, _LAMB, block("Lamb", _LAMB), "lamb"),
    "DeepSpeedCPULion": (DeepSpeedCPULion, _LION, block("Lion", _LION), "cpu_lion"),
    "FusedLion": (FusedLion, _LION, block("Lion", _LION), "cpu_lion"),
    "DeepSpeedCPUAdagrad": (DeepSpeedCPUAdagrad, _ADAGRAD, block("Adagrad", _ADAGRAD), "cpu_adagrad"),
}
MICRO, GAS = 2, 2


def engine_config(stage: int, optimizer: dict | None) -> dict:
    """Gradient accumulation, clipping and a WarmupLR schedule (from 0 to each group's own lr in 3 updates)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": None, "warmup_num_steps": 3, "warmup_type": "linear"},
        },
        "gradient_clipping": 1.0,
    }
    return cfg if optimizer is None else {**cfg, "optimizer": optimizer}


def groups(model: nn.Module, lr: float) -> list[dict]:
    """The matrices, and the biases with their own lr and no weight decay."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 2 * lr, "weight_decay": 0.0}]  # fmt: skip


def engine_run(case: str, stage: int, client: bool, rank: int = 0, world: int = 1):
    """The case as a client optimizer (`client`) or as its config block, with the same param groups: the engine
    and its losses over `STEPS` optimizer steps (rank `rank`'s data)."""
    cls, kwargs, config_block, _ = ENGINE_CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fzero's notes on config keys
        if client:
            opt = cls(groups(model, kwargs["lr"]), **kwargs)
            eng, returned, *_ = fzero.initialize(model=model, config=engine_config(stage, None), optimizer=opt,
                                                 printer=lambda *a: None)  # fmt: skip
            assert returned is opt
        else:
            eng, *_ = fzero.initialize(
                model=model,
                config=engine_config(stage, config_block),
                model_parameters=groups(model, kwargs["lr"]),
                printer=lambda *a: None,
            )
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS * GAS):
        x, y = torch.randn(world, MICRO, 6, generator=g), torch.randn(world, MICRO, 3, generator=g)
        loss = F.mse_loss(eng(x[rank]), y[rank])
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return eng, losses


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_initialize_runs_the_config_blocks_optimizer(case):
    """One process, stage 2: `fzero.initialize(optimizer=cls(groups, ...))` runs the fzero optimizer the config
    block runs (on a CPU run the native kernel for Adam, Lion and Adagrad, FusedAdam's and FusedLion's included;
    `lamb`), with the class's hyper-parameters and each group's own, and trains bitwise as the config's `optimizer`
    block with the same `model_parameters`: the same losses and every leaf of the state (parameters, moments,
    counts)."""
    from tests.engine_optim_worker import gathered_state

    a, losses_a = engine_run(case, 2, client=True)
    b, losses_b = engine_run(case, 2, client=False)
    assert optimizer_name(a) == optimizer_name(b) == ENGINE_CASES[case][3]
    assert losses_a == losses_b
    assert differing(gathered_state(a), gathered_state(b)) == []
    assert a.get_lr() == b.get_lr() != []


def engine_worker(rank: int, world: int, out_dir: str) -> None:
    """Every case at stage 3 on `world` gloo processes, as a client optimizer and as its config block: each rank
    writes `results<rank>.json`."""
    from tests.engine_optim_worker import gathered_state

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store")
    from fzero.host import process_group

    try:
        results = {}
        for case in ENGINE_CASES:
            a, losses_a = engine_run(case, 3, True, rank, world)
            b, losses_b = engine_run(case, 3, False, rank, world)
            results[case] = {
                "optimizer": [optimizer_name(a), optimizer_name(b)],
                "losses": [losses_a, losses_b],
                "state_differ": differing(gathered_state(a), gathered_state(b)),
            }
        with open(os.path.join(out_dir, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
    finally:
        process_group.shutdown()


@pytest.mark.timeout(600)
def test_initialize_on_two_processes(tmp_path):
    """On 2 gloo processes at stage 3 (parameters, gradients and optimizer state sharded): every class trains
    bitwise as its config block (losses on each rank, every leaf of the state), running the same fzero
    optimizer."""
    spawn(engine_worker, (2, str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"results{rank}.json").read_text()) for rank in range(2)]
    for rank, results in enumerate(ranks):
        assert sorted(results) == sorted(ENGINE_CASES)
        for key, r in results.items():
            want = ENGINE_CASES[key][3]
            assert r["optimizer"] == [want, want], (rank, key)
            assert r["losses"][0] == r["losses"][1], (rank, key)
            assert r["state_differ"] == [], (rank, key)
    key = next(iter(ENGINE_CASES))
    assert ranks[0][key]["losses"] != ranks[1][key]["losses"]  # the ranks trained on their own data


def test_initialize_refuses_what_it_cannot_run():
    """One `bias_correction` (Adam, Lamb) for all groups: fzero's optimizer takes it once, so groups that differ
    are refused, naming it; a group's value out of range is refused naming the group and the key."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    parts = groups(model, 1e-2)
    parts[1]["bias_correction"] = False
    with pytest.raises(UnsupportedConfigError, match="param groups 0 and 1 of FusedAdam differ in bias_correction"):
        fzero.initialize(model=model, config=engine_config(2, None), optimizer=FusedAdam(parts, lr=1e-2))
    opt = FusedLamb(groups(model, 1e-2))
    opt.param_groups[1]["min_coeff"] = 20.0  # (above max_coeff, set after the constructor's check)
    with pytest.raises(ConfigError, match=r"FusedLamb.param_groups\[1\].min_coeff: 20.0 exceeds max_coeff"):
        fzero.initialize(model=model, config=engine_config(2, None), optimizer=opt)


# ------------------------------------------------------------------------------------------ refusals and errors
def test_deepspeeds_module_paths():
    """DeepSpeed's paths reach the classes: `deepspeed.ops.<package>.<Class>` and the modules that define them
    (`deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`, ...)."""
    assert deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam
    assert deepspeed.ops.lion.FusedLion is FusedLion
    for package, names in CLASSES.items():
        for cls in names:
            module = importlib.import_module(f"fzero.deepspeed.ops.{package}.{MODULES[cls]}")
            assert getattr(module, cls) is fzero_class(package, cls)


MODULES = {"DeepSpeedCPUAdam": "cpu_adam", "FusedAdam": "fused_adam", "FusedLamb": "fused_lamb",
           "DeepSpeedCPULion": "cpu_lion", "FusedLion": "fused_lion", "DeepSpeedCPUAdagrad": "cpu_adagrad"}  # fmt: skip


@pytest.mark.parametrize(
    ("module", "name"),
    [("ops", "DeepSpeedTransformerLayer"), ("ops", "op_builder"), ("ops", "transformer"), ("ops", "aio"),
     ("ops", "__compatible_ops__"), ("ops.adam", "ZenFlowCPUAdam"), ("ops.adam", "ZenFlowSelectiveAdamW_stage3"),
     ("ops.lion", "multi_tensor_apply")],
)  # fmt: skip
def test_the_rest_of_deepspeed_ops_is_refused_by_name(module, name):
    with pytest.raises(NotImplementedError, match=rf"deepspeed\.{module}\.{name} is not supported by fzero: \w"):
        getattr(importlib.import_module(f"fzero.deepspeed.{module}"), name)
    with pytest.raises(AttributeError, match="nor has 'deepspeed.ops"):
        importlib.import_module(f"fzero.deepspeed.{module}").FusedAdamm  # noqa: B018  (not a DeepSpeed name)


def test_options_that_would_change_results_are_refused():
    """AMSGrad where DeepSpeed refuses it (its CPU and fused Adams, FusedLamb: a `RuntimeError` there too);
    FusedLamb's clipping by norms given to `step`, and its older `step` arguments; FusedAdam's deprecated `step`
    arguments, with DeepSpeed's message; DeepSpeed's sub-group steps and Lamb coefficients. Accepted where
    DeepSpeed ignores them: `set_grad_none`, `fp32_optimizer_states` (float32 parameters), CPU Adagrad's `amsgrad`."""
    p = nn.Parameter(torch.ones(3))
    for make in (lambda: DeepSpeedCPUAdam([p], amsgrad=True), lambda: FusedAdam([p], amsgrad=True),
                 lambda: FusedLamb([p], amsgrad=True),
                 lambda: DeepSpeedCPUAdam([{"params": [p], "amsgrad": True}])):  # fmt: skip
        with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
            make()
    with pytest.raises(NotImplementedError, match=r"FusedLamb\(max_grad_norm > 0\).*gradient_clipping"):
        FusedLamb([p], max_grad_norm=1.0)
    p.grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match=r"FusedLamb.step\(grads, scale=...\)"):
        FusedLamb([p]).step(grads=[torch.ones(3)], scale=2.0)
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        FusedAdam([p]).step(scale=2.0)
    with pytest.raises(NotImplementedError, match="get_lamb_coeffs"):
        FusedLamb([p]).get_lamb_coeffs()
    with pytest.raises(NotImplementedError, match="step_subgroup"):
        DeepSpeedCPUAdam([p]).step_subgroup(0)
    accepted = (FusedAdam([p], set_grad_none=False), FusedLion([p], set_grad_none=False),
                DeepSpeedCPUAdam([p], fp32_optimizer_states=False), DeepSpeedCPUAdagrad([p], amsgrad=True))  # fmt: skip
    for opt in accepted:
        opt.step()
        opt.zero_grad()
        assert p.grad is None
        p.grad = torch.ones(3)


def test_bad_input_is_named():
    """A hyper-parameter out of range names the group and the key (at construction, as torch's optimizers check);
    a parameter fzero's CPU kernel cannot update names the parameter and says what to do; a sparse gradient is
    refused."""
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(ConfigError, match=r"DeepSpeedCPUAdam.param_groups\[1\].lr: expected"):
        DeepSpeedCPUAdam([{"params": [p]}, {"params": [nn.Parameter(torch.ones(2))], "lr": -1.0}])
    with pytest.raises(ConfigError, match=r"FusedLion.param_groups\[0\].betas"):
        FusedLion([p], betas=(0.9, 1.5))
    with pytest.raises(ConfigError, match=r"DeepSpeedCPUAdagrad.param_groups\[0\].eps: expected a finite number > 0"):
        DeepSpeedCPUAdagrad([p], eps=0.0)  # (fzero's rule: 0 / 0 where the running sum is 0)
    half = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    half.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"DeepSpeedCPUAdam: param 0 of group 0 is torch.bfloat16: fzero's CPU"):
        DeepSpeedCPUAdam([half]).step()
    FusedLamb([half]).step()  # (torch's operations: any floating dtype)
    meta = nn.Parameter(torch.ones(3, device="meta"))
    meta.grad = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match="is on meta: this optimizer updates parameters in CPU memory"):
        DeepSpeedCPULion([meta]).step()
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(NotImplementedError, match="sparse gradient"):
        DeepSpeedCPUAdagrad([p]).step()

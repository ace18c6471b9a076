"""Each schedule against DeepSpeed 0.19.8's schedulers, bitwise, over many steps and parameters, and with several
param groups as the engine builds them (`fzero.config.build.build_schedules`).

The reference is DeepSpeed's `runtime/lr_schedules.py` transcribed statement by statement (its operations in its
order: `inverse_log_warm_up * math.log(...)`, the stored `delta_lrs`, `decay_interval = d / decay_step_size`, ...)
onto a list of param-group dicts: a constructor that writes the initial values into the groups and `step()` that
advances `last_batch_iteration` and writes the formula's, stepped after every applied update. The value the k-th
update uses is whatever the groups held before it. (Checked once against DeepSpeed 0.19.8's own file, run on
random configs with two groups: identical; DeepSpeed is not a dependency, so the tests use the transcription.)
"""

from __future__ import annotations

import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.config import ConfigError, parse_config
from fzero.config.build import build_schedules
from fzero.optim import schedules as S

STEPS = 120


# --------------------------------------------------------------------------- DeepSpeed 0.19.8, transcribed
def _format_param(groups, value, name):
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(groups)


def _update_lr(groups, lrs):
    for group, lr in zip(groups, lrs, strict=False):
        group["lr"] = lr


class WarmupLR:
    def __init__(self, groups, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log"):
        self.groups = groups
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in groups]
        self.min_lrs = _format_param(groups, warmup_min_lr, "min_lr")
        self.max_lrs = _format_param(groups, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=False)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        _update_lr(groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs, strict=False)]

    def step(self):
        self.last_batch_iteration += 1
        _update_lr(self.groups, self.get_lr())

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return 1.0


class WarmupDecayLR(WarmupLR):
    def __init__(self, groups, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):  # fmt: skip
        self.total_num_steps = total_num_steps
        super().__init__(groups, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR:
    def __init__(self, groups, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log"):  # fmt: skip
        self.groups = groups
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = -1
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [group["lr"] for group in groups]
        _update_lr(groups, self.get_lr())

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1.0 - self.warmup_min_ratio
            ratio = self.warmup_min_ratio + ratio * ratio_delta
            return ratio
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio_delta = 1.0 - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        ratio = max(0.0, self.cos_min_ratio + ratio_delta * ratio)
        return ratio

    def step(self):
        self.last_batch_iteration += 1
        _update_lr(self.groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


class OneCycle:
    def __init__(self, groups, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 betas=True):  # fmt: skip
        self.groups = groups
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(self.decay_step_size, 0)
        self.min_lrs = _format_param(groups, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _format_param(groups, cycle_max_lr, "cycle_max_lr")
        _update_lr(groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum and betas  # 'betas' not in optimizer.defaults: cycling disabled
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(mom, 0.99) for mom in _format_param(groups, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(mom, 0.99) for mom in _format_param(groups, cycle_max_mom, "cycle_max_mom")]
            for momentum, group in zip(self.min_moms, groups, strict=False):
                group["betas"] = momentum
            if math.isclose(self.decay_mom_rate, 0):
                self.skip_mom_decay = True
        self.last_batch_iteration = -1

    def _get_scale_factor(self):
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def _get_cycle_mom(self):
        scale_factor = self._get_scale_factor()
        momentums = []
        for base_betas, max_betas in zip(self.min_moms, self.max_moms, strict=False):
            cycle_min_mom = base_betas[0]
            cycle_max_mom = max_betas[0]
            base_height = (cycle_max_mom - cycle_min_mom) * scale_factor
            momentum = cycle_max_mom - base_height
            momentums.append((momentum, base_betas[1]))
        return momentums

    def _get_cycle_lr(self):
        scale_factor = self._get_scale_factor()
        lrs = []
        for cycle_min_lr, cycle_max_lr in zip(self.min_lrs, self.max_lrs, strict=False):
            base_height = (cycle_max_lr - cycle_min_lr) * scale_factor
            lr = cycle_min_lr + base_height
            lrs.append(lr)
        return lrs

    def _get_decay_mom(self, decay_batch_iteration):
        if self.skip_mom_decay:
            return self.max_moms
        decay_interval = decay_batch_iteration / self.decay_step_size
        mom_decay_factor = 1 + self.decay_mom_rate * decay_interval
        return [(beta0 * mom_decay_factor, beta1) for beta0, beta1 in self.max_moms]

    def _get_decay_lr(self, decay_batch_iteration):
        if self.skip_lr_decay:
            return self.min_lrs
        decay_interval = decay_batch_iteration / self.decay_step_size
        lr_decay_factor = 1 + self.decay_lr_rate * decay_interval
        return [cycle_min_lr / lr_decay_factor for cycle_min_lr in self.min_lrs]

    def get_lr(self):
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_lr()
        return self._get_decay_lr(self.last_batch_iteration - self.total_size + 1)

    def get_mom(self):
        if self.last_batch_iteration < self.total_size:
            return self._get_cycle_mom()
        return self._get_decay_mom(self.last_batch_iteration - self.total_size + 1)

    def step(self):
        self.last_batch_iteration += 1
        _update_lr(self.groups, self.get_lr())
        if self.cycle_momentum:
            for group, momentum in zip(self.groups, self.get_mom(), strict=False):
                group["betas"] = momentum


DEEPSPEED = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle}  # fmt: skip


def deepspeed_values(kind, params, base_lrs, betas=True, updates=STEPS):
    """What each group holds before each of `updates` applied updates: `(lrs, beta1s or None)` per update."""
    groups = [{"lr": lr} for lr in base_lrs]
    extra = {"betas": betas} if kind == "OneCycle" else {}
    sched = DEEPSPEED[kind](groups, **params, **extra)
    out = []
    for _ in range(updates):
        moms = [g["betas"][0] for g in groups] if "betas" in groups[0] else None
        out.append(([g["lr"] for g in groups], moms))
        sched.step()
    return out


def fzero_values(kind, params, base_lrs, betas=True, updates=STEPS):
    """What `build_schedules` gives for the same `scheduler` block and groups."""
    cfg = parse_config({"train_batch_size": 1, "scheduler": {"type": kind, "params": params}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OneCycle with SGD warns that it does not cycle momentum
        lrs, moms = build_schedules(cfg, base_lrs, betas=betas)
    return [([lr(n) for lr in lrs], None if moms is None else [m(n) for m in moms]) for n in range(updates)]


# ------------------------------------------------------------------------------------------- the strategies
LRS = st.sampled_from([0.0, 1e-5, 3e-4, 1e-3, 7e-3, 0.1, 0.3])
KIND = st.sampled_from(["log", "linear"])


def per_group(values, groups):
    """A scheduler parameter: one value for every group, or a list of one per group."""
    return st.one_of(values, st.lists(values, min_size=groups, max_size=groups))


@st.composite
def warmup_params(draw, groups, decay):
    p = {"warmup_min_lr": draw(per_group(st.sampled_from([0.0, 1e-6, 3e-5]), groups)),
         "warmup_max_lr": draw(st.one_of(st.none(), per_group(LRS, groups))),
         "warmup_num_steps": draw(st.integers(1, 40)), "warmup_type": draw(KIND)}  # fmt: skip
    if decay:
        p["total_num_steps"] = draw(st.integers(1, 100))
    return p


@st.composite
def cosine_params(draw):
    return {"total_num_steps": draw(st.integers(1, 100)), "warmup_min_ratio": draw(st.sampled_from([0.0, 0.1, 0.37])),
            "warmup_num_steps": draw(st.integers(1, 40)), "cos_min_ratio": draw(st.sampled_from([1e-4, 0.2, 0.0])),
            "warmup_type": draw(KIND)}  # fmt: skip


@st.composite
def one_cycle_params(draw, groups):
    return {
        "cycle_min_lr": draw(per_group(st.sampled_from([1e-4, 1e-3, 0.01]), groups)),
        "cycle_max_lr": draw(per_group(st.sampled_from([0.05, 0.1, 0.3]), groups)),
        "decay_lr_rate": draw(st.sampled_from([0.0, 0.5, 0.37])),
        "cycle_first_step_size": draw(st.integers(1, 20)),
        "cycle_second_step_size": draw(st.one_of(st.none(), st.integers(0, 20))),
        "cycle_first_stair_count": draw(st.sampled_from([0, 3])),
        "cycle_second_stair_count": draw(st.sampled_from([None, 0, 2])),
        "decay_step_size": draw(st.sampled_from([0, 5, 7])),
        "cycle_momentum": draw(st.booleans()),
        "cycle_min_mom": draw(per_group(st.sampled_from([0.8, 0.85]), groups)),
        "cycle_max_mom": draw(per_group(st.sampled_from([0.9, 0.95]), groups)),
        "decay_mom_rate": draw(st.sampled_from([0.0, 0.1, 0.37])),
    }


GROUP_LRS = st.integers(1, 3).flatmap(lambda n: st.lists(LRS, min_size=n, max_size=n))


# ------------------------------------------------------------------------------------------------ the tests
@settings(max_examples=200)
@given(data=st.data(), base=GROUP_LRS, decay=st.booleans())
def test_warmup_lr_and_decay_bitwise(data, base, decay):
    """WarmupLR / WarmupDecayLR with 1-3 groups: per-group lists, `warmup_max_lr: null` as each group's own lr."""
    kind = "WarmupDecayLR" if decay else "WarmupLR"
    params = data.draw(warmup_params(len(base), decay))
    assert fzero_values(kind, params, base) == deepspeed_values(kind, params, base)


@settings(max_examples=200)
@given(params=cosine_params(), base=GROUP_LRS)
def test_warmup_cosine_lr_bitwise(params, base):
    """WarmupCosineLR scales each group's own lr; the first update uses 0."""
    got = fzero_values("WarmupCosineLR", params, base)
    assert got == deepspeed_values("WarmupCosineLR", params, base)
    assert got[0][0] == [0.0] * len(base)


@settings(max_examples=200)
@given(data=st.data(), base=GROUP_LRS, betas=st.booleans())
def test_one_cycle_bitwise(data, base, betas):
    """OneCycle ignores the groups' lrs, takes per-group lists, cycles beta1 (beta2 0.99) unless momentum cycling
    is off or the optimizer has no betas (SGD)."""
    params = data.draw(one_cycle_params(len(base)))
    assert fzero_values("OneCycle", params, base, betas) == deepspeed_values("OneCycle", params, base, betas)


def test_warmup_lr_is_deepspeeds_formula_bitwise_where_log_over_log_is_not():
    """The log warm-up multiplies by a stored `1 / log(N)` (DeepSpeed's `inverse_log_warm_up`); the quotient
    `log(i + 1) / log(N)` (fzero's formula before) differs from it by one ulp at 5 of the first 20 steps here."""
    lr = S.warmup_lr(0.0, 1e-3, 10, "log")
    want = deepspeed_values("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}, [1.0])
    assert [lr(n) for n in range(STEPS)] == [lrs[0] for lrs, _ in want]
    quotient = [0.0] + [1e-3 * (math.log(n) / math.log(10) if n - 1 < 10 else 1.0) for n in range(1, 20)]
    assert sum(a != b for a, b in zip(quotient, [lr(n) for n in range(20)], strict=True)) == 5


@settings(max_examples=30)
@given(w=st.integers(1, 40), kind=KIND, lo=st.sampled_from([0.0, 1e-5]), hi=LRS)
def test_the_schedule_functions_alone(w, kind, lo, hi):
    """`fzero.optim.warmup_lr` etc. (the functional core's schedules) are the same functions."""
    want = deepspeed_values("WarmupLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": w,
                                         "warmup_type": kind}, [1.0])  # fmt: skip
    assert [S.warmup_lr(lo, hi, w, kind)(n) for n in range(STEPS)] == [lrs[0] for lrs, _ in want]
    assert want[0][0] == want[1][0] == [lo]  # the quirk: the first two updates both use the minimum


def test_per_group_list_of_the_wrong_length_names_the_key():
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}
    cfg = parse_config({"train_batch_size": 1, "scheduler": scheduler})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_max_lr: expected 3 values \(one per param group"):
        build_schedules(cfg, [0.1, 0.1, 0.1])
    with pytest.raises(ConfigError, match="scheduler.params.cycle_min_lr: expected a finite number >= 0, or a list"):
        scheduler = {"type": "OneCycle", "params": {"cycle_min_lr": "a", "cycle_max_lr": 1}}
        parse_config({"train_batch_size": 1, "scheduler": scheduler})


def test_validation():
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        S.warmup_lr(warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear'"):
        S.warmup_lr(warmup_type="cosine")
    with pytest.raises(ValueError, match="total_num_steps must be a positive integer"):
        S.warmup_decay_lr(0)
    with pytest.raises(ValueError, match="cycle_second_step_size non-negative"):
        S.one_cycle(0.1, 0.2, cycle_second_step_size=-1)
    assert S.constant(0.3)(123) == 0.3

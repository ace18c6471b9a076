"""Each schedule against DeepSpeed's formula over its whole range.

The reference is DeepSpeed's scheduler protocol written out: a scheduler object whose constructor writes an initial
learning rate, whose `step()` advances `last_batch_iteration` and writes the formula's value, stepped by the engine
after every applied update. The learning rate the k-th update uses is whatever was written before it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fzero.optim import schedules as S


def deepspeed_sequence(initial, formula, updates):
    """What DeepSpeed's optimizer sees at each update: `initial` (written by the constructor), then, after each
    update, `formula(last_batch_iteration)` with last_batch_iteration = 0, 1, 2, ..."""
    lrs, current, lbi = [], initial, -1
    for _ in range(updates):
        lrs.append(current)
        lbi += 1
        current = formula(lbi)
    return lrs


warm = st.fixed_dictionaries({
    "warmup_min_lr": st.sampled_from([0.0, 1e-5]), "warmup_max_lr": st.sampled_from([1e-3, 0.1]),
    "warmup_num_steps": st.integers(1, 30), "warmup_type": st.sampled_from(["log", "linear"]),
})  # fmt: skip


def gamma(i, n, kind):
    n = max(2, n)
    if i >= n:
        return 1.0
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


@given(w=warm)
def test_warmup_lr(w):
    lo, hi, n, kind = w["warmup_min_lr"], w["warmup_max_lr"], w["warmup_num_steps"], w["warmup_type"]
    want = deepspeed_sequence(lo, lambda i: lo + (hi - lo) * gamma(i, n, kind), 80)
    assert [S.warmup_lr(**w)(k) for k in range(80)] == want
    assert want[0] == want[1] == lo  # the quirk: the first two updates both use the minimum


@given(w=warm, total=st.integers(1, 60))
def test_warmup_decay_lr(w, total):
    lo, hi, n, kind = w["warmup_min_lr"], w["warmup_max_lr"], w["warmup_num_steps"], w["warmup_type"]
    n2 = max(2, n)

    def formula(i):
        g = gamma(i, n, kind) if i < n2 else max(0.0, (total - i) / max(1.0, total - n2))
        return lo + (hi - lo) * g

    want = deepspeed_sequence(lo, formula, 90)
    assert [S.warmup_decay_lr(total, **w)(k) for k in range(90)] == want


@given(n=st.integers(1, 30), total=st.integers(1, 60), min_ratio=st.sampled_from([0.0, 0.1]),
       cos_min=st.sampled_from([1e-4, 0.2]), kind=st.sampled_from(["log", "linear"]))  # fmt: skip
def test_warmup_cosine_lr(n, total, min_ratio, cos_min, kind):
    n2 = max(2, n)

    def formula(i):
        if i < n2:
            return 0.5 * (min_ratio + gamma(i, n, kind) * (1 - min_ratio))
        progress = min(1.0, (i - n2 + 1) / max(1, total - n2))
        return 0.5 * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))

    got = [S.warmup_cosine_lr(0.5, total, min_ratio, n, cos_min, kind)(k) for k in range(90)]
    assert got == deepspeed_sequence(0.0, formula, 90)
    assert got[0] == 0.0


@given(first=st.integers(1, 20), second=st.one_of(st.none(), st.integers(1, 20)),
       decay_rate=st.sampled_from([0.0, 0.5]), decay_step=st.sampled_from([0, 5]),
       stairs=st.sampled_from([0, 3]))  # fmt: skip
def test_one_cycle(first, second, decay_rate, decay_step, stairs):
    lo, hi, m_lo, m_hi = 0.01, 0.1, 0.8, 0.9
    f, s = float(first), float(second if second is not None else first)
    total = f + s

    def scale(i):
        bi = i + 1
        if stairs:
            ci = bi % total
            pos = ci * stairs / f if ci <= f else (total - ci) * stairs / s
            return math.floor(pos) / stairs
        cycle = math.floor(1 + bi / total)
        x = 1.0 + bi / total - cycle
        return x / (f / total) if x <= f / total else (x - 1) / (f / total - 1)

    no_decay = decay_step == 0 or decay_rate == 0

    def lr(i):
        if i < total:
            return lo + (hi - lo) * scale(i)
        return lo if no_decay else lo / (1 + decay_rate * (i - total + 1) / decay_step)

    def mom(i):
        if i < total:
            return m_hi - (m_hi - m_lo) * scale(i)
        return m_hi if no_decay else m_hi * (1 + decay_rate * (i - total + 1) / decay_step)

    kw = {"cycle_first_step_size": first, "cycle_second_step_size": second, "cycle_first_stair_count": stairs,
          "decay_step_size": decay_step}  # fmt: skip
    got_lr = [S.one_cycle(lo, hi, decay_lr_rate=decay_rate, **kw)(k) for k in range(70)]
    got_mom = [S.one_cycle_momentum(m_lo, m_hi, decay_mom_rate=decay_rate, **kw)(k) for k in range(70)]
    assert got_lr == pytest.approx(deepspeed_sequence(lo, lr, 70), rel=1e-12)
    assert got_mom == pytest.approx(deepspeed_sequence(m_lo, mom, 70), rel=1e-12)  # constructor: the minimum


def test_validation():
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        S.warmup_lr(warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear'"):
        S.warmup_lr(warmup_type="cosine")
    with pytest.raises(ValueError, match="total_num_steps must be a positive integer"):
        S.warmup_decay_lr(0)
    assert S.constant(0.3)(123) == 0.3

"""Every optimizer at stages 0-3, worlds 1-4, accumulation 1-3, with parameter groups where it takes them, against
its plain single-process reference on the full batch (torch's AdamW, Adagrad and SGD; the transcriptions of
DeepSpeed's Lion, Lamb and Muon in tests/test_optim_lion_adagrad.py, test_lamb.py, test_muon.py).

float64 throughout. The two runs reduce the gradients in different orders, so they are not bitwise; what holds
whatever the order is each optimizer's own step bound (tests/bounds.py, kind 3): an element moves by at most
`s_t` per step, so two runs from one start differ by at most `2 sum_t s_t`, with

    AdamW:  s_t = lr r_t                  (r_t: tests/bounds.py's adam_ratio)
    Lamb:   s_t = max_coeff lr r_t        (the clamped ratio times Adam's bound; no weight decay here)
    Lion:   s_t = lr                      (a sign step; no weight decay here)
    Adagrad: s_t = lr                     (|g| / sqrt(sum of g^2) <= 1)
    SGD:    s_t = lr |g| / (1 - momentum) (|g| <= G = 10 in these tests)
    Muon:   s_t = lr 1.5 sqrt(max(1, rows / cols)) on its matrices (Newton-Schulz's quintic keeps the singular
            values in (0.68, 1.13) after five steps: 1.5 bounds every entry), adam_lr r_t on the rest,

and the detection threshold on the mean difference (`tracks`, 1e-3 of the mean distance moved), which catches a
wrong mean, a shifted shard or a missing step. Measured (worlds 2-4, accumulation 1-3): the largest difference
5.6e-17, the mean at most 4.1e-16 of the distance moved (float64 rounding; Lion exactly 0).
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.bounds import TRACKS, adam_ratio, tracks
from tests.support import mlp, regression_batches, regression_loss
from tests.test_groups import reference, run
from tests.test_lamb import transcription as lamb_step
from tests.test_muon import reference_step as muon_step
from tests.test_optim_lion_adagrad import TorchLion

LR = 1e-2


class _PerTensor(torch.optim.Optimizer):
    """A reference optimizer from a per-tensor transcription `step(p, grad, state, t, hypers)`."""

    def __init__(self, params, step, **hypers):
        super().__init__(params, hypers)
        self._step = step

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["t"] = state.get("t", 0) + 1
                self._step(p, state, group)


def _lamb(p, state, h):
    m, v = state.setdefault("m", torch.zeros_like(p)), state.setdefault("v", torch.zeros_like(p))
    w, state["m"], state["v"] = lamb_step(p.clone(), m, v, p.grad, state["t"], h)
    p.copy_(w)


MUON = {"lr": 0.05, "momentum": 0.95, "weight_decay": 0.0, "adam_lr": LR, "adam_betas": (0.9, 0.95),
        "adam_eps": 1e-10, "adam_weight_decay": 0.0, "ns_method": "gram"}  # fmt: skip
LAMB = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 2.0, "min_coeff": 0.01,
        "bias_correction": True, "eps_inside_sqrt": False}  # fmt: skip
OPTIMIZERS = {
    # name: (fzero's, the reference's maker on torch param groups, takes groups)
    "adamw": (lambda g: fzero.adamw(LR, groups=g), lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False), True),
    "adagrad": (lambda g: fzero.adagrad(LR, groups=g), lambda ps: torch.optim.Adagrad(ps, lr=LR, foreach=False), True),
    "sgd": (lambda g: fzero.sgd(LR, momentum=0.9, groups=g),
            lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, foreach=False), True),
    "lion": (lambda g: fzero.lion(LR, groups=g), lambda ps: TorchLion(ps, lr=LR), True),
    "lamb": (lambda g: fzero.lamb(LR, max_coeff=2.0, groups=g), lambda ps: _PerTensor(ps, _lamb, **LAMB), True),
    "muon": (lambda g: fzero.muon(0.05, adam_lr=LR), None, False),
}  # fmt: skip


def _step_bound(name: str, model, steps: int, group_lr: float) -> float:
    """The most one element can move in `steps` steps (see the module docstring), for the largest lr used."""
    lr = group_lr
    if name == "adamw":
        return sum(lr * adam_ratio(t) for t in range(1, steps + 1))
    if name == "lamb":
        return sum(2.0 * lr * adam_ratio(t) for t in range(1, steps + 1))
    if name in ("lion", "adagrad"):
        return steps * lr
    if name == "sgd":
        return steps * lr * 10.0 / (1 - 0.9)
    widest = max(math.sqrt(max(1.0, p.shape[0] / p.shape[1])) for p in model.parameters() if p.ndim == 2)
    return steps * max(0.05 * 1.5 * widest, LR * adam_ratio(steps, (0.9, 0.95)))


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), stage=st.integers(0, 3), world=st.integers(1, 4),
       micro=st.integers(1, 3), grouped=st.booleans(), seed=st.integers(0, 99))  # fmt: skip
def test_every_optimizer_every_stage_tracks_its_full_batch_reference(name, stage, world, micro, grouped, seed):
    make, make_ref, takes_groups = OPTIMIZERS[name]
    grouped = grouped and takes_groups
    model = mlp([5, 6, 4], seed, torch.float64)
    spec = [(["0.weight", "2.weight"], {}), (["0.bias", "2.bias"], {"lr": LR / 2})]
    groups = fzero.param_groups(groups=spec) if grouped else None
    steps = 3
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = regression_batches(model, world, micro, 2, steps, seed + 1)
    got = fzero.state_dict(run(model, regression_loss, batches, world, micro, f"zero{stage}", make(groups)))
    if make_ref is None:  # Muon: its transcription per whole tensor, on the full batch's gradients
        ref_model = copy.deepcopy(model)
        states = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in ref_model.named_parameters()}
        params = dict(ref_model.named_parameters())
        for i in range(0, len(batches), micro):
            chunk = batches[i : i + micro]
            full = {k: torch.cat([b[k].flatten(0, 1) for b in chunk]) for k in chunk[0]}
            for p in params.values():
                p.grad = None
            regression_loss(ref_model)(params, full).backward()
            with torch.no_grad():
                muon_step({n: p.data for n, p in params.items()}, {n: p.grad for n, p in params.items()}, states,
                          i // micro + 1, MUON)  # fmt: skip
        ref = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    else:
        ref = reference(model, regression_loss, batches, micro, spec if grouped else [(list(start), {})], make_ref)
    bound = 2 * _step_bound(name, model, steps, LR)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= bound, (worst, bound)
    assert tracks(got, ref, start) <= TRACKS

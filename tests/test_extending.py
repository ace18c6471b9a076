"""docs/extending.md's three transforms (tests/extending_transforms.py), each inserted into the chains of stages 0-3
(spelled out as the presets build them: tests/extending_worker.py) and trained on `SimMesh(2)` and on 2 gloo
processes, against plain references:

- `grad_mask`: the masked elements never change; a whole-parameter mask is, bitwise, training a model whose
  masked parameters are frozen (`requires_grad=False`) with the plain chain; an element mask is `torch.optim.AdamW`
  on the full batch with the same elements of the gradient zeroed (`tests/bounds.py`'s kind 3); before and after
  the reduction and at every stage, bitwise the same;
- `topk_reduce`: with k = everything, bitwise the plain reduction; with a small k, what is sent plus the new
  residual is exactly the gradient plus the old residual, the largest elements are the ones sent, the reduction
  is the plain one of what is sent, and training still lowers the loss; refused at stage 3 (no `unit` form);
- `unit_norms`: each unit's norm of the autograd gradient on the full batch, within a bound derived from the
  float32 operations of the two computations (`error_bounds`); stages 1-3 bitwise, stage 0 within float64's
  reordering of a sum.

The page's code is this module's: its ```python blocks are the module's imports and functions, verbatim, and its
```py blocks (the examples that use them) run here.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.layout import to_rank_major
from tests import extending_transforms, extending_worker
from tests.bounds import U32, U64, assert_adam_close
from tests.extending_transforms import clip_by_value, grad_mask, gradient_noise, topk_reduce, unit_norms
from tests.extending_worker import LR, STEPS, WORLD, Net, batches, element_keep, stage_chain, stages, train
from tests.spawn import spawn
from tests.support import differing

PAGE = Path(__file__).parent.parent / "docs" / "extending.md"
STAGES = (0, 1, 2, 3)


def reductions(stage: int) -> fzero.Transform:
    return fzero.all_reduce() if stage == 0 else fzero.reduce_scatter()


# ----------------------------------------------------------------------------------------------- the page's code
def _blocks(fence: str) -> list[str]:
    return re.findall(rf"```{fence}\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_shows_this_modules_code():
    """Every ```python block of docs/extending.md is the module's import lines or one of its functions, verbatim,
    and every function the module exports is on the page, so the two cannot drift apart."""
    source = inspect.getsource(extending_transforms)
    tree = ast.parse(source)
    nodes = [
        n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) and getattr(n, "module", "") != "__future__"
    ]
    imports = "\n".join(source.splitlines()[nodes[0].lineno - 1 : nodes[-1].end_lineno])
    defined = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]  # (in the module's order)
    assert sorted(defined) == sorted(extending_transforms.__all__)
    functions = {name: inspect.getsource(getattr(extending_transforms, name)) for name in defined}
    shown = _blocks("python")
    assert shown[0].strip() == imports, "the first ```python block must be the module's imports"
    assert shown[1:] == list(functions.values()), "the ```python blocks must be the module's functions, in order"


def test_the_pages_examples_run():
    """The page's ```py blocks (using the transforms) run, in order, in one namespace holding the module's names."""
    code = _blocks("py")
    assert code
    namespace = {
        name: getattr(extending_transforms, name) for name in ["torch", "fzero", *extending_transforms.__all__]
    }
    for i, block in enumerate(code):
        exec(compile(block, f"extending.md[py {i}]", "exec"), namespace)


def test_the_spelled_out_chains_are_the_presets():
    """The chains the tests insert into are the presets, bitwise, so a difference below is the inserted transform's."""
    data = batches()
    opt = fzero.adamw(LR, weight_decay=0.0)
    presets = [fzero.zero0(opt), fzero.zero1(opt), fzero.zero2(opt), fzero.zero3(opt)]
    for stage in STAGES:
        assert differing(train(stage_chain(stage), data)[0], train(presets[stage], data)[0]) == [], stage


# --------------------------------------------------------------------------------------------------- grad_mask
def masked_reference(keep: dict, data: list, micro: int) -> dict[str, torch.Tensor]:
    """`torch.optim.AdamW` on the full batch (every rank's and micro-step's examples of a step), the gradient zeroed
    where `keep` is False."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    for i in range(0, len(data), micro):
        full = {k: torch.cat([b[k].flatten(0, 1) for b in data[i : i + micro]]) for k in data[i]}
        opt.zero_grad()
        F.mse_loss(model(full["x"]), full["y"]).backward()
        for name, p in model.named_parameters():
            p.grad = torch.where(keep[name], p.grad, 0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), density=st.sampled_from([0.0, 0.3, 0.8, 1.0]), micro=st.integers(1, 2))
def test_a_mask_freezes_its_elements_at_every_stage_and_placement(seed, density, micro):
    """Masked elements never change; before and after the reduction, stages 0-3 give bitwise the same parameters
    (`where(mask, g, 0)` commutes with the mean and the accumulation exactly; with 2 micro-steps stages 0-1 and
    2-3 are two such groups: docs/equivalence.md), and they follow AdamW on the full batch with the same gradient
    mask (kind 3 of tests/bounds.py: a reduction over all examples at once against fzero's per rank, then over
    ranks)."""
    keep, data = element_keep(seed, density), batches(micro=micro, seed=seed)
    runs = {(stage, where): train(stage_chain(stage, micro=micro, **{where: [grad_mask(keep)]}), data)[0]
            for stage in STAGES for where in ("before", "after")}  # fmt: skip
    groups = [STAGES] if micro == 1 else [(0, 1), (2, 3)]
    start, ref = dict(Net().state_dict()), masked_reference(keep, data, micro)
    assert all(torch.equal(ref[k][~keep[k]], start[k][~keep[k]]) for k in keep)  # (the reference's own check)
    for group in groups:
        first = runs[(group[0], "before")]
        same = {k: differing(r, first) for k, r in runs.items() if k[0] in group}
        assert all(d == [] for d in same.values()), same
        assert all(torch.equal(first[k][~keep[k]], start[k][~keep[k]]) for k in keep)
        if density > 0:
            assert_adam_close(first, ref, start, LR, STEPS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("micro", [1, 2])
def test_a_parameter_mask_is_a_frozen_parameter(stage, where, micro):
    """Masking whole parameters (a scalar False broadcast) is, bitwise, the plain chain on the model whose masked
    parameters are frozen: the same forward, the same gradients of the others, the same elementwise updates. The
    masked run differs from unmasked training (the comparison can fail). (Before the reduction the mask runs per
    unit in the backward wherever the chain reduces unit by unit, and on the full gradient where an accumulation
    comes first: stages 0-1 with 2 micro-steps.)"""
    frozen = ["layers.1.weight", "layers.0.bias"]
    data = batches(micro=micro)
    mask = grad_mask({n: torch.tensor(False) for n in frozen})
    got = train(stage_chain(stage, micro=micro, **{where: [mask]}), data)[0]
    model = Net()
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    assert differing(got, train(stage_chain(stage, micro=micro), data, model=model)[0]) == []
    assert "layers.2.weight" in differing(got, train(stage_chain(stage, micro=micro), data)[0])


def test_a_mask_names_only_trainable_parameters():
    with pytest.raises(ValueError, match=r"no trainable parameter \['layers.9.weight'\]"):
        train(stage_chain(2, before=[grad_mask({"layers.9.weight": torch.tensor(False)})]), batches(steps=1))


# ------------------------------------------------------------------------------------------------- topk_reduce
@pytest.mark.parametrize("stage", (0, 1, 2))
def test_topk_of_everything_is_the_plain_reduction(stage):
    """With k at least the buffer's length every element is sent and the residual stays zero: bitwise the plain
    chain (`g + 0 == g`, `where(True, g, 0) == g`)."""
    data = batches(micro=2)
    numel = fzero.init(Net(), stage_chain(stage), fzero.SimMesh(WORLD)).layout.numel
    for k in (numel, 2 * numel):
        got = train(stage_chain(stage, micro=2, reduce=topk_reduce(k, reductions(stage))), data)
        assert differing(got[0], train(stage_chain(stage, micro=2), data)[0]) == [], k


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 230), seed=st.integers(0, 2**16), stage=st.sampled_from([0, 2]))
def test_topk_sends_the_largest_and_carries_the_rest(k, seed, stage):
    """Two updates of the transform itself on `SimMesh(2)`: per rank, what is sent plus the new residual is exactly
    the gradient plus the old residual (disjoint: each element is sent or kept, not both); the sent elements are
    the largest (at least min(k, nonzeros) of them, none smaller than a kept one); the output is the plain
    reduction of what was sent; the residual of the first update is what the second adds."""
    mesh, layout = fzero.SimMesh(WORLD), fzero.init(Net(), stage_chain(2), fzero.SimMesh(WORLD)).layout
    ctx = fzero.Context(mesh, layout)
    tx = topk_reduce(k, reductions(stage))
    params = mesh.replicate(torch.zeros(layout.numel))
    g = torch.Generator().manual_seed(seed)
    real = ~layout.padding_mask()
    _, state = tx.init(fzero.Flow(None, params, None), ctx)
    for _ in range(2):
        grads = torch.randn(WORLD, layout.numel, generator=g) * real  # padding: zero, as the step gives it
        old = state[1]
        flow, state = tx.update(fzero.Flow(grads, params, None), state, ctx)
        acc, new = grads + old, state[1]
        sent = acc - new
        assert torch.equal(sent + new, acc) and bool(((sent == 0) | (new == 0)).all())
        for r in range(WORLD):
            shown = sent[r][sent[r] != 0].abs()
            assert shown.numel() >= min(k, int((acc[r] != 0).sum()))
            assert shown.numel() == 0 or shown.min() >= new[r].abs().max()
        plain = reductions(stage).update(fzero.Flow(sent, params, None), fzero.EmptyState(), ctx)[0].grads
        assert torch.equal(flow.grads, plain) and flow.info.reduced
        if stage == 2:
            assert torch.equal(plain, mesh.reduce_scatter(to_rank_major(layout, sent), "mean"))


def test_a_small_topk_still_trains_the_same_at_stages_0_to_2():
    """k = 20 of 155 elements: stages 0-2 bitwise the same; the loss falls on a fixed batch (error feedback sends
    every element eventually), though less than with the whole gradient, and a residual is carried."""
    fixed = batches(steps=1) * 12
    runs = {s: train(stage_chain(s, reduce=topk_reduce(20, reductions(s))), fixed) for s in (0, 1, 2)}
    assert all(differing(runs[s][0], runs[0][0]) == [] for s in (1, 2))
    assert all(runs[s][1] == runs[0][1] for s in (1, 2))
    losses = [m["loss"] for m in runs[0][1]]
    plain = [m["loss"] for m in train(stage_chain(0), fixed)[1]]
    assert losses[-1] < 0.8 * losses[0] and plain[-1] < losses[-1], (losses, plain)
    tx = stage_chain(2, reduce=topk_reduce(20))
    model, mesh = Net(), fzero.SimMesh(WORLD)
    state = fzero.init(model, tx, mesh)
    state, _ = fzero.train_step(model, extending_worker.loss_of(model), tx, mesh)(state, fixed[0])
    residual = state.tx_state["topk_reduce"][1]
    kept = int((residual != 0).sum(-1).min())  # per rank: every real element but the k sent
    assert residual.shape == (WORLD, state.layout.numel) and kept >= state.layout.real_numel - 20, kept


def test_topk_is_refused_at_stage_3():
    """The error feedback's state cannot be carried by a per-unit reduction in the backward: `fzero.init` refuses
    the chain with the library's error, naming the transform."""
    with pytest.raises(ValueError, match="stage 3 reduces each unit's gradient in the backward, but 'topk_reduce'"):
        fzero.init(Net(), stage_chain(3, reduce=topk_reduce(20)), fzero.SimMesh(WORLD))


def test_topk_refusal_says_it_is_the_reduction():
    with pytest.raises(ValueError) as err:
        fzero.init(Net(), stage_chain(3, reduce=topk_reduce(20)), fzero.SimMesh(WORLD))
    assert "before the reduction" not in str(err.value) and "after reduce_scatter()" not in str(err.value)
    assert "'topk_reduce' is the chain's reduction and has no unit form" in str(err.value), err.value


# -------------------------------------------------------------------------------------------------- unit_norms
def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def error_bounds(model: Net, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per parameter and element, a first-order bound on the error of the float32 gradient of
    `mse_loss(model(x), y)` (times any power-of-two loss scale, which is exact), whatever the order of its sums.

    Each computed quantity q is within `gamma(K) * M` of its exact value, `M >= |q|` a majorant computed here in
    float64 and `K` the roundings on its longest path (Higham, 3.1 and 4.2: a sum or dot product of n terms is
    within `gamma(n) * sum |terms|` in any order, fused or not):

        z = h W^T + b      M_z = M_h |W|^T + |b|                K_z = K_h + d_in + 1
        h' = tanh(z)       M_h' = M_z (|tanh z| <= |z|, tanh' <= 1)   K_h' = K_z + 4 (torch's tanh: <= 2 ulp)
        d = (out - y) 2/n  M_d = (M_out + |y|) 2/n              K_d = K_out + 3 (subtract, 2/n, multiply)
        dW = d^T h         M_dW = M_d^T M_h                      K_dW = K_d + K_h + batch
        db = sum d         M_db = sum M_d                        K_db = K_d + batch
        dh = d W           M_dh = M_d |W|                        K_dh = K_d + d_out
        d' = dh (1 - h^2)  M_d' = M_dh (1 + 2 |h| M_h)           K_d' = K_dh + K_h + 3 (|1 - h^2| <= 1)
    """
    layers = list(model.layers)
    h = x.double()
    forward = [(h, h.abs(), 0)]  # (value, majorant, roundings) of each layer's input
    for i, layer in enumerate(layers):
        w, b = layer.weight.detach().double(), layer.bias.detach().double()
        h_in, m_in, k_in = forward[-1]
        z, mz, kz = h_in @ w.T + b, m_in @ w.abs().T + b.abs(), k_in + w.shape[1] + 1
        if i < len(layers) - 1:
            forward.append((torch.tanh(z), mz, kz + 4))
    n, batch = z.numel(), x.shape[0]
    md, kd = (mz + y.double().abs()) * 2 / n, kz + 3
    out = {}
    for i in reversed(range(len(layers))):
        h_in, m_in, k_in = forward[i]
        out[f"layers.{i}.weight"] = gamma(kd + k_in + batch) * (md.T @ m_in)
        out[f"layers.{i}.bias"] = gamma(kd + batch) * md.sum(0)
        if i > 0:
            mdh, kdh = md @ layers[i].weight.detach().double().abs(), kd + layers[i].weight.shape[0]
            md, kd = mdh * (1 + 2 * h_in.abs() * m_in), kdh + k_in + 3
    return out


def test_error_bounds_hold_against_float64():
    """`error_bounds` bounds the float32 gradient's distance from the float64 one (the bound can fail)."""
    model, data = Net(), batches(steps=1)[0]
    x, y = data["x"].flatten(0, 1), data["y"].flatten(0, 1)
    grads = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    exact = torch.autograd.grad(F.mse_loss(model.double()(x.double()), y.double()), list(model.parameters()))
    bounds = error_bounds(Net(), x, y)
    for (name, _), g, e in zip(Net().named_parameters(), grads, exact, strict=True):
        assert bool(((g.double() - e).abs() <= bounds[name]).all()), name
        assert bounds[name].max() < 1e-3 * e.abs().max(), name  # and it is no vacuous bound


def test_unit_norms_are_the_full_batch_gradients_norms():
    """At every step and stage, each unit's reported norm is that of `torch.autograd`'s gradient of the full-batch
    loss at the same parameters, within the sum of the two computations' error bounds (fzero: per rank, then the
    mean of two ranks, one more rounding; the reference: the full batch), through `| |a| - |b| | <= |a - b|`, plus
    float64's rounding of the two norms (`2 m U64` relative, m elements). Under a loss scale of 64 (exact). Stages
    1-3 report bitwise the same norms; stage 0 sums each unit's squares over the full buffer rather than per shard
    and then over ranks, the same float64 terms in another order: within `2 gamma64(m)` relative."""
    data = batches()
    reported = {}
    for stage in STAGES:
        model, mesh = Net(), fzero.SimMesh(WORLD)
        tx = stage_chain(stage, after=[unit_norms()], scale=64.0)
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, extending_worker.loss_of(model), tx, mesh)
        units = {u.name: [leaf.name for leaf in state.layout.leaves if leaf.unit == i]
                 for i, u in enumerate(state.layout.units)}  # fmt: skip
        reported[stage] = []
        for batch in data:
            ref = Net()
            ref.load_state_dict(fzero.state_dict(state))
            x, y = batch["x"].flatten(0, 1), batch["y"].flatten(0, 1)
            grads = dict(zip(dict(ref.named_parameters()), torch.autograd.grad(F.mse_loss(ref(x), y),
                             list(ref.parameters())), strict=True))  # fmt: skip
            ranks = [error_bounds(ref, batch["x"][r], batch["y"][r]) for r in range(WORLD)]
            full = error_bounds(ref, x, y)
            state, metrics = step(state, batch)
            assert sorted(k for k in metrics if k.startswith("unit_grad_norm/")) == sorted(
                f"unit_grad_norm/{u}" for u in units
            )
            reported[stage].append({u: metrics[f"unit_grad_norm/{u}"] for u in units})
            for unit, names in units.items():
                want = math.sqrt(sum(float(grads[n].double().square().sum()) for n in names))
                m = sum(grads[n].numel() for n in names)
                # fzero: each rank's gradient within its bound, their mean rounded once more (u |g|, first order)
                mean = {n: sum(b[n] for b in ranks) / WORLD + U32 * (grads[n].abs() + full[n]) for n in names}
                bound = math.sqrt(sum(float(((mean[n] + full[n]) ** 2).sum()) for n in names))
                bound += 2 * m * U64 * want
                assert abs(reported[stage][-1][unit] - want) <= bound, (stage, unit, reported[stage][-1][unit], want)
    assert reported[1] == reported[2] == reported[3]
    for step_norms, stage0 in zip(reported[1], reported[0], strict=True):
        for unit, value in step_norms.items():
            m = sum(p.numel() for n, p in Net().named_parameters() if n.startswith(unit + "."))
            assert abs(stage0[unit] - value) <= 2 * m * U64 / (1 - m * U64) * value + 2 * U64 * value, unit


def test_unit_norms_needs_the_reduced_gradient():
    with pytest.raises(ValueError, match="unit_norms\\(\\) needs averaged gradients"):
        train(stage_chain(2, before=[unit_norms()]), batches(steps=1))


# ------------------------------------------------------------------------------------- gradient noise, clipping
def _probe() -> fzero.Transform:
    """A per-rank transform that reports the gradient it sees (a tensor: kept per rank) and its factor."""

    def report(flow, ctx):
        return flow.with_metrics(g=flow.gradients("probe").clone(), factor=flow.info.grad_factor)

    return fzero.stateless(report, "probe")


def _seen(tx: fzero.Transform, batch: dict, mesh=None) -> dict:
    """The probe's metrics after one step of `tx` (the probe last before the optimizer) from `Net()`."""
    mesh = mesh if mesh is not None else fzero.SimMesh(WORLD)
    model = Net()
    state = fzero.init(model, tx, mesh)
    return fzero.train_step(model, extending_worker.loss_of(model), tx, mesh)(state, batch)[1]


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_noise_is_drawn_alike_on_replicas_and_per_shard(stage):
    """What each rank adds is noise on the values it holds: at stage 0 (the whole average on every rank) the same
    on both ranks, so the replicas stay equal step after step; at stages 1-3 (a shard each) different on each; and
    the same again for the same seed and step."""
    batch = batches(steps=1)[0]
    plain = _seen(stage_chain(stage, after=[_probe()]), batch)["g"]
    noisy = _seen(stage_chain(stage, after=[gradient_noise(1e-2), _probe()]), batch)["g"]
    again = _seen(stage_chain(stage, after=[gradient_noise(1e-2), _probe()]), batch)["g"]
    added = noisy - plain
    assert torch.equal(noisy, again) and bool((added != 0).any())
    if stage == 0:
        assert torch.equal(added[0], added[1])
        model, mesh, tx = Net(), fzero.SimMesh(WORLD), stage_chain(0, after=[gradient_noise(1e-2)])
        state, step = fzero.init(model, tx, mesh), fzero.train_step(model, extending_worker.loss_of(model), tx, mesh)
        for b in batches():
            state, _ = step(state, b)
            assert torch.equal(state.params[0], state.params[1])
    else:
        assert not torch.equal(added[0], added[1])


def test_gradient_noise_has_the_stated_distribution():
    """On the true gradient (a loss scale of 2^10 paid first), the noise of 2^16 elements has mean 0 and standard
    deviation `std` within 5 standard errors of the sample statistics (`std / sqrt(n)` for the mean, `std /
    sqrt(2n)` for the deviation), and padding elements get none."""
    std, mesh = 0.5, fzero.SimMesh(1)
    model = torch.nn.Linear(255, 257)  # 65,792 elements: the layout pads the bias
    zero = fzero.stateless(lambda flow, ctx: flow._replace(grads=torch.zeros_like(flow.gradients("zero"))), "zero")
    tx = fzero.chain(zero, fzero.all_reduce(), fzero.scale_loss(1024.0), gradient_noise(std), _probe(),
                     fzero.shard_update(fzero.sgd(0.0)), fzero.gather())  # fmt: skip
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lambda p, b: fzero.call(model, p, b).sum(), tx, mesh)
    metrics = step(state, torch.ones(1, 2, 255))[1]
    g, pad = metrics["g"][0], state.layout.padding_mask()
    assert metrics["factor"] == 1.0 and bool((g[pad] == 0).all()) and int(pad.sum()) > 0
    real = g[~pad].double()
    n = real.numel()
    assert abs(float(real.mean())) <= 5 * std / math.sqrt(n)
    assert abs(float(real.std()) - std) <= 5 * std / math.sqrt(2 * n)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("scale", ["none", 64.0])
def test_clip_by_value_clamps_the_true_gradient(stage, scale):
    """After the reduction every element of the gradient this rank holds is the plain chain's, clamped to
    `limit` times the loss scale the gradients still carry (so the true gradient to `limit`): bitwise, and the
    factor they owe is unchanged."""
    batch, limit = batches(steps=1)[0], 1e-2
    plain = _seen(stage_chain(stage, after=[_probe()], scale=scale), batch)
    clipped = _seen(stage_chain(stage, after=[clip_by_value(limit), _probe()], scale=scale), batch)
    bound = limit / plain["factor"]
    assert clipped["factor"] == plain["factor"]
    assert torch.equal(clipped["g"], plain["g"].clamp(-bound, bound))
    assert bool((plain["g"].abs() > bound).any())  # the bound bites


# -------------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.timeout(300)
def test_two_gloo_processes_equal_the_simulation(tmp_path):
    """On 2 gloo processes (`DistMesh`) each transform at each stage gives bitwise the parameters and metrics of
    `SimMesh(2)` (2 ranks: gloo's sum is `a + b`, the simulation's); at stage 0 both processes hold the same
    parameters (gradient noise drawn alike on the replicas)."""
    spawn(extending_worker.run, (WORLD, str(tmp_path)), WORLD)
    results = json.loads((tmp_path / "results.json").read_text())
    want = [f"{case}/{s}" for case in extending_worker.CASES for s in stages(case)]
    assert sorted(results) == sorted(want)
    assert all(r["params"] == [] and r["metrics"] for r in results.values()), results
    assert all(r["synced"] for k, r in results.items() if k.endswith("/0")), results


def test_the_gloo_cases_exercise_the_transforms():
    """The cases the gloo half compares do change training (so bitwise agreement there is no accident)."""
    data = batches()
    plain = train(stage_chain(2), data)[0]
    for case, (make, micro) in extending_worker.CASES.items():
        params, metrics = train(make(2), batches(micro=micro))
        if case == "norms":
            assert all(sum(k.startswith("unit_grad_norm/") for k in m) == 3 for m in metrics), metrics
        else:
            assert differing(params, plain), case

"""The transform algebra itself: chains and their names, deferral, the reduction's per-unit form (the chain owns the
reduction at every stage), state shapes; and a property test that random chains of public pieces and user-written
reduce wrappers give bitwise the same parameters at stage 3 as at stage 2 (SimMesh here, 2 gloo processes too)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero.transforms import Context, EmptyState, Flow, StepInfo, unit_reducer
from tests import transforms_worker
from tests.chains import REDUCES, train
from tests.spawn import spawn
from tests.support import lm_batches, tiny_gpt
from tests.test_stages import equal

SPECS = st.fixed_dictionaries(
    {
        "reduce": st.sampled_from(sorted(REDUCES)),
        "micro": st.integers(1, 2),
        "scale": st.sampled_from([None, "none", 64.0]),
        "clip": st.sampled_from([None, 0.5]),
        "opt": st.sampled_from(["adamw", "sgd", "cpu_adamw"]),
    }
)


@settings(max_examples=15)
@given(spec=SPECS, world=st.integers(1, 3))
def test_stage3_equals_stage2_for_any_chain(spec, world):
    """Whatever the chain (a user's rounding or sparsifying reduction included), stage 3, which reduces unit by
    unit in the backward with the chain's own reduction, gives bitwise stage 2's parameters."""
    model = tiny_gpt(1)
    batches = lm_batches(model, world, spec["micro"], 2, 2, 3)
    two = train(spec, 2, fzero.SimMesh(world), batches)
    three = train(spec, 3, fzero.SimMesh(world), batches)
    assert all(torch.equal(two[k], three[k]) for k in two), spec


def test_a_user_reduction_is_honoured_at_stage_3():
    """The wrapper changes the result (so the equality above is no accident), at stage 3 as at stage 2."""
    model = tiny_gpt(1)
    batches = lm_batches(model, 2, 1, 2, 2, 3)
    spec = {"reduce": "topk", "micro": 1, "scale": None, "clip": None, "opt": "adamw"}
    plain = dict(spec, reduce="reduce_scatter")
    for stage in (2, 3):
        assert not torch.equal(train(spec, stage, fzero.SimMesh(2), batches)["head.weight"],
                               train(plain, stage, fzero.SimMesh(2), batches)["head.weight"])  # fmt: skip


@pytest.mark.timeout(300)
def test_two_gloo_processes(tmp_path):
    """On 2 gloo processes, stage 3 equals stage 2 bitwise for the user reductions, and DistMesh equals SimMesh."""
    spawn(transforms_worker.run, (2, str(tmp_path)), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results and all(r == {"stage3_vs_stage2": [], "dist_vs_sim": []} for r in results.values()), results


# ----------------------------------------------------------------------------------------------- the algebra itself


def test_chain_names_states_and_keeps_them_stable():
    tx = fzero.chain(fzero.reduce_scatter(), fzero.identity(), fzero.identity(), fzero.shard_update(fzero.sgd(0.1)))
    assert [n for n, _ in tx.children] == ["reduce_scatter", "identity", "identity#1", "shard_update"]
    state = fzero.init(torch.nn.Linear(3, 2), tx, fzero.SimMesh(2))
    assert list(state.tx_state) == ["reduce_scatter", "identity", "identity#1", "shard_update"]
    assert state.tx_state["identity"] == EmptyState()
    assert fzero.transforms.lookup(state.tx_state, "shard_update") is state.tx_state["shard_update"]
    with pytest.raises(ValueError, match="names must be unique"):
        fzero.named_chain(("a", fzero.identity()), ("a", fzero.identity()))
    with pytest.raises(TypeError, match="argument 1 is a function, not a Transform"):
        fzero.chain(fzero.identity(), lambda: None)


def test_deferral_stops_the_chain_and_keeps_later_state():
    seen = []
    spy = fzero.stateless(lambda flow, ctx: seen.append(1) or flow, "spy")
    tx = fzero.chain(fzero.reduce_scatter(), fzero.accumulate(3), spy, fzero.shard_update(fzero.sgd(1.0)))
    model = torch.nn.Linear(3, 2)
    mesh = fzero.SimMesh(1)
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lambda p, b: torch.func.functional_call(model, p, (b,)).sum(), tx, mesh)
    before = state.params.clone()
    for i in range(3):
        state, metrics = step(state, torch.ones(1, 1, 3))
        assert metrics["applied"] == (i == 2)
        assert torch.equal(state.params, before) == (i < 2)
    assert len(seen) == 1  # the transforms after accumulate ran at the boundary only


def test_reduced_gradients_skip_to_after_the_reduction():
    """Gradients handed over already reduced (what stage 3 does) pass the chain's reduction and what precedes it,
    and nothing else."""
    calls = []
    before = fzero.stateless(lambda flow, ctx: calls.append("before") or flow, "before", lambda g, i, ctx: g)
    after = fzero.stateless(lambda flow, ctx: calls.append("after") or flow, "after")
    tx = fzero.chain(before, fzero.reduce_scatter(), after)
    ctx = Context(fzero.SimMesh(1), None)
    flow = Flow(torch.zeros(1, 16), torch.zeros(1, 16), None, sharded=True, info=StepInfo(reduced=True))
    tx.update(flow, {"before": EmptyState(), "reduce_scatter": EmptyState(), "after": EmptyState()}, ctx)
    assert calls == ["after"]


def test_the_reducer_contract():
    """The chain's unit reduction composes the per-unit forms up to its reduction; a transform without one before
    the reduction makes stage 3 an error at init, naming it."""
    mesh = fzero.SimMesh(2)
    scale = fzero.stateless(lambda flow, ctx: flow, "double", lambda g, i, ctx: 2 * g)
    tx = fzero.chain(scale, fzero.reduce_scatter(), fzero.shard_update(fzero.sgd(0.1)), fzero.gather(lazy=True))
    grads = torch.arange(8.0).reshape(2, 4)  # two ranks' unit gradients
    got = unit_reducer(tx)(grads, 0, Context(mesh, None))
    assert torch.equal(got, torch.tensor([[4.0, 6.0], [8.0, 10.0]]))  # mean of 2 g over ranks, split
    no_unit = fzero.Transform(lambda f, c: (f, EmptyState()), lambda f, s, c: (f, s), "my_clip")
    bad = fzero.chain(no_unit, fzero.reduce_scatter(), fzero.shard_update(fzero.sgd(0.1)), fzero.gather(lazy=True))
    with pytest.raises(ValueError, match="'my_clip' comes before the reduction and cannot run per unit"):
        fzero.init(torch.nn.Linear(3, 2), bad, mesh)
    stage1_at_3 = fzero.chain(fzero.accumulate(2), fzero.reduce_scatter(), fzero.shard_update(fzero.sgd(0.1)),
                              fzero.gather(lazy=True))  # fmt: skip
    with pytest.raises(ValueError, match="'accumulate' comes before the reduction"):
        fzero.init(torch.nn.Linear(3, 2), stage1_at_3, mesh)
    stage2 = fzero.chain(no_unit, fzero.reduce_scatter(), fzero.shard_update(fzero.sgd(0.1)), fzero.gather())
    fzero.init(torch.nn.Linear(3, 2), stage2, mesh)  # fine where nothing runs per unit


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_shapes(stage):
    """Where the reduction sits decides what is sharded: accumulators full before it (stages 0-1), shards after."""
    mesh = fzero.SimMesh(4)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(), accumulate=2)
    state = fzero.init(torch.nn.Linear(8, 8), tx, mesh)
    n = state.layout.numel
    acc = fzero.transforms.lookup(state.tx_state, "accumulate").acc
    opt = fzero.transforms.lookup(state.tx_state, "shard_update")
    assert acc.shape == (4, n if stage <= 1 else n // 4)
    assert opt.exp_avg.shape == state.params.shape == (4, n if stage == 0 else n // 4)
    assert state.sharded_at_rest == (stage > 0)  # stages 1-2 gather at the step and keep (GatherState.keep)
    assert fzero.step.keeps_gathered(state) == (stage in (1, 2))


def test_two_optimizers_in_one_chain_is_an_error():
    tx = fzero.chain(fzero.all_reduce(), fzero.shard_update(fzero.sgd(0.1)), fzero.shard_update(fzero.sgd(0.1)))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(
        ValueError, match="two transforms that update the parameters: 'shard_update' and 'shard_update#1'"
    ):  # refused at init, before any step
        fzero.init(model, tx, fzero.SimMesh(1))


def _renamed(tx: fzero.Transform, nested: bool) -> fzero.Transform:
    """A preset spelled out as a researcher would: every step under a name of their own, optionally in two nested
    chains."""
    pairs = [(f"my-{i}", t) for i, (_, t) in enumerate(tx.children)]
    if not nested:
        return fzero.named_chain(*pairs)
    return fzero.named_chain(("head", fzero.named_chain(*pairs[:3])), ("tail", fzero.named_chain(*pairs[3:])))


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_chain_is_the_stage_its_transforms_make_whatever_their_names(stage, nested):
    """What a chain does is read from its transforms' types, not their names: a preset renamed (or nested) trains
    bitwise as the preset and moves the same collectives at every micro-step (stage 2 gathers nothing inside an
    accumulation window; stage 1 is not mistaken for stage 3)."""
    model = torch.manual_seed(0) and torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(2, 3, 16, generator=g)} for _ in range(4)]

    def loss(params, batch):
        return torch.func.functional_call(model, params, (batch["x"],)).square().mean()

    runs = []
    preset = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=2)
    for tx in (preset, _renamed(preset, nested)):
        state = fzero.init(model, tx, mesh)
        step = fzero.train_step(model, loss, tx, mesh)
        ledgers = []
        for batch in batches:
            state, metrics = step(state, batch)
            ledgers.append(metrics["comm"])
        runs.append((fzero.state_dict(state), ledgers, fzero.state_bytes(state), state.plan))
    (want, want_comm, want_bytes, want_plan), (got, got_comm, got_bytes, got_plan) = runs
    assert equal(got, want)
    assert got_comm == want_comm and got_bytes == want_bytes
    assert got_plan.stage == want_plan.stage == stage
    assert dataclasses.replace(got_plan, paths=()) == dataclasses.replace(want_plan, paths=())
    assert [role for role, _ in got_plan.paths] == [role for role, _ in want_plan.paths]
    if stage in (1, 2):
        assert "all_gather" not in got_comm[1]  # the second micro-step of the window keeps the gathered units


PLANS = {  # stage: (sharded, accumulate_before_reduce, gather, sharded_at_rest, keep_gathered)
    0: (False, True, "now", False, False),
    1: (True, True, "keep", True, True),
    2: (True, False, "keep", True, True),
    3: (True, False, "lazy", True, False),
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [None, "bf16"])
def test_each_stage_has_its_plan_and_holds_the_zero_memory(stage, precision):
    """The plan each preset makes, and the model-state memory a rank holds under it (fzero.state.memory's table): N
    padded parameters, W ranks, fp32 master and Adam (12 N, over W where sharded), the compute copy (2 N
    in bf16, none in fp32: it is the master tensor), an fp32 accumulator of full (stages 0-1) or sharded gradients."""
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    world = 4
    state = fzero.init(model, getattr(fzero, f"zero{stage}")(fzero.adamw(), accumulate=2, precision=precision),
                       fzero.SimMesh(world))  # fmt: skip
    plan = state.plan
    assert (plan.sharded, plan.accumulate_before_reduce, plan.gather, plan.sharded_at_rest, plan.keep_gathered) == (
        PLANS[stage]
    )
    assert (plan.stage, plan.accumulate, plan.world, plan.stacked, plan.per_unit) == (stage, 2, world, True, stage >= 2)
    assert plan.compute_dtype == (torch.bfloat16 if precision else torch.float32)
    n = state.layout.numel
    shard = n // world if stage else n
    got = fzero.state_bytes(state)
    assert got["master"] == 4 * shard and got["optimizer"] == 8 * shard
    assert got["compute"] == (2 * shard if precision else 0)
    assert got["accumulator"] == 4 * (n if stage < 2 else n // world)

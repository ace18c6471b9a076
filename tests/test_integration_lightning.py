"""`fzero.integrations.lightning.FzeroStrategy` under real Lightning 2.6 Trainers, 2 gloo processes (one spawn).

A tiny GPT-2 in a LightningModule (AdamW lr 1e-2, a decaying LambdaLR), 24 fixed sequences, micro-batch 2 per rank,
`accumulate_grad_batches=2`, `gradient_clip_val=1.0`, 6 optimizer steps, at ZeRO stages 2 and 3, against Lightning's
own `strategy="ddp"` on the same data (tests/lightning_worker.py runs them all in one pair of processes):

- fzero and DDP differ only in how the gradient is reduced (fzero: each rank's micro-batches summed, then the ranks
  reduce-scattered, the clip norm from flat shards; DDP: buckets all-reduced, the clip norm from per-tensor norms),
  so the parameters are compared with Adam's step bound and the detection threshold (tests/bounds.py, kind 3), after
  every step, and the losses with the bound derived in `test_the_same_training_as_lightning_ddp`;
- a new Trainer resuming from the step-3 `ModelCheckpoint` with `fit(ckpt_path=...)` reproduces steps 4-6 bitwise;
- `strategy.lightning_module_state_dict()` is the full parameters, the same on both ranks, and what
  `trainer.save_checkpoint` wrote (consolidated by `fzero.consolidate`);
- contradictions between the Trainer and the config raise a ValueError naming both.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.bounds import U32, adam_check, assert_within
from tests.spawn import spawn

STAGES = (2, 3)


def _run(rank: int, *args: Any) -> None:
    # Lightning is imported in the workers only: importing it here too would add ~8 s to this file
    from tests import lightning_worker

    lightning_worker.run(rank, *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    spawn(_run, (2, str(out / "store"), str(out)), 2)
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["stages"] == list(STAGES)
    return out, results


@pytest.fixture(scope="module")
def w(runs):
    """The worker's settings (tests/lightning_worker.py)."""
    s = runs[1]["setup"]
    return SimpleNamespace(STEPS=s["steps"], ACCUMULATE=s["accumulate"], LR=s["lr"])


def tensors(out, name: str) -> dict[str, torch.Tensor]:
    return load_file(out / f"{name}.safetensors")


def step(state: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """The parameters after optimizer step `t` (0: before any), from a `lightning_worker.steps` file."""
    prefix = f"{t}/"
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_the_same_training_as_lightning_ddp(runs, w, stage):
    """Parameters after every step within Adam's step bound of DDP's, and tracking it (mean difference under
    0.1% of the distance DDP moved them; measured: at most 1.1e-5 per element against a bound of 0.12 after 6
    steps, and 5.7e-7 of the distance).

    Losses: before the first update both runs hold the same parameters and run the same forward, so the first
    window's losses are bitwise equal. After step t, by the mean value theorem, the loss of a micro-batch moves by
    |L(theta_fz) - L(theta_ddp)| <= ||grad L(xi)||_1 * max|theta_fz - theta_ddp| for some xi between the two;
    `grad_l1` is ||grad L||_1 at DDP's parameters (torch.func, in the reference run), and the factor 2 covers its
    change over a segment of at most ~1e-5 per element (it would need second derivatives ~1e5 times the gradient
    to double there). The forwards also round differently once their parameters differ: 8 ulp of the loss.
    Measured: at most 4.8e-7 (1 ulp) against bounds from 2.6e-5.
    """
    out, results = runs
    ddp, fz = results["ddp"], results[f"z{stage}"]
    start, ddp_steps, fz_steps = tensors(out, "start"), tensors(out, "ddp-steps"), tensors(out, f"z{stage}-steps")
    assert fz["global_step"] == w.STEPS and len(fz["losses"][0]) == w.STEPS * w.ACCUMULATE
    for t in range(1, w.STEPS + 1):
        assert_within(adam_check(step(fz_steps, t), step(ddp_steps, t), start, w.LR, t))
    final = tensors(out, f"z{stage}")
    assert_within(adam_check(final, tensors(out, "ddp"), start, w.LR, w.STEPS))
    for rank, (got, ref, g1) in enumerate(zip(fz["losses"], ddp["losses"], ddp["grad_l1"], strict=True)):
        assert got[: w.ACCUMULATE] == ref[: w.ACCUMULATE], rank
        for j in range(w.ACCUMULATE, len(ref)):
            t = j // w.ACCUMULATE  # the optimizer steps before this micro-batch
            apart = max(
                (step(fz_steps, t)[k].double() - v.double()).abs().max().item() for k, v in step(ddp_steps, t).items()
            )
            bound = 2 * g1[j] * apart + 8 * U32 * abs(ref[j])
            assert abs(got[j] - ref[j]) <= bound, (rank, j, got[j], ref[j], bound)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [f"z{stage}" for stage in STAGES] + ["config-optimizer"])
def test_resume_from_a_lightning_checkpoint_is_bitwise(runs, w, name):
    """`ModelCheckpoint(every_n_train_steps=3)` wrote fzero checkpoint directories; a new Trainer (and a module
    with other values) resuming from step 3 with `fit(ckpt_path=...)` gives the uninterrupted run's losses of
    steps 4-6 and its final parameters, bitwise: the engine's state, the accumulation window, the param groups'
    learning rates (fzero's record) and the LambdaLR's state (Lightning's, in the client_state) all came back;
    with the config's optimizer and WarmupLR (`configure_optimizers` returning None), the engine's schedule."""
    out, results = runs
    fz = results[name]
    assert fz["checkpoints"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert fz["resumed_global_step"] == w.STEPS
    half = w.STEPS // 2 * w.ACCUMULATE
    assert fz["resumed_losses"] == [losses[half:] for losses in fz["losses"]]
    final, resumed = tensors(out, name), tensors(out, f"{name}-resumed")
    assert final.keys() == resumed.keys()
    assert all(torch.equal(final[k], resumed[k]) for k in final)


@pytest.mark.timeout(300)
def test_lightning_is_fzeros_engine_bitwise(runs):
    """The same training through `fzero.deepspeed.initialize` directly (tests/lightning_worker.shell): Lightning's
    loop adds nothing to fzero's step."""
    out, _ = runs
    got, shell = tensors(out, "z2"), tensors(out, "z2-shell")
    assert got.keys() == shell.keys() and all(torch.equal(got[k], shell[k]) for k in got)


@pytest.mark.timeout(300)
def test_the_config_schedule_is_the_engines(runs):
    """With the config's WarmupLR the engine steps the schedule once per update (Lightning's own calls do
    nothing): as DeepSpeed's, its first two updates have learning rate `warmup_min_lr` (0: the schedule's value
    before it has started, then at iteration 0) and leave every parameter as it was; the third moves them (a
    second stepping would have moved the second)."""
    out, _ = runs
    start, steps = tensors(out, "start"), tensors(out, "config-optimizer-steps")
    for t in (1, 2):
        assert all(torch.equal(step(steps, t)[k], v) for k, v in start.items()), t
    assert not all(torch.equal(step(steps, 3)[k], v) for k, v in start.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", STAGES)
def test_lightning_module_state_dict_is_the_consolidated_parameters(runs, stage):
    """Every key of the LightningModule's `state_dict`, at full shape (at stage 3 too), on both ranks alike, and
    bitwise what `trainer.save_checkpoint` wrote (`fzero.consolidate` of its directory); stages 2 and 3 trained
    bitwise alike (the same arithmetic, only sharded differently)."""
    out, results = runs
    fz = results[f"z{stage}"]
    start, final = tensors(out, "start"), tensors(out, f"z{stage}")
    assert sorted(final) == fz["module_state_dict_keys"] == sorted(start)
    assert fz["state_dict_shapes"] == {k: list(v.shape) for k, v in start.items()}
    assert fz["same_on_every_rank"]
    resumed, consolidated = tensors(out, f"z{stage}-resumed"), tensors(out, f"z{stage}-consolidated")
    assert consolidated.keys() == resumed.keys()
    assert all(torch.equal(consolidated[k], resumed[k]) for k in resumed)
    other = tensors(out, f"z{STAGES[0]}")
    assert all(torch.equal(final[k], other[k]) for k in final)


@pytest.mark.timeout(300)
def test_contradictions_raise_before_training(runs):
    """`accumulate_grad_batches=4` against the config's `gradient_accumulation_steps: 2`, and `precision="16-mixed"`
    against a bf16 config: a ValueError naming both sides, raised while the Trainer sets up (before the engine)."""
    _, results = runs
    message = results["contradiction"]
    assert message is not None and "accumulate_grad_batches=4" in message
    assert '"gradient_accumulation_steps": 2' in message
    message = results["precision_contradiction"]
    assert message is not None and 'precision="16-mixed"' in message and '"bf16"' in message


def test_client_state_round_trip(runs):
    """Lightning's checkpoint entries as the JSON client_state: tensors (ModelCheckpoint's scores, `inf` before any)
    and non-finite floats come back equal, with their dtypes and shapes; tuples as lists; complex refused by name."""
    got = runs[1]["client_state"]
    assert got["same"] == {"kth_value": True, "scores": True, "count": True, "flag": True}
    assert got["best"] == "-inf" and got["pair"] == [1, "a"]
    assert "checkpoint['z'] is a torch.complex64 tensor" in got["refused"]


def test_the_strategy_holds_the_alias_and_needs_no_deepspeed_distribution(runs):
    """While a strategy lives `import deepspeed` is fzero's shell, also where Lightning's check that the deepspeed
    distribution is installed reads False (its cached answers restored after); collected, the alias is gone."""
    got = runs[1]["alias"]
    assert got == {"during": "fzero.deepspeed", "caches_after_init": [False, False], "after": got["after"]}
    assert got["after"] != "fzero.deepspeed"

"""Each optimizer's DeepSpeed config through the engine (tests/engine_optim_worker.py: Lamb with weight decay and a
non-default max_coeff at stages 2 and 3, Lion with weight decay at stages 2 and 3, Adagrad with lr_decay and
initial_accumulator_value, Adam with bias_correction false, AdamW with torch_adam and amsgrad, AdamW with
prescale_gradients, AdamW with gradient_predivide_factor 3, Muon at stages 2 and 3: each matrix orthogonalised whole by
its owner rank) trains a tiny Hugging Face GPT-2 on 2 gloo processes
(gradient accumulation 2, WarmupLR, clipping, two param groups but in the last case), and a checkpoint resumes
bitwise like the uninterrupted run: on 2 processes, and at world 1 from the world-2 checkpoint.

One spawn of 2 processes runs every case (the module's fixture); the tests read its results per case.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from tests import engine_optim_worker as w
from tests.spawn import spawn

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run of every case: its directory and each rank's results."""
    out = tmp_path_factory.mktemp("engine_optim")
    spawn(w.run, (w.WORLD, str(out)), w.WORLD)
    return out, [json.loads((out / f"results{r}.json").read_text()) for r in range(w.WORLD)]


@pytest.mark.parametrize("case", list(w.CASES))
def test_resume_on_two_processes_is_bitwise(runs, case):
    """On 2 gloo processes: SAVE_AT optimizer steps, `save_checkpoint`, on to STEPS (the uninterrupted run); a
    fresh engine on each rank (another seed, so every leaf differed before the load, and another generator state)
    loads the checkpoint and trains the same micro-steps with per-rank dropout: the same losses, consolidated
    parameters and every leaf of the state (moments, Adagrad's sum, AMSGrad's max_exp_avg_sq, counts), bitwise on
    both ranks, and the same counters. The engine runs the optimizer the config maps to on a CPU run (the native
    `cpu_lion`, `cpu_adagrad`, `cpu_adamw`; `lamb`; torch's arithmetic with torch_adam: `adamw`)."""
    _, results = runs
    optimizer = w.CASES[case][4]
    for rank, res in enumerate(results):
        r = res[case]
        assert r["optimizer"] == optimizer, (rank, r["optimizer"])
        assert r["path"].endswith(f"global_step{w.SAVE_AT}")
        assert r["start_differs"] > 0  # the fresh engine's own state is not the checkpoint's
        assert r["params_differ"] == [] and r["state_differ"] == [], (rank, r["params_differ"], r["state_differ"])
        assert r["losses"][0] == r["losses"][1], rank
        samples = w.MICRO * w.GAS * w.WORLD
        assert r["counters"][0] == [w.SAVE_AT, w.SAVE_AT * samples, w.SAVE_AT * w.GAS, 0, w.SAVE_AT]
        assert r["counters"][1] == r["counters"][2] == [w.STEPS, w.STEPS * samples, w.STEPS * w.GAS, 0, w.STEPS]
    assert results[0][case]["losses"][0] != results[1][case]["losses"][0]  # the ranks trained on their own data


@pytest.mark.parametrize(("case", "changes"), [("adamw-prescale-2", False), ("adamw-predivide-2", True)])
def test_average_keys_take_effect(runs, case, changes):
    """The averaging keys reach the reduction: with gradient_predivide_factor 3 (sum of g / 3, times 3 / 2) the
    state at the save differs from the same run without it. prescale_gradients at world 2 multiplies by 1/2 before
    the sum, which is exact, so that run is bitwise the default mean: its case proves the resume with the key set,
    not the key's arithmetic (tests of fzero.Average do that)."""
    _, results = runs
    assert [r[case]["average_changes"] for r in results] == [changes] * w.WORLD


@pytest.mark.parametrize("case", list(w.CASES))
def test_world_two_checkpoint_resumes_at_world_one(runs, case):
    """The world-2 checkpoint into a world-1 engine (same stage), in this process.

    1. Every leaf of the loaded state is bitwise what the 2 ranks held in memory when they saved: rank 0 wrote it
       consolidated (each param-space leaf all-gathered from the ranks' live shards and split by parameter, not
       read back from the checkpoint): parameters, every optimizer-state leaf (exp_avg, exp_avg_sq, sum,
       max_exp_avg_sq, per parameter), the counts, the accumulator; and the engine's counters are the saved ones.
       Each optimizer leaf the case's optimizer keeps is there and non-zero (Adagrad's sum also differs from its
       initial value), so losing, resetting or mis-sharding one fails here.
    2. Training on at world 1 is bitwise an engine that got the same state another way: a fresh world-1 engine
       whose state leaves are set in memory from rank 0's consolidated values (`inject`, no checkpoint, no
       resharding) with the same counters. Both train 4 optimizer steps with the same generator: the same losses and
       every state leaf bitwise. The reference carries the saved optimizer state, so a leaf the load lost, reset or
       put at the wrong offsets makes the two runs differ too (the arithmetic at world 2 rounds otherwise than at
       world 1, so the world-2 run itself is no reference here)."""
    out, results = runs
    saved = load_file(out / f"{case}.safetensors")
    leaves = w.CASES[case][5]
    for leaf in leaves:
        keys = [k for k in saved if k.startswith(f"tx_state/shard_update/{leaf}/")]
        assert keys and all(torch.count_nonzero(saved[k]) > 0 for k in keys), leaf
    if case.startswith("adagrad"):
        assert all(not torch.all(saved[k] == 0.1) for k in saved if k.startswith("tx_state/shard_update/sum/"))
    assert int(saved["tx_state/shard_update/count"]) == w.SAVE_AT
    start = dict(w.model(0).named_parameters())  # the run's initial weights: training moved every tensor
    assert [n for n, p in start.items() if torch.equal(p, saved[f"params/{n}"])] == []

    one = w.engine(case, seed=1)
    path, _ = one.load_checkpoint(out / case)
    assert path.endswith(f"global_step{w.SAVE_AT}")
    assert w.differing(w.gathered_state(one), saved) == []
    assert w.counters(one) == results[0][case]["counters"][0]

    ref = w.engine(case, seed=2)
    ref.restore(w.inject(ref, saved), copy.deepcopy(one.counters))
    assert w.differing(w.gathered_state(ref), saved) == []
    data = w.batches(1, w.STEPS * w.GAS)
    losses = []
    for eng in (one, ref):
        torch.manual_seed(5)
        losses.append(w.train(eng, data, 0, 0, w.STEPS * w.GAS))
    assert losses[0] == losses[1]
    assert w.differing(w.gathered_state(one), w.gathered_state(ref)) == []
    assert w.counters(one) == w.counters(ref)
    assert one.global_steps == w.SAVE_AT + w.STEPS and w.differing(w.gathered_state(one), saved)  # it trained on

"""`engine.save_checkpoint` / `engine.load_checkpoint` (DeepSpeed's API over fzero's checkpoint format): a resume is
bitwise the uninterrupted run (every stage, fp32/fp16/bf16, inside an accumulation window, on 1 process and on 2
gloo processes); client_state; the flags; resharding 2 -> 1 ranks and across stages; the errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import fzero
from fzero.checkpoint import CheckpointError, IncompatibleCheckpointError, named_leaves
from tests.engine_ckpt_worker import batches, config, counters, engine, model, train
from tests.spawn import spawn


def _equal_states(a, b) -> bool:
    """Every leaf of two engines' states (parameters, moments, counts, accumulators, loss scale) bitwise equal."""
    la, lb = named_leaves(a.state), named_leaves(b.state)
    if la.keys() != lb.keys():
        return False
    flat = lambda v: torch.cat([t.reshape(-1).double() for t in v.values()]) if isinstance(v, dict) else v  # noqa: E731
    return all(torch.equal(flat(la[k]).view(-1), flat(lb[k]).view(-1)) for k in la)


def _params_equal(a, b) -> bool:
    pa, pb = a.module_state_dict(), b.module_state_dict()
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


# ------------------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize(
    ("stage", "precision", "gas", "k"),
    [(0, "fp32", 1, 3), (1, "fp16", 2, 5), (2, "fp32", 2, 4), (3, "bf16", 3, 7)],
)
def test_resume_is_bitwise(tmp_path, stage, precision, gas, k):
    """Save at micro-step k (k=5 and 7 are inside an accumulation window), continue to 10; a fresh engine built
    from another seed and another generator state loads it and continues: the same losses, parameters, every
    state leaf, counters, loss scale, learning rate and the logged loss of the window that straddles the save."""
    cfg, data = config(stage, precision, gas), batches(10)
    a = engine(cfg, seed=0)
    torch.manual_seed(5)
    train(a, data, 0, k)
    assert a.save_checkpoint(tmp_path, client_state={"epoch": 2}) is True  # DeepSpeed's return value
    path = tmp_path / f"global_step{a.global_steps}"
    assert path.is_dir() and (tmp_path / "latest").read_text().strip() == path.name
    losses_a = train(a, data, k, 10)

    b = engine(cfg, seed=1)
    torch.manual_seed(77)
    assert not _params_equal(a, b)
    got_path, client = b.load_checkpoint(tmp_path)
    assert (got_path, client) == (str(path), {"epoch": 2})
    assert b.micro_steps == k
    assert train(b, data, k, 10) == losses_a
    assert _params_equal(a, b) and _equal_states(a, b)
    assert counters(a) == counters(b)
    seen = [(e.optimizer.cur_scale, e.get_lr(), e.last_record["loss"]) for e in (a, b)]
    assert seen[0] == seen[1]
    if precision == "fp16":
        assert a.optimizer.cur_scale > 16.0  # the dynamic scale grew during the run: its counters were resumed too


def test_resume_without_the_generators_differs(tmp_path):
    """The model draws dropout masks: without `restore_rng` the continuation differs (the test above can fail)."""
    cfg, data = config(2), batches(6)
    a = engine(cfg)
    torch.manual_seed(5)
    train(a, data, 0, 3)
    a.save_checkpoint(tmp_path)
    train(a, data, 3, 6)
    b = engine(cfg)
    torch.manual_seed(77)
    b.load_checkpoint(tmp_path, restore_rng=False)
    train(b, data, 3, 6)
    assert not _params_equal(a, b)


def test_client_scheduler_resumes_bitwise(tmp_path):
    """A client torch AdamW with a torch LambdaLR: its state_dict and the param group's lr are saved (JSON) and
    restored; with `load_lr_scheduler_states=False` the fresh scheduler is kept."""

    def build():
        m = model(0)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
        eng, *_ = fzero.initialize(
            model=m, optimizer=opt, lr_scheduler=sched, printer=lambda *a: None,
            config={"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0},
        )  # fmt: skip
        return eng, sched

    data = batches(6)
    a, sa = build()
    torch.manual_seed(3)
    train(a, data, 0, 3)
    a.save_checkpoint(tmp_path)
    train(a, data, 3, 6)
    b, sb = build()
    b.load_checkpoint(tmp_path)
    assert sb.last_epoch == 3 and b.optimizer.param_groups[0]["lr"] == 0.01 / 4
    train(b, data, 3, 6)
    assert _params_equal(a, b) and sa.state_dict() == sb.state_dict()
    c, sc = build()
    c.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    # the rest is loaded, the param group's lr with the optimizer state (as torch's and DeepSpeed's do)
    assert sc.last_epoch == 0 and c.optimizer.param_groups[0]["lr"] == 0.01 / 4
    assert c.global_steps == 3 and c.applied_updates() == 3


# ------------------------------------------------------------------------------------------------- client_state, tags
def test_client_state_tags_and_latest(tmp_path):
    eng = engine(config(1))
    data = batches(4)
    train(eng, data, 0, 2)
    state = {"epoch": 1, "nested": {"best": 0.25, "names": ["a", "b"]}, "pair": (1, 2), "none": None}
    eng.save_checkpoint(tmp_path, client_state=state)
    train(eng, data, 2, 3)
    eng.save_checkpoint(tmp_path, tag=7, save_latest=False)  # str(tag), as DeepSpeed; latest unchanged
    assert (tmp_path / "latest").read_text().strip() == "global_step2" and (tmp_path / "7").is_dir()
    fresh = engine(config(1))
    path, client = fresh.load_checkpoint(tmp_path)
    assert path.endswith("global_step2") and fresh.global_steps == 2
    assert client == {**state, "pair": [1, 2]}  # JSON: tuples come back as lists
    path, client = fresh.load_checkpoint(tmp_path, tag=7)
    assert path.endswith("/7") and client == {} and fresh.global_steps == 3
    # the format is the same: fzero.load reads an engine checkpoint, and the manifest records config and counters
    _, extra = fzero.load(tmp_path, engine(config(1)).state)
    assert extra["user_state"]["client_state"]["epoch"] == 1 and extra["user_state"]["engine"]["global_steps"] == 2
    assert extra["config"]["zero_optimization"]["stage"] == 1 and extra["data_position"] == 2
    # a second save of the same tag replaces it atomically (DeepSpeed writes over it), unless overwrite=False
    eng.save_checkpoint(tmp_path, tag=7, client_state={"again": True})
    assert fresh.load_checkpoint(tmp_path, tag=7)[1] == {"again": True}
    with pytest.raises(CheckpointError, match="already exists"):
        eng.save_checkpoint(tmp_path, tag=7, overwrite=False)


@pytest.mark.parametrize(
    ("client_state", "error", "match"),
    [
        ({"step": torch.tensor(3)}, TypeError, r"client_state\['step'\] is a Tensor.*\.item\(\)"),
        ({"a": {"b": [1, object()]}}, TypeError, r"client_state\['a'\]\['b'\]\[1\] is a object"),
        ({"loss": float("nan")}, ValueError, r"client_state\['loss'\] is nan"),
        ({"a": {3: "x"}}, TypeError, r"client_state\['a'\] has the key 3 \(int\)"),
        ([1, 2], TypeError, "client_state must be a dict, got list"),
    ],
)
def test_client_state_must_be_json(tmp_path, client_state, error, match):
    eng = engine(config(0))
    train(eng, batches(1), 0, 1)
    with pytest.raises(error, match=match):
        eng.save_checkpoint(tmp_path, client_state=client_state)
    assert not any(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------------------------------------------------- the flags
def _trained(tmp_path, cfg, steps=4):
    a = engine(cfg, seed=0)
    torch.manual_seed(5)
    train(a, batches(steps), 0, steps)
    a.save_checkpoint(tmp_path)
    return a


def test_load_module_only(tmp_path):
    """Parameters only: the optimizer state, loss scale, counters are the engine's own; training on is bitwise a
    fresh engine whose model starts from the checkpoint's weights."""
    cfg = config(2, "fp16", gas=2)
    a = _trained(tmp_path, cfg, steps=6)
    b = engine(cfg, seed=1)
    train(b, batches(2, seed=3), 0, 2)  # b has trained a little: its own counters and moments stay
    before = (counters(b), b.optimizer.cur_scale, b.applied_updates())
    path, client = b.load_checkpoint(tmp_path, load_module_only=True)
    assert path is not None and client == {}
    assert _params_equal(a, b) and (counters(b), b.optimizer.cur_scale, b.applied_updates()) == before

    fresh = engine(cfg, seed=1)
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    start = model(1)
    start.load_state_dict(a.module_state_dict())
    ref = engine(cfg, module=start)  # a fresh engine on the checkpoint's weights
    data = batches(4, seed=9)
    torch.manual_seed(1)
    train(fresh, data, 0, 4)
    torch.manual_seed(1)
    train(ref, data, 0, 4)
    assert counters(fresh) == counters(ref) == (2, 16, 4, 0) and _params_equal(fresh, ref)


def test_load_optimizer_states_false(tmp_path):
    """The parameters, counters and loss scale load; the optimizer state stays the engine's fresh one, and with
    it the config's schedule restarts (a warning says so)."""
    cfg = config(1, "fp16")
    a = _trained(tmp_path, cfg)
    b = engine(cfg, seed=1)
    with pytest.warns(UserWarning, match="schedule cannot be kept without the optimizer state"):
        b.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert _params_equal(a, b) and counters(a) == counters(b) and a.optimizer.cur_scale == b.optimizer.cur_scale
    assert b.applied_updates() == 0 and b.get_lr() == engine(cfg).get_lr()
    leaves = named_leaves(b.state)
    assert all(torch.count_nonzero(t) == 0 for t in leaves["tx_state/shard_update/exp_avg"].values())
    # without a schedule nothing is lost: no warning
    a2 = _trained(tmp_path / "plain", config(1, scheduler=False))
    c = engine(config(1, scheduler=False), seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.load_checkpoint(tmp_path / "plain", load_optimizer_states=False)
    assert _params_equal(a2, c)


def test_lr_scheduler_flag_cannot_be_separated_from_the_optimizer(tmp_path):
    _trained(tmp_path, config(1))
    b = engine(config(1), seed=1)
    with pytest.raises(ValueError, match="function of the optimizer's applied-update count"):
        b.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert b.global_steps == 0  # nothing loaded
    _trained(tmp_path / "plain", config(1, scheduler=False))
    c = engine(config(1, scheduler=False), seed=1)
    assert c.load_checkpoint(tmp_path / "plain", load_lr_scheduler_states=False)[0] is not None  # constant lr: fine


def test_unsupported_arguments(tmp_path):
    eng = _trained(tmp_path, config(0))
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        eng.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)


# ---------------------------------------------------------------------------------------------- missing, errors
def test_missing_checkpoint_warns_and_returns_none(tmp_path):
    """As DeepSpeed: no `latest` (or no such tag) is a warning and `(None, None)`, and the engine is unchanged."""
    eng = engine(config(2))
    train(eng, batches(2), 0, 2)
    before = eng.module_state_dict()
    for where, tag in ((tmp_path, None), (tmp_path, "global_step9"), (tmp_path / "nowhere", None)):
        with pytest.warns(UserWarning, match="nothing loaded"):
            assert eng.load_checkpoint(where, tag=tag) == (None, None)
    assert eng.global_steps == 2 and all(torch.equal(v, eng.module_state_dict()[k]) for k, v in before.items())


def test_damaged_checkpoint_raises(tmp_path):
    """A checkpoint that is there but damaged is an error, never a silent skip."""
    eng = _trained(tmp_path, config(2))
    shard = next((tmp_path / "global_step4").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        eng.load_checkpoint(tmp_path)


def test_refused_between_backward_and_step(tmp_path):
    """The gradients of a micro-step not yet stepped are outside the state: save and load refuse; a forward alone
    (evaluation) does not block either."""
    eng = engine(config(1, gas=2))
    x, y = batches(1)[0]
    loss = F.mse_loss(eng(x), y)
    eng.backward(loss)
    for call in (lambda: eng.save_checkpoint(tmp_path), lambda: eng.load_checkpoint(tmp_path)):
        with pytest.raises(RuntimeError, match="between engine.backward\\(loss\\) and engine.step\\(\\)"):
            call()
    eng.step()
    with torch.no_grad():
        eng(x)
    eng.save_checkpoint(tmp_path)  # inside the accumulation window, after an evaluation forward
    assert eng.load_checkpoint(tmp_path)[0] is not None and eng.micro_steps == 1
    train(eng, batches(1), 0, 1)  # the discarded forward does not disturb the next micro-step
    assert eng.global_steps == 1


def test_accumulation_steps_change(tmp_path):
    """At a boundary a checkpoint loads into another gradient_accumulation_steps (counters re-based so the boundary
    falls right); inside a window it cannot, and says so."""
    _trained(tmp_path / "b", config(2, gas=2), steps=4)
    eng = engine(config(2, gas=3))
    eng.load_checkpoint(tmp_path / "b")
    assert (eng.global_steps, eng.micro_steps) == (2, 6)
    train(eng, batches(3), 0, 3)
    assert eng.global_steps == 3
    _trained(tmp_path / "w", config(2, gas=2), steps=3)
    with pytest.raises(IncompatibleCheckpointError, match="inside a gradient accumulation window"):
        engine(config(2, gas=3)).load_checkpoint(tmp_path / "w")


def test_plain_fzero_save_loads_with_derived_counters(tmp_path):
    a = engine(config(1, gas=2))
    train(a, batches(4), 0, 4)
    fzero.save(a.state, tmp_path, user_state={"note": "plain"})
    b = engine(config(1, gas=2), seed=1)
    with pytest.warns(UserWarning, match="not saved by engine.save_checkpoint"):
        _, client = b.load_checkpoint(tmp_path)
    assert client == {"note": "plain"} and counters(b) == counters(a) and _params_equal(a, b)


# ------------------------------------------------------------------------------------------------ stages and worlds
@pytest.mark.parametrize("target", [0, 3])
def test_another_stage_loads(tmp_path, target):
    """A stage-2 checkpoint into stage 0 and stage 3 engines: the same parameters and optimizer state; at world 1
    the stages compute the same arithmetic, so training on is bitwise the stage-2 engine's."""
    a = _trained(tmp_path, config(2, gas=2), steps=4)
    b = engine(config(target, gas=2), seed=1)
    b.load_checkpoint(tmp_path)
    assert _equal_states(a, b) and counters(a) == counters(b)
    torch.manual_seed(4)
    train(a, batches(4, seed=2), 0, 4)
    torch.manual_seed(4)
    train(b, batches(4, seed=2), 0, 4)
    assert _params_equal(a, b)


@pytest.mark.timeout(600)
def test_two_gloo_processes_and_resharding_to_one(tmp_path):
    """On 2 gloo processes: stage 1 (fp16) and stage 3 (bf16) saved inside an accumulation window with per-rank
    dropout draws, and resumed by fresh engines: bitwise, on both ranks; client_state is rank 0's; different tags
    on the ranks fail on both, writing nothing. Then the world-2 stage-2 checkpoint loads into one process at
    stages 2 and 3: the consolidated parameters bitwise and the counters as saved; training continues."""
    from tests import engine_ckpt_worker

    spawn(engine_ckpt_worker.run, (2, str(tmp_path)), 2)
    results = [json.loads((tmp_path / f"results{r}.json").read_text()) for r in range(2)]
    for r in results:
        for stage in ("1", "3"):
            res = r[stage]
            assert res["equal"] and res["losses"][0] == res["losses"][1], stage
            assert res["counters"][0] == res["counters"][1] == [4, 64, 9, 0]
            assert res["loss_scale"][0] == res["loss_scale"][1]
            assert res["client"] == {"rank_saved": 0, "epoch": 3} and res["path"].endswith("global_step2")
        assert "different tags ('rank0', 'rank1', by rank)" in r["mismatch"]
        assert r["mismatch_exists"] == [False, False]

    saved = load_file(tmp_path / "w2_params.safetensors")
    for stage in (2, 3):
        eng = engine(config(stage, gas=2), seed=1)
        path, _ = eng.load_checkpoint(tmp_path / "w2", tag="at4")
        assert path is not None and list(counters(eng)) == results[0]["w2_counters"]
        got = eng.module_state_dict()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
        train(eng, batches(2), 0, 2)
        assert eng.global_steps == results[0]["w2_counters"][0] + 1
    # a stage-1 checkpoint taken inside a window holds each rank's local sums: they cannot move to one rank
    with pytest.raises(IncompatibleCheckpointError):
        engine(config(1, "fp16", gas=2), seed=1).load_checkpoint(tmp_path / "ckpt1")

"""The engine methods DeepSpeed scripts call, held against DeepSpeed 0.19.8 itself (CPU accelerator, gloo) on 1 and 2
processes: `no_sync` (stages 0-1; refused at 2-3), `set_gradient_accumulation_boundary` as Accelerate calls it,
`save_16bit_model`, `save_checkpoint(exclude_frozen_parameters=True)` and its load, `zero_to_fp32.py` beside the
checkpoints, `loss_scale()` and the other accessors, `lr_scheduler` / `training_dataloader`, `destroy`; then, on
one process, the refusals (`engine.compile`, a boundary the chain cannot honour) and the file names.

Where the arithmetic is DeepSpeed's (fp32, and bf16 with DeepSpeed's bf16 gradient reduction), losses and weights are
compared bitwise: DeepSpeed divides each micro-batch's gradient by gradient_accumulation_steps and adds, fzero adds
and divides once; with 2 accumulation steps the division is exact, so both are the same sum.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fzero
import fzero.deepspeed as deepspeed
from tests import deepspeed_engine_worker as w
from tests.bounds import assert_adam_close
from tests.spawn import spawn

WORLDS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds-engine")
    for world in WORLDS:
        spawn(w.run, (world, str(tmp)), world)
    results = {(t, world): json.loads((tmp / f"{t}-{world}.json").read_text()) for t in ("deepspeed", "fzero")
               for world in WORLDS}  # fmt: skip
    return tmp, results


def both(runs, world: int, case: str) -> tuple[dict, dict]:
    _, results = runs
    return results["deepspeed", world][case], results["fzero", world][case]


def weights_16bit(tmp, trainer: str, world: int, case: str) -> dict[str, torch.Tensor]:
    folder = tmp / f"{trainer}-{world}" / case / "model16"
    if trainer == "deepspeed":
        return torch.load(folder / "pytorch_model.bin", weights_only=True)
    return load_file(folder / "model.safetensors")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_the_same_training_as_deepspeed(runs, world):
    """no_sync (2 micro-batches in it, one outside, one step), Accelerate's boundary-per-backward with one step()
    per window, and 3 steps of plain training: the losses of every micro-batch, the boundaries seen, global_steps and
    global_samples are DeepSpeed's, bitwise; fzero reduces nothing inside no_sync. Under the script's boundary
    DeepSpeed's micro_steps counts step() calls, fzero's the micro-batches (fzero.engine.accumulation)."""
    for case, (_, gas, _, mode, _) in w.CASES.items():
        ds, fz = both(runs, world, case)
        assert fz["losses"] == ds["losses"], case
        assert fz["boundaries"] == ds["boundaries"], case
        assert fz["counters"][:2] == ds["counters"][:2], case
        micro = ds["counters"][2] * (gas if mode == "boundary" else 1)
        assert fz["counters"][2] == micro, case
        # the backwards in no_sync reduce nothing (stage 1's forward all-gathers the updated parameters, once)
        assert not [c for c in fz["collectives_in_no_sync"] if "reduce" in c], case


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_save_16bit_model_writes_deepspeeds_weights(runs, world):
    """The same tensors as DeepSpeed's pytorch_model.bin (bf16 parameters under bf16, the fp32 buffer), as
    model.safetensors; False and no file at stage 3 without stage3_gather_16bit_weights_on_model_save.

    Bitwise, except after no_sync at stages 0-1 with gradient_accumulation_steps 1: there the gradients are
    DeepSpeed's bitwise (every step's losses are; measured on the gradients themselves too), but DeepSpeed's Adam
    runs on its own tensors (per parameter at stage 0) and its last update rounds a few elements 1 ulp apart
    (measured: 3.7e-9 at most), so those weights are held to Adam's step bound (`tests.bounds`)."""
    tmp, _ = runs
    for case in w.CASES:
        ds, fz = both(runs, world, case)
        assert fz["save_16bit_model"] == ds["save_16bit_model"], case
        if not ds["save_16bit_model"]:
            assert not (tmp / f"fzero-{world}" / case / "model16").exists()
            continue
        theirs, ours = (weights_16bit(tmp, t, world, case) for t in ("deepspeed", "fzero"))
        assert ours.keys() == theirs.keys(), case
        assert all(ours[k].dtype == v.dtype for k, v in theirs.items()), case
        if case.startswith("nosync"):  # the last update rounds apart (see the docstring): Adam's step bound
            torch.manual_seed(0)
            assert_adam_close(ours, theirs, w.Net().state_dict(), lr=1e-2, steps=w.STEPS)
        else:
            assert all(torch.equal(ours[k], v) for k, v in theirs.items()), case
    bf16 = weights_16bit(tmp, "fzero", world, "boundary-z2-bf16")
    assert bf16["mid.weight"].dtype == torch.bfloat16 and bf16["scale"].dtype == torch.float32


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_exclude_frozen_parameters_round_trip(runs, world):
    """Saved without the frozen LayerNorm bias, loaded into a model initialised otherwise (its frozen bias 0.25):
    DeepSpeed and fzero both refuse a strict load, and with load_module_strict=False both resume with the trainable
    state from the checkpoint and the frozen bias from the live model: the next two steps' losses and the counters
    are DeepSpeed's, bitwise."""
    for case in ("frozen-z2", "frozen-z3"):
        ds, fz = both(runs, world, case)
        assert ds["strict_load"] is not None and "Missing key(s)" in ds["strict_load"]
        assert fz["strict_load"].startswith("IncompatibleCheckpointError") and "'ln.bias'" in fz["strict_load"]
        # (DeepSpeed's client state, none given, carries its checkpoint's own bookkeeping: shapes, config, ...)
        assert fz["loaded"][0] == ds["loaded"][0] == "global_step3" and fz["loaded"][1] == {}
        assert fz["resumed_losses"] == ds["resumed_losses"], case
        # the frozen bias is the new model's (0.25), not the saved run's (0): the first loss differs from the one the
        # saved run computed next
        assert fz["resumed_losses"][0] != fz["moved_losses"][0]
        # global_steps and global_samples restored; DeepSpeed leaves micro_steps the new engine's, fzero restores it
        # (its accumulation window is part of the state)
        assert fz["resumed_counters"][:2] == ds["resumed_counters"][:2], case
        assert {"latest", "zero_to_fp32.py", "global_step3"} <= set(ds["saved_files"])
        assert {"latest", "zero_to_fp32.py", "global_step3"} == set(fz["saved_files"])


def script(directory):
    """The `zero_to_fp32.py` save_checkpoint wrote into `directory`, imported from there."""
    spec = importlib.util.spec_from_file_location("checkpoint_zero_to_fp32", directory / "zero_to_fp32.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)
def test_zero_to_fp32_script_gives_deepspeeds_consolidation(runs, tmp_path):
    """`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR`, the script save_checkpoint wrote beside fzero's checkpoint,
    gives what DeepSpeed's own consolidation gives for its checkpoint of the same run: the trainable fp32 weights and
    the buffer (the frozen bias was not saved), bitwise."""
    tmp, _ = runs
    for case in ("frozen-z2", "frozen-z3"):
        ckpt = tmp / "fzero-2" / case / "ckpt"
        if case == "frozen-z3":  # as a command, in a process of its own
            done = subprocess.run([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(tmp_path / case)],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert done.returncode == 0 and "Saved the fp32 state dict" in done.stdout, done.stderr
        else:
            assert script(ckpt).main([str(ckpt), str(tmp_path / case)]) == 0
        ours = load_file(tmp_path / case / "model.safetensors")
        theirs = load_file(tmp / "deepspeed-2" / case / "fp32.safetensors")
        assert ours.keys() == theirs.keys() and "ln.bias" not in ours
        assert all(torch.equal(ours[k], v) for k, v in theirs.items()), case


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_accessors_and_refusals_as_deepspeed(runs, world):
    """loss_scale() (the configured fp16.loss_scale: 0.0, dynamic), get_batch_info(), the ZeRO accessors, the loss
    scale on the optimizer, lr_scheduler and training_dataloader being what initialize returned: DeepSpeed's values.
    step() inside no_sync and no_sync at stages 2-3 raise with DeepSpeed's words; destroy() returns None."""
    for case in w.CASES:
        ds, fz = both(runs, world, case)
        theirs, ours = ds["accessors"], fz["accessors"]
        for key in ("cur_scale", "optimizer_loss_scale"):  # the scale in use, on the optimizer object
            assert ours.pop(key) == 1.0 and theirs.pop(key) in (1.0, None), case  # (None: DeepSpeed's torch AdamW)
        assert ours == theirs, case
        assert fz["destroy"] is ds["destroy"] is None
        if "no_sync" in ds:
            stage = w.CASES[case][0]
            message = f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {stage}"
            assert message in ds["no_sync"] and message in fz["no_sync"], case
    for case in ("nosync-z0", "nosync-z1"):
        ds, fz = both(runs, world, case)
        message = "It is illegal to call Engine.step() inside no_sync context manager"
        assert message in ds["errors"]["step_in_no_sync"] and message in fz["errors"]["step_in_no_sync"]
    assert both(runs, world, "nosync-z0")[1]["accessors"]["training_dataloader_is_returned"]


# ---------------------------------------------------------------------------------------------- one process
def frozen_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model[0].bias.requires_grad_(False)
    return model


def engine_of(stage: int = 1, gas: int = 2, world: int = 1, model: nn.Module | None = None, **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    model = frozen_net() if model is None else model
    engine, *_ = deepspeed.initialize(model=model, config=cfg, mesh=fzero.SimMesh(world), printer=lambda *_: None)
    return engine


def micro_batch(i: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(i))


def test_a_boundary_the_chain_cannot_honour_is_refused_before_any_work():
    engine = engine_of(gas=2)
    with pytest.raises(ValueError, match=r"set_gradient_accumulation_boundary\(True\) for micro-batch 1 .* is 2"):
        engine.set_gradient_accumulation_boundary(True)
    assert not engine.is_gradient_accumulation_boundary()  # the refused boundary was not taken
    engine.set_gradient_accumulation_boundary(False)  # DeepSpeed's documented form: False once, then the window
    engine.backward(engine(micro_batch(0)).square().mean())
    assert engine.micro_steps == 1 and engine.global_steps == 0  # that backward was a micro-step
    # the next backward, still "not a boundary", would be the 2nd of 2: refused before it runs
    with pytest.raises(ValueError, match=r"\(False\) for micro-batch 2 of the window"):
        engine.backward(engine(micro_batch(1)).square().mean())
    assert engine.micro_steps == 1 and int(engine.state.step) == 1
    with pytest.raises(TypeError, match="expects a bool"):
        engine.set_gradient_accumulation_boundary(1)


def test_a_boundary_per_micro_batch_with_a_step_each_is_plain_accumulation():
    """The older Accelerate form (the boundary, backward and step() for every micro-batch) trains exactly as no
    boundary at all."""
    plain, told = engine_of(gas=2), engine_of(gas=2)
    for i in range(4):
        told.set_gradient_accumulation_boundary(i % 2 == 1)
        for engine in (plain, told):
            engine.backward(engine(micro_batch(i)).square().mean())
            engine.step()
    a, b = plain.module_state_dict(), told.module_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and told.micro_steps == plain.micro_steps == 4


def test_a_linear_replaced_by_deepspeeds_zero3_is_refused(monkeypatch):
    """DeepSpeed's ZeRO-3 (`memory_efficient_linear`, its default) replaces `torch.nn.functional.linear` with its own
    for the whole process: fzero's engine and core step refuse to train through it (its arithmetic is not torch's),
    naming the key that stops it; with torch's back, the same engine and step train."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    engine = engine_of(gas=1)
    model, tx, mesh = frozen_net(), fzero.zero2(fzero.adamw(1e-2)), fzero.SimMesh(1)
    state = fzero.init(model, tx, mesh)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,)).square().mean()

    step = fzero.train_step(model, loss_fn, tx, mesh)
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    with pytest.raises(RuntimeError, match=r"DeepSpeed's zero3_linear_wrap .*\"memory_efficient_linear\": false"):
        engine(micro_batch(0))
    with pytest.raises(RuntimeError, match=r"DeepSpeed's zero3_linear_wrap"):  # the core's step too
        step(state, micro_batch(0)[None])
    monkeypatch.undo()
    state, _ = step(state, micro_batch(0)[None])  # (a SimMesh batch: a row per rank)
    engine.backward(engine(micro_batch(0)).square().mean())
    engine.step()
    assert engine.global_steps == 1


def test_no_sync_refusals():
    engine = engine_of(stage=1, gas=1)
    with engine.no_sync(), pytest.raises(RuntimeError, match="reentry is unsupported"), engine.no_sync():
        pass
    assert not engine.inside_no_sync_ctxt


def test_a_model_compiled_before_initialize_trains_as_eager():
    """`model.compile(backend=...)` before initialize: the engine compiles the model's units with that backend
    instead (tests/test_compile.py has the rest); torch's "eager" backend runs the same kernels: bitwise."""
    assert engine_of().is_compiled is False
    for stage in (0, 1, 2, 3):
        losses = []
        for compiled in (False, True):
            model = frozen_net()
            if compiled:
                model.compile(backend="eager")
            engine = engine_of(stage=stage, gas=1, model=model)
            assert engine.is_compiled is compiled
            for i in range(2):
                loss = engine(micro_batch(i)).square().mean()
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], stage


def test_save_16bit_model_names_and_options(tmp_path):
    engine = engine_of(stage=1, gas=1)
    assert engine.save_16bit_model(tmp_path) is True
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # never a pickle
    weights = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in engine.module.state_dict().items())
    assert engine.save_16bit_model(tmp_path, "weights.pt", exclude_frozen_parameters=True)
    assert load_file(tmp_path / "weights.safetensors").keys() == {"0.weight", "2.weight", "2.bias"}
    assert engine.save_fp16_model(tmp_path / "sub", "w.safetensors") and (tmp_path / "sub" / "w.safetensors").exists()
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    three = engine_of(stage=3, gas=1)
    assert three.save_16bit_model(tmp_path / "z3") is False and not (tmp_path / "z3").exists()
    gathered = engine_of(stage=3, gas=1, stage3_gather_16bit_weights_on_model_save=True)
    assert gathered.save_16bit_model(tmp_path / "z3") is True
    assert gathered._zero3_consolidated_16bit_state_dict().keys() == weights.keys()


@pytest.mark.timeout(900)
def test_an_exclude_frozen_checkpoint_reshards(runs):
    """The checkpoint 2 processes saved at stage 2 without the frozen bias loads into one process at stage 3: the
    trainable weights are the checkpoint's (its consolidation), the frozen bias the live model's."""
    tmp, _ = runs
    ckpt = tmp / "fzero-2" / "frozen-z2" / "ckpt"
    torch.manual_seed(7)
    model = w.Net()
    live = model.ln.bias.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config=w.config("fzero", "frozen-z3", 1), mesh=fzero.SimMesh(1),
                                      printer=lambda *_: None)  # fmt: skip
    engine.load_checkpoint(ckpt, load_module_strict=False)
    ours, saved = engine.module_state_dict(), fzero.consolidate(ckpt)
    assert saved.keys() == ours.keys() - {"ln.bias"}
    assert all(torch.equal(ours[k], v) for k, v in saved.items()) and torch.equal(ours["ln.bias"], live)


def test_zero_to_fp32_script_options(tmp_path):
    """The script save_checkpoint writes (imported from the checkpoint directory): the consolidated weights, without
    the frozen ones under --exclude_frozen_parameters, a tag by -t, exit status 1 and a message for no checkpoint."""
    engine = engine_of(stage=1, gas=1)
    engine.backward(engine(micro_batch(0)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    command = script(tmp_path)
    full = engine.module_state_dict()
    for flags, keys in (
        ([], full.keys()),
        (["--exclude_frozen_parameters", "-t", "global_step1"], full.keys() - {"0.bias"}),
    ):
        assert command.main([str(tmp_path), str(tmp_path / "out"), *flags]) == 0
        out = load_file(tmp_path / "out" / "model.safetensors")
        assert out.keys() == keys and all(torch.equal(out[k], full[k]) for k in out)
    assert command.main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 1


def test_zero_to_fp32_functions(tmp_path):
    """`deepspeed.utils.zero_to_fp32`'s functions on what save_checkpoint wrote: the consolidated parameters in
    memory (without the frozen one on request), loaded strictly into a fresh model; lazy mode refused by name."""
    from fzero.deepspeed.utils import zero_to_fp32

    engine = engine_of(stage=2, gas=1)
    engine.backward(engine(micro_batch(0)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    full = engine.module_state_dict()
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in got)
    lean = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert lean.keys() == full.keys() - {"0.bias"}
    fresh = zero_to_fp32.load_state_dict_from_zero_checkpoint(frozen_net(), tmp_path, tag="global_step1")
    assert all(torch.equal(fresh.state_dict()[k], full[k]) for k in full)
    with pytest.raises(NotImplementedError, match="lazy_mode"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path, lazy_mode=True)
    with pytest.raises(NotImplementedError, match="deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict"):
        _ = zero_to_fp32.convert_zero_checkpoint_to_state_dict


def test_no_script_at_stage_0_as_deepspeed(tmp_path):
    engine = engine_of(stage=0, gas=1)
    engine.backward(engine(micro_batch(0)).square().mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "latest"]


def test_destroy_and_empty_partition_cache(tmp_path):
    engine = engine_of(stage=3, gas=1)
    engine(micro_batch(0))  # a micro-step in flight
    engine.empty_partition_cache()
    engine.destroy()
    with pytest.raises(RuntimeError, match="no engine"):  # the micro-step in flight was dropped
        engine.backward(torch.ones((), requires_grad=True))
    assert engine.get_batch_info() == (2, 2, 1)
    assert (engine.get_data_parallel_rank(), engine.get_data_parallel_world_size()) == (0, 1)
    assert (engine.get_model_parallel_rank(), engine.get_model_parallel_world_size()) == (0, 1)

"""DeepSpeed's `torch_autocast` block, held against DeepSpeed 0.19.8 itself (CPU accelerator, gloo) on 1 and 2
processes: an embedding + LayerNorm + Linear model under bf16 autocast at stages 0, 2 and 3, and fp16 with the
GradScaler at stage 0 (the engine's, unscaled before clipping) and stage 2 (the optimizer's). Then, in this process:
the per-parameter reduction of the core (`fzero.transforms.mixed_reduce`), the GradScaler's scale rule
(`TorchGradScale`), the nested-autocast rule, and the config's errors.

Bitwise throughout: the forward is the same autocast arithmetic on both sides, the Linear gradients are reduced in
the autocast dtype on both (their bf16/fp16 sums of two ranks round once, in gloo's low-precision sum on both), the
others in float32, and the loss scale and its inverse are powers of two.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fzero
import fzero.deepspeed as deepspeed
from fzero.config import ConfigError, UnsupportedConfigError, parse_config
from fzero.deepspeed.runtime import torch_autocast as ta
from fzero.state.grad_scale import TorchGradScale
from fzero.state.precision import Policy
from fzero.transforms.base import Flow
from fzero.transforms.mixed_reduce import mixed_reduce_scatter
from tests import autocast_worker as w
from tests.spawn import spawn

WORLDS = (1, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autocast")
    # both worlds at once (3 processes): most of a run is each process's imports and DeepSpeed's first initialize,
    # which leave a core idle when run one world after the other
    with ThreadPoolExecutor(len(WORLDS)) as pool:
        for done in [pool.submit(spawn, w.run, (world, str(tmp)), world) for world in WORLDS]:
            done.result()
    trainers = ("deepspeed", "fzero")
    return tmp, {(t, n): json.loads((tmp / f"{t}-{n}.json").read_text()) for t in trainers for n in WORLDS}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_training_is_deepspeeds_bitwise(runs, world):
    """Every step's global loss, the forward's output dtype, the comm_dtype tags (`deepspeed.runtime.torch_autocast.
    get_comm_dtype`) and the final fp32 weights are DeepSpeed's, bitwise, for every case."""
    tmp, results = runs
    for case in w.CASES:
        ds, fz = results["deepspeed", world][case], results["fzero", world][case]
        assert fz["losses"] == ds["losses"], case
        assert fz["out_dtypes"] == ds["out_dtypes"], case
        assert fz["tags"] == ds["tags"], case
        theirs = load_file(tmp / f"deepspeed-{world}" / f"{case}.safetensors")
        ours = load_file(tmp / f"fzero-{world}" / f"{case}.safetensors")
        assert ours.keys() == theirs.keys(), case
        assert all(torch.equal(ours[k], v) for k, v in theirs.items()), case
    tags = results["fzero", world]["z2-bf16"]["tags"]
    assert tags == {"emb.weight": "torch.float32", "ln.weight": "torch.float32", "ln.bias": "torch.float32",
                    "mid.weight": "torch.bfloat16", "mid.bias": "torch.bfloat16", "head.weight": "torch.bfloat16",
                    "head.bias": "torch.bfloat16"}  # fmt: skip
    assert results["fzero", world]["z0-fp16"]["out_dtypes"] == ["torch.float16"] * w.STEPS


@pytest.mark.timeout(300)
def test_the_low_precision_reduction_is_what_differs(runs):
    """On 2 processes stage 2 reduces the Linear gradients in bf16 and stage 0 everything in fp32 (DeepSpeed's
    `communication_data_type`): the runs part at the third step, as DeepSpeed's do. On one process there is no sum:
    every stage is the same."""
    _, results = runs
    for trainer in ("deepspeed", "fzero"):
        one, two = results[trainer, 1], results[trainer, 2]
        assert one["z0-bf16"]["losses"] == one["z2-bf16"]["losses"] == one["z3-bf16"]["losses"]
        assert two["z2-bf16"]["losses"] == two["z3-bf16"]["losses"]
        assert two["z0-bf16"]["losses"][:2] == two["z2-bf16"]["losses"][:2]
        assert two["z0-bf16"]["losses"][2] != two["z2-bf16"]["losses"][2]


# ---------------------------------------------------------------------------------------------- one process
def test_mixed_reduce_scatter_reduces_each_group_in_its_dtype():
    """The core transform on a SimMesh of 2 (the policy's `reduce_overrides`): the named parameters' elements are the
    bf16 mean of the ranks' bf16 values, the others the float32 mean, each rank holding its shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    mesh = fzero.SimMesh(2)
    low = {"0.weight": torch.bfloat16, "2.bias": torch.bfloat16}
    tx = fzero.chain(mixed_reduce_scatter(None, low), fzero.gather())
    state = fzero.init(model, tx, mesh)
    layout = state.layout
    grads = torch.randn(2, layout.numel)
    flow = Flow(grads=grads, params=None, compute=None)
    ctx = fzero.Context(mesh, layout)
    out, _ = tx.children[0][1].update(flow, None, ctx)
    mean32 = (grads[0] + grads[1]) / 2
    mean16 = ((grads[0].bfloat16() / 2) + (grads[1].bfloat16() / 2)).float()
    expect = mean32.clone()
    for leaf in layout.leaves:
        if leaf.name in low:
            expect[leaf.offset : leaf.offset + leaf.numel] = mean16[leaf.offset : leaf.offset + leaf.numel]
    from fzero.layout.flat import shard

    assert torch.equal(out.grads, shard(layout, expect))
    assert Policy(reduce_overrides=tuple(low.items())).reduce_overrides == tuple(low.items())
    with pytest.raises(TypeError, match="reduce_overrides"):
        Policy(reduce_overrides=(("x", torch.int8),))


def test_torch_grad_scale_follows_torch_amp_update():
    """`TorchGradScale.adjust` against `torch._amp_update_scale_` (GradScaler.update's kernel) over a sequence with
    overflows and growths; with `update_on_overflow=False` an overflow changes nothing (DeepSpeed's ZeRO use)."""
    pattern = [True, True, True, False, True, True, True, True, False, False, True, True, True]
    ours = TorchGradScale.create(growth_interval=3)
    scale, tracker = torch.tensor([2.0**16]), torch.tensor([0], dtype=torch.int32)
    for finite in pattern:
        torch._amp_update_scale_(scale, tracker, torch.tensor([0.0 if finite else 1.0]), 2.0, 0.5, 3)
        ours = ours.adjust(finite)
        assert ours.loss_scale == scale.item() and ours.cur_iter - ours.last_overflow_iter - 1 == tracker.item()
    frozen = TorchGradScale.create(update_on_overflow=False)
    assert frozen.adjust(False) is frozen


def model_and_config(**block):
    torch.manual_seed(0)
    model = w.Net()
    cfg = w.config("z2-bf16", 1)
    cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", **block}
    return model, cfg


def test_nested_autocast_rule_and_shell_functions():
    """DeepSpeed's rule: the config's autocast inside the engine whatever is outside; with the block off a CPU
    autocast outside is not seen (DeepSpeed asks `torch.is_autocast_enabled()`, CUDA's) and stays on. The shell's
    functions read the tags `initialize` set."""
    model, cfg = model_and_config(lower_precision_safe_modules=["torch.nn.Embedding"])
    engine, *_ = deepspeed.initialize(model=model, config=cfg, printer=lambda *_: None)
    x = torch.randint(0, 13, (4, 5))
    with torch.no_grad():
        assert engine(x).dtype == torch.bfloat16  # (the head is no longer a safe module, autocast still casts it)
        with torch.autocast("cpu", dtype=torch.float16):
            assert engine(x).dtype == torch.bfloat16
    assert ta.has_comm_dtype(model.emb.weight) and not ta.has_comm_dtype(model.head.weight)
    assert ta.get_all_comm_dtypes(model.parameters()) == {torch.bfloat16, torch.float32}
    assert ta.sort_dtypes([torch.float32, torch.bfloat16]) == [torch.bfloat16, torch.float32]
    assert ta.is_autocast_initialized() and ta.get_autocast_dtype() == torch.bfloat16
    assert engine.torch_autocast_lower_precision_safe_modules() == ["torch.nn.Embedding"]
    assert dict(engine._policy.reduce_overrides) == {"emb.weight": torch.bfloat16}
    model, cfg = model_and_config(enabled=False)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, printer=lambda *_: None)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert engine(x).dtype == torch.bfloat16
        with ta.autocast_if_enabled(engine):
            assert engine(x).dtype == torch.bfloat16
    assert not engine.torch_autocast_enabled()


@pytest.mark.parametrize(
    ("block", "top", "error", "words"),
    [
        ({"dtype": "bf17"}, {}, ConfigError, "torch_autocast.dtype: Invalid dtype for torch autocast: bf17"),
        ({"dtype": "fp32"}, {}, UnsupportedConfigError, "torch_autocast.dtype: 'fp32' is not supported: not a lower"),
        ({"dtype": None}, {}, ConfigError, "torch_autocast.enabled: needs torch_autocast.dtype"),
        ({"lower_precision_safe_modules": "torch.nn.Linear"}, {}, ConfigError, "lower_precision_safe_modules"),
        ({}, {"fp16": {"enabled": True}}, UnsupportedConfigError, "fp16.enabled: is not supported"),
        ({"dtype": "half"}, {"bf16": {"enabled": True}}, UnsupportedConfigError, "torch_autocast.dtype: float16"),
        ({"dtype": "half"}, {"gradient_clipping": 1.0}, UnsupportedConfigError, "gradient_clipping: 1 is not"),
        ({}, {"prescale_gradients": True}, UnsupportedConfigError, "prescale_gradients: is not supported"),
        ({}, {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, ConfigError,
         "Cannot enable both torch autocast and zero quantized weights"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(block, top, error, words):
    _, cfg = model_and_config(**block)
    cfg.update(top)
    with pytest.raises(error) as info:
        parse_config(cfg, world=1)
    assert words in str(info.value)


def test_module_paths_resolve_without_importing():
    """An unknown class or a module not imported is an error naming the entry; communication_data_type is ignored at
    ZeRO stages with a warning, as DeepSpeed ignores it."""
    model, cfg = model_and_config(lower_precision_safe_modules=["torch.nn.Linear", "not_a_module_xyz.Layer"])
    with pytest.raises(ConfigError, match=r"lower_precision_safe_modules\[1\]: Failed to import .* not imported"):
        deepspeed.initialize(model=model, config=cfg, printer=lambda *_: None)
    model, cfg = model_and_config(lower_precision_safe_modules=["torch.nn.NoSuchLayer"])
    with pytest.raises(ConfigError, match=r"lower_precision_safe_modules\[0\].*no torch.nn.Module class"):
        deepspeed.initialize(model=model, config=cfg, printer=lambda *_: None)
    _, cfg = model_and_config()
    cfg["communication_data_type"] = "fp32"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parse_config(cfg, world=1)
    assert any("communication_data_type is ignored with torch_autocast" in str(x.message) for x in seen)

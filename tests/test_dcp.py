"""fzero <-> PyTorch Distributed Checkpoint (DCP) and FSDP2, both ways (issue 51).

One spawn of 2 gloo processes (`tests/dcp_worker.py`) runs real FSDP2 (`fully_shard` on each block and the root,
torch.optim.AdamW) and fzero's engine at stage 3 through DCP checkpoints in both directions; the other world sizes
(fzero at 3 on a `SimMesh`, FSDP2 at 1 on a group of one rank) and every refusal are checked here, in-process.

Where the arithmetic is the same the results must be bitwise: the state right after an import or an export
(parameters, moments, step), and the continuation at world 2 (FSDP2 and fzero's stage 3 perform the same
operations: the forward and backward on each rank's 6 samples with the same kernels on 64-byte aligned parameters;
gradients averaged over 2 ranks as `(a + b) / 2` by a reduce-scatter; torch's single-tensor AdamW, whose op sequence
fzero's `adamw` repeats: docs/equivalence.md). At another world size each rank averages another number of samples:
the parameters are then held to Adam's step bound (`tests/bounds.py`, kind 3: `adam_drift`, and the detection
threshold `tracks`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.func import functional_call

import fzero
from fzero.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from fzero.interop.dcp import export_dcp, import_dcp
from fzero.interop.dcp_files import read_metadata, single_process
from fzero.interop.ds_files import UnsafeCheckpointError
from tests import bounds
from tests import dcp_worker as w
from tests.spawn import spawn

ADAM = "tx_state/shard_update/"
# A wrong import or export (a lost moment, step count or learning rate) moves a loss by about lr (1e-2) per step;
# a continuation in other arithmetic (another world size: other per-rank means) moved it by at most 6.3e-8 here
# (relative). The threshold between them is a detection threshold, not a rounding bound: the parameters carry the
# derived bound (`bounds.adam_check`: at most 3.0e-8 apart here, against 0.060).
LOSS_THRESHOLD = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    spawn(w.run, (2, str(tmp)), 2)
    return tmp, json.loads((tmp / "results.json").read_text())


def tensors(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(tmp / f"{name}.safetensors")


def part(saved: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """`kind/name` entries of a worker's file, by name (`model`, `exp_avg`, `exp_avg_sq`, `step`)."""
    return {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(kind + "/")}


def floats(hexes: list[str]) -> list[float]:
    return [float.fromhex(h) for h in hexes]


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def checkpoint_state(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """An fzero checkpoint as the worker's files name things: model tensors, moments by name, the step."""
    with Checkpoint(path) as ckpt:
        aliases = {alias for alias, _ in ckpt.layout.aliases}  # (torch keeps a tied weight's state once)
        out = {f: {n: t for n, t in ckpt.named(ADAM + f) if n not in aliases} for f in ("exp_avg", "exp_avg_sq")}
        count = ckpt.value(ADAM + "count")
    out["model"] = fzero.consolidate(path)
    out["step"] = {n: count for n in out["exp_avg"]}
    return out


def trainable(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in d.items() if k != "scale"}


# --------------------------------------------------------------------------------------- FSDP2 -> fzero
@pytest.mark.timeout(300)
def test_an_fsdp2_checkpoint_imports_bitwise_and_fzero_continues_it_as_fsdp2_does(runs):
    """FSDP2 (world 2) saved DCP after 3 steps: the imported fzero checkpoint holds its parameters, buffer, moments
    and step bitwise; fzero at stage 3 on 2 gloo ranks continues steps 4-6 as FSDP2 did, bitwise (losses and the
    final parameters)."""
    tmp, r = runs
    saved, ckpt = tensors(tmp, "fsdp_saved"), checkpoint_state(tmp / "fz_from_fsdp" / "global_step3")
    assert_same(ckpt["model"], part(saved, "model"))
    for f in ("exp_avg", "exp_avg_sq"):
        assert_same(ckpt[f], part(saved, f))
    assert all(float(s) == w.SAVE_AT for s in part(saved, "step").values())
    assert all(int(c) == w.SAVE_AT for c in ckpt["step"].values())
    assert r["fzero_from_fsdp"] == r["fsdp"][w.SAVE_AT :]
    assert_same(tensors(tmp, "fzero_from_fsdp_final"), part(tensors(tmp, "fsdp_final"), "model"))
    # the two runs from the same start agree all along (so the comparison is not vacuous: they train)
    assert r["fzero"] == r["fsdp"] and len(set(r["fsdp"])) == len(r["fsdp"])


@pytest.mark.timeout(300)
def test_the_imported_checkpoint_continues_at_world_3(runs):
    """fzero's core API, stage 3 on `SimMesh(3)`: each rank averages 4 samples where FSDP2's averaged 6, so the
    parameters after 3 more steps are held to Adam's step bound and the detection threshold (kind 3)."""
    tmp, r = runs
    model = w.net(5)  # another initialisation: the checkpoint replaces it
    tx, mesh = fzero.zero3(fzero.adamw(w.LR)), fzero.SimMesh(3)
    state, extra = fzero.load(tmp / "fz_from_fsdp", fzero.init(model, tx, mesh))
    assert extra["step"] == w.SAVE_AT
    step = fzero.train_step(model, lambda p, b: w.loss_fn(functional_call(model, p, (b[0],)), b[1]), tx, mesh)
    losses = []
    for s in range(w.SAVE_AT + 1, w.SAVE_AT + w.MORE + 1):
        xs, ys = zip(*(w.batch(s, rank, 3) for rank in range(3)), strict=True)
        state, metrics = step(state, (torch.stack(xs), torch.stack(ys)))
        losses.append(float(metrics["loss"]))
    start = trainable(part(tensors(tmp, "fsdp_saved"), "model"))
    ref = trainable(part(tensors(tmp, "fsdp_final"), "model"))
    check = bounds.adam_check(trainable(fzero.state_dict(state)), ref, start, w.LR, w.MORE)
    bounds.assert_within(check)
    for got, want in zip(losses, floats(r["fsdp"][w.SAVE_AT :]), strict=True):
        assert abs(got - want) <= LOSS_THRESHOLD * abs(want), (losses, r["fsdp"])


@pytest.mark.timeout(300)
def test_without_the_model_the_same_checkpoint_is_built(runs, tmp_path):
    """The model rebuilt from the DCP's names and shapes (parameters with optimizer state, the buffer) makes the
    same checkpoint as the module itself."""
    tmp, _ = runs
    path = import_dcp(tmp / "fsdp_dcp", tmp_path / "fz")
    ours, theirs = checkpoint_state(path), checkpoint_state(tmp / "fz_from_fsdp" / "global_step3")
    for key, value in theirs.items():
        assert_same(ours[key], value)
    with Checkpoint(path) as ckpt:
        client = ckpt.manifest.user_state["client_state"]
    assert client == {"from_dcp": {"layout": "PyTorch DCP recipe"}}


# --------------------------------------------------------------------------------------- fzero -> FSDP2
@pytest.mark.timeout(300)
def test_an_fzero_checkpoint_exports_bitwise_and_fsdp2_continues_it(runs):
    """fzero (stage 3, world 2) saved after 3 steps; `export_dcp` wrote DCP; FSDP2 loaded it at world 2 and at
    world 1 with get_state_dict, dcp.load and set_state_dict only, into optimizers built with other hyper-parameters:
    parameters, buffer, moments, step and hyper-parameters are the checkpoint's bitwise. At world 2 FSDP2 continues
    as fzero did, bitwise; at world 1 (all 12 samples on one rank) within Adam's step bound."""
    tmp, r = runs
    ckpt = checkpoint_state(tmp / "fz_run" / "global_step3")
    for loaded in ("fsdp_loaded", "fsdp1_loaded"):
        saved = tensors(tmp, loaded)
        assert_same(part(saved, "model"), ckpt["model"])
        for f in ("exp_avg", "exp_avg_sq"):
            assert_same(part(saved, f), ckpt[f])
        assert all(s.dtype == torch.float32 and float(s) == w.SAVE_AT for s in part(saved, "step").values())
    group = {"lr": w.LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "decoupled_weight_decay": True}
    assert r["fsdp_loaded_groups"] == r["fsdp1_loaded_groups"] == [group]
    assert r["fsdp_from_fzero"] == r["fzero"][w.SAVE_AT :]
    final = tensors(tmp, "fzero_final")
    assert_same(part(tensors(tmp, "fsdp_from_fzero_final"), "model"), final)
    check = bounds.adam_check(
        trainable(part(tensors(tmp, "fsdp1_from_fzero_final"), "model")),
        trainable(final),
        trainable(ckpt["model"]),
        w.LR,
        w.MORE,
    )
    bounds.assert_within(check)
    for got, want in zip(floats(r["fsdp1_from_fzero"]), floats(r["fzero"][w.SAVE_AT :]), strict=True):
        assert abs(got - want) <= LOSS_THRESHOLD * abs(want), (r["fsdp1_from_fzero"], r["fzero"])


# --------------------------------------------------------------------------------------- other layouts, in-process
def trained(steps: int = 2, **hypers) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`w.Net` (no FSDP) after `steps` steps of torch's AdamW: a state to save in DCP's layouts."""
    model = w.net(7)
    opt = torch.optim.AdamW(model.parameters(), **{"lr": w.LR, **hypers})
    for s in range(1, steps + 1):
        x, y = w.batch(s, 0, 1)
        w.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(tree: dict, path: Path) -> Path:
    with single_process():
        dcp.save(tree, checkpoint_id=path, no_dist=True)
    return path


def assert_imported(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The fzero checkpoint `path` holds `model`'s tensors and `opt`'s state bitwise."""
    got = checkpoint_state(path)
    assert_same(got["model"], model.state_dict())
    names = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for f in ("exp_avg", "exp_avg_sq"):
        assert_same(got[f], {n: opt.state[p][f] for n, p in names.items()})
    assert {int(c) for c in got["step"].values()} == {int(s["step"]) for s in opt.state.values()}


def test_torchtitan_and_app_wrapped_layouts_import(tmp_path):
    """torchtitan's layout (model keys at the top, `optimizer` flattened by parameter name, `lr_scheduler`,
    `train_state`) and the DCP tutorial's `app` wrapper import as the recipe's does; the scheduler's and train state's
    plain values are kept in the client state."""
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    _, flat = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    titan = {**msd, "optimizer": flat, "lr_scheduler": {"last_epoch": 2},
             "train_state": {"step": 2, "ntokens_seen": 96}, "dataloader": {"state": b"never read"}}  # fmt: skip
    path = import_dcp(save(titan, tmp_path / "titan"), tmp_path / "fz-titan", w.Net())
    assert_imported(path, model, opt)
    with Checkpoint(path) as ckpt:
        client = ckpt.manifest.user_state["client_state"]["from_dcp"]
    assert client == {"layout": "torchtitan", "lr_scheduler.last_epoch": 2, "train_state.step": 2,
                      "train_state.ntokens_seen": 96}  # fmt: skip
    app = save({"app": {"model": msd, "optim": osd}}, tmp_path / "app")
    assert_imported(import_dcp(app, tmp_path / "fz-app"), model, opt)  # (and without the model)


def test_the_export_loads_with_flattened_optimizer_state_dicts_too(tmp_path):
    """The export also writes the param groups by parameter name: `flatten_optimizer_state_dict=True` (torchtitan's
    optimizer container does the same) loads it, into an optimizer with two groups of its own."""
    model, opt = trained()
    path = import_dcp(save(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), tmp_path / "a"),
                      tmp_path / "fz", w.Net())  # fmt: skip
    out = export_dcp(path, tmp_path / "out")
    other = w.net(9)
    decay = [p for n, p in other.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in other.named_parameters() if not n.endswith("weight")]
    opt2 = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest}], lr=0.3)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(other, opt2, options=options)
    tree = {"model": msd, "optim": osd}
    with single_process():
        dcp.load(tree, checkpoint_id=out, no_dist=True)
    set_state_dict(other, opt2, model_state_dict=tree["model"], optim_state_dict=tree["optim"], options=options)
    assert_same(other.state_dict(), model.state_dict())
    names = dict(model.named_parameters())
    for n, p in other.named_parameters():
        for f in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state[p][f], opt.state[names[n]][f]), (n, f)
    assert [(g["lr"], g["weight_decay"]) for g in opt2.param_groups] == [(w.LR, 0.01)] * 2


class Odd(nn.Module):
    """A frozen bias, a weight tied to another, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.emb.bias.requires_grad_(False)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.mid.weight
        self.norm = nn.Module()
        self.norm.register_buffer("mask", torch.ones(8), persistent=False)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(x)))) * self.scale * self.norm.mask


def test_frozen_tied_and_non_persistent_come_across_with_the_model(tmp_path):
    """With the module given, a frozen parameter stays frozen, a tied weight tied, a non-persistent buffer in the
    layout; an fzero engine of that module loads the import, and the export loads back into torch bitwise (the
    tied weight under both names, the moments under torch's first name)."""
    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=w.LR)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    source = save(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), tmp_path / "dcp")
    path = import_dcp(source, tmp_path / "fz", Odd())
    assert_imported(path, model, opt)
    cfg = {"train_micro_batch_size_per_gpu": 5, "optimizer": {"type": "AdamW", "params": {"lr": w.LR}}}
    eng, *_ = fzero.initialize(model=Odd(), config=cfg, mesh=fzero.SimMesh(1), printer=lambda *a: None)
    eng.load_checkpoint(tmp_path / "fz")
    layout = eng.state.layout
    assert layout.aliases == (("out.weight", "mid.weight"),)
    assert [leaf.name for leaf in layout.frozen_layout.leaves] == ["emb.bias"]
    other = Odd()
    opt2 = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=0.5)
    msd, osd = get_state_dict(other, opt2)
    tree = {"model": msd, "optim": osd}
    with single_process():
        dcp.load(tree, checkpoint_id=export_dcp(path, tmp_path / "back"), no_dist=True)
    set_state_dict(other, opt2, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    assert_same(other.state_dict(), model.state_dict())
    assert other.out.weight is other.mid.weight and opt2.param_groups[0]["lr"] == w.LR
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"], strict=True):
        assert all(torch.equal(opt.state[p][f], opt2.state[q][f]) for f in ("step", "exp_avg", "exp_avg_sq"))


def test_torch_adam_with_l2_decay_and_amsgrad_continues_bitwise_at_world_1(tmp_path):
    """torch.optim.Adam (L2 weight decay, `decoupled_weight_decay=False`) with AMSGrad: imported, fzero (one rank,
    torch's arithmetic) continues as torch does, bitwise (docs/equivalence.md: any stage vs torch at world 1); the
    export of fzero's continuation holds torch's continued state bitwise, `max_exp_avg_sq` included."""
    model = w.net(7)
    opt = torch.optim.Adam(model.parameters(), lr=w.LR, weight_decay=0.1, amsgrad=True)

    def steps(forward, backward, update, span: range) -> list[float]:
        out = []
        for s in span:
            x, y = w.batch(s, 0, 1)
            loss = w.loss_fn(forward(x), y)
            backward(loss)
            update()
            out.append(loss.item())
        return out

    def torch_backward(loss):
        opt.zero_grad()
        loss.backward()

    steps(model, torch_backward, opt.step, range(1, 3))
    import_dcp(save(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), tmp_path / "a"),
               tmp_path / "fz", w.Net())  # fmt: skip
    cfg = {"train_micro_batch_size_per_gpu": w.GLOBAL, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": w.LR, "weight_decay": 0.1, "adam_w_mode": False,
                                                    "torch_adam": True, "amsgrad": True}}}  # fmt: skip
    eng, *_ = fzero.initialize(model=w.net(3), config=cfg, mesh=fzero.SimMesh(1), printer=lambda *a: None)
    eng.load_checkpoint(tmp_path / "fz")
    ours = steps(eng, eng.backward, eng.step, range(3, 5))
    assert ours == steps(model, torch_backward, opt.step, range(3, 5))
    eng.save_checkpoint(tmp_path / "fz", tag="after")
    back = export_dcp(tmp_path / "fz", tmp_path / "back", tag="after")
    assert_imported(import_dcp(back, tmp_path / "fz2", w.Net()), model, opt)
    with Checkpoint(tmp_path / "fz2") as ckpt:
        maxima = dict(ckpt.named(ADAM + "max_exp_avg_sq"))
    names = dict(model.named_parameters())
    assert_same(maxima, {n: opt.state[p]["max_exp_avg_sq"] for n, p in names.items()})


# --------------------------------------------------------------------------------------- refused, named
class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_refusals_name_the_key_and_write_nothing(tmp_path):
    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    good = save({"model": msd, "optim": osd}, tmp_path / "good")
    out = tmp_path / "out"

    def refused(error, match, source=good, model=None, **kwargs):
        with pytest.raises(error, match=match):
            import_dcp(source, out, model, **kwargs)
        assert not out.exists()  # nothing written

    class Wider(w.Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(w.WIDTH, 5)

    class Extra(w.Net):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    class Fewer(w.Net):
        def __init__(self) -> None:
            super().__init__()
            del self.head
            self.head = nn.Identity()

    refused(IncompatibleCheckpointError, r"key 'model\.head\.weight' has shape \(4, 16\), the model's", model=Wider())
    refused(IncompatibleCheckpointError, r"missing key 'model\.extra\.weight'", model=Extra())
    refused(IncompatibleCheckpointError, r"extra key 'model\.head\.weight'", model=Fewer())
    # another optimizer's state
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(w.batch(1, 0, 1)[0]).sum().backward()
    sgd.step()
    refused(IncompatibleCheckpointError, r"optim\.state\.blocks\.0\.weight has momentum_buffer: only torch Adam/AdamW",
            save(dict(zip(("model", "optim"), get_state_dict(model, sgd), strict=True)), tmp_path / "sgd"))  # fmt: skip
    # steps that differ, a missing moment
    osd["state"]["head.bias"]["step"] = torch.tensor(1.0)
    refused(IncompatibleCheckpointError, r"'blocks\.0\.weight' and 'head\.bias' have taken 2 and 1 steps",
            save({"model": msd, "optim": osd}, tmp_path / "steps"))  # fmt: skip
    del osd["state"]["head.bias"]["exp_avg_sq"]
    refused(IncompatibleCheckpointError, r"optim\.state\.head\.bias has exp_avg, step",
            save({"model": msd, "optim": osd}, tmp_path / "moment"))  # fmt: skip
    # not a DCP directory: an fzero checkpoint, nothing
    fz = import_dcp(good, tmp_path / "fz")
    refused(CheckpointNotFoundError, "not a PyTorch DCP checkpoint: no .metadata file .it is an fzero checkpoint", fz)
    refused(CheckpointNotFoundError, "no such directory", tmp_path / "nothing")
    # a damaged and a crafted metadata file: refused, and nothing in it runs
    bad = shutil.copytree(good, tmp_path / "bad")
    data = (good / ".metadata").read_bytes()
    (bad / ".metadata").write_bytes(data[: len(data) // 2])
    refused(CorruptCheckpointError, r"\.metadata: unreadable DCP metadata", bad)
    marker = tmp_path / "executed"
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    refused(UnsafeCheckpointError, r"needs the Python global posix\.system", bad)
    assert not marker.exists()
    msd, osd = get_state_dict(*trained())  # a value that would run code when unpickled
    osd["param_groups"][0]["betas"] = _Payload(marker)
    refused(UnsafeCheckpointError, r"value 'optim\.param_groups\.0\.betas' needs the Python global posix\.system",
            save({"model": msd, "optim": osd}, tmp_path / "payload"))  # fmt: skip
    assert not marker.exists()
    metadata = read_metadata(good)  # a data file out of the directory
    next(iter(metadata.storage_data.values())).relative_path = "../__0_0.distcp"
    (bad / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(CorruptCheckpointError, r"names the data file '\.\./__0_0\.distcp'", bad)


def test_export_refusals(tmp_path):
    model = w.net(0)
    out = tmp_path / "out"

    def refused(error, match, source, **kwargs):
        with pytest.raises(error, match=match):
            export_dcp(source, out, **kwargs)
        assert not out.exists()

    def saved(tx, name: str) -> Path:
        return fzero.save(fzero.init(model, tx, fzero.SimMesh(2)), tmp_path / name)

    plain = saved(fzero.zero2(fzero.adamw(w.LR)), "plain")
    refused(IncompatibleCheckpointError, r"records no optimizer hyper-parameters .* pass hypers=", plain)
    refused(IncompatibleCheckpointError, r"no Adam/AdamW optimizer state .* tx_state/shard_update/count",
            saved(fzero.zero2(fzero.sgd(0.1, momentum=0.9)), "sgd"), hypers={"lr": 0.1})  # fmt: skip
    refused(IncompatibleCheckpointError, r"'blocks\.0\.weight' is in no group", plain,
            hypers=[{"params": ["head.weight"], "lr": 0.1}])  # fmt: skip
    # inside an accumulation window: DCP has no place for the partial gradients
    tx = fzero.zero2(fzero.adamw(w.LR), accumulate=2)
    step = fzero.train_step(model, lambda p, b: w.loss_fn(functional_call(model, p, (b[0],)), b[1]), tx,
                            fzero.SimMesh(2))  # fmt: skip
    xs, ys = zip(*(w.batch(1, r, 2) for r in range(2)), strict=True)
    state, _ = step(fzero.init(model, tx, fzero.SimMesh(2)), (torch.stack(xs), torch.stack(ys)))
    refused(IncompatibleCheckpointError, r"1 micro-step\(s\) into a gradient accumulation window",
            fzero.save(state, tmp_path / "window"), hypers={"lr": w.LR})  # fmt: skip
    refused(CheckpointNotFoundError, "no such checkpoint directory", tmp_path / "nothing", hypers={"lr": w.LR})
    # a DCP directory is not an fzero checkpoint: the message says which it is
    model_, opt_ = trained()
    source = save(dict(zip(("model", "optim"), get_state_dict(model_, opt_), strict=True)), tmp_path / "dcp")
    refused(CheckpointNotFoundError, "it is a PyTorch DCP checkpoint: see import_dcp", source, hypers={"lr": w.LR})
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export_dcp(plain, out, hypers={"lr": w.LR})
    assert sorted(os.listdir(out)) == ["x"]


# --------------------------------------------------------------------------------------- the commands
def test_the_commands(tmp_path, capsys):
    """`fzero import-dcp` and `fzero export-dcp` (the command modules, as `fzero.cli` runs them)."""
    import argparse

    from fzero.commands import export_dcp as export_cmd
    from fzero.commands import import_dcp as import_cmd

    def run(module, argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args(argv)
        if hasattr(module, "check_arguments"):
            module.check_arguments(args, parser)
        return module.run(args)

    model, opt = trained()
    source = save(dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True)), tmp_path / "dcp")
    assert run(import_cmd, [str(source), str(tmp_path / "fz"), "--tag", "imported"]) == 0
    assert "imported: imported from" in capsys.readouterr().out
    assert_imported(tmp_path / "fz" / "imported", model, opt)
    assert run(export_cmd, [str(tmp_path / "fz"), str(tmp_path / "back")]) == 0
    assert "back: exported from" in capsys.readouterr().out
    assert run(import_cmd, [str(tmp_path / "back"), str(tmp_path / "fz2")]) == 0
    assert_imported(tmp_path / "fz2" / "global_step2", model, opt)  # the round trip is bitwise
    assert run(import_cmd, [str(tmp_path / "nothing"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fzero import-dcp: error:") and "no such directory" in err
    plain = fzero.save(fzero.init(w.net(0), fzero.zero1(fzero.adamw(w.LR)), fzero.SimMesh(1)), tmp_path / "plain")
    assert run(export_cmd, [str(plain), str(tmp_path / "o")]) == 1
    assert "fzero export-dcp: error:" in capsys.readouterr().err
    assert run(export_cmd, [str(plain), str(tmp_path / "o"), "--lr", "0.01", "--weight-decay", "0.01"]) == 0

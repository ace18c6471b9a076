"""The DeepSpeed documentation's seed example, and the engine-vs-`train_step` cases, shared by the single-process
tests and the 2-process gloo worker (`run`)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import lm_batches, mlp, regression_batches, tiny_gpt


def seed_example(deepspeed, steps: int = 8, retain_graph: bool = False):
    """DeepSpeed's documented loop, unchanged but for `deepspeed` being `fzero`. With `retain_graph`, the
    double-backward variant: `backward(loss, retain_graph=True)` then `backward(loss)` before `step()`. The data
    are seeded (per rank) so that runs can be compared."""
    torch.manual_seed(1234)
    model = torch.nn.Linear(1024, 10)
    ds_config = {
        "train_batch_size": 32,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    }
    model_engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    criterion = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(4321 + model_engine.global_rank)
    returned = []
    for _ in range(steps):
        mb = model_engine.train_micro_batch_size_per_gpu()
        inputs = torch.randn(mb, 1024, generator=gen).to(model_engine.device, torch.half)
        labels = torch.randint(0, 10, (mb,), generator=gen).to(model_engine.device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        if retain_graph:
            model_engine.backward(loss, retain_graph=True)
            returned.append(model_engine.backward(loss))
        else:
            returned.append(model_engine.backward(loss))
        model_engine.step()
    return model_engine, returned


def case_config(stage: int, precision: str, gas: int, micro: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def compare_with_train_step(
    stage: int,
    precision: str,
    gas: int,
    model_kind: str,
    mesh=None,
    steps: int = 3,
    device: str = "cpu",
    config: dict | None = None,
) -> dict:
    """Train the same model on the same data with `fzero.initialize` + the DeepSpeed loop and with
    `fzero.train_step` under the preset the config names (on `device`, with `config`'s keys over the case's);
    returns which parameters differ (bitwise)."""
    world = 1 if mesh is None else mesh.world
    rank = 0 if mesh is None else int(mesh.rank)
    model = (mlp([6, 9, 4], 3) if model_kind == "mlp" else tiny_gpt(3)).to(device)
    reference = copy.deepcopy(model)
    policy = fzero.get_policy(None if precision == "fp32" else precision)
    if model_kind == "mlp":
        batches = regression_batches(model, world, gas, 3, steps, 11)
    else:
        batches = lm_batches(model, world, gas, 3, steps, 11)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]

    def criterion(out, y):
        if model_kind == "mlp":
            return F.mse_loss(out.float(), y)
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())

    def loss_fn(params, batch):
        out = torch.func.functional_call(reference, params, (policy.cast_to_compute(batch["x"]),))
        return criterion(out, batch["y"])

    cfg = {**case_config(stage, precision, gas, 3), **(config or {})}
    engine, *_ = fzero.initialize(model=model, config=cfg, mesh=mesh)
    preset = getattr(fzero, f"zero{stage}")
    # the engine runs the config's AdamW fused: the native kernel on the CPU, torch's on a GPU
    tx = preset(fzero.adamw(1e-2, weight_decay=0.01, fused=True), accumulate=gas, precision=policy, clip=1.0)
    fmesh = fzero.SimMesh(1) if mesh is None else mesh
    state = fzero.init(reference, tx, fmesh)
    step = fzero.train_step(reference, loss_fn, tx, fmesh)
    for batch in batches:
        mine = {k: v[rank] for k, v in batch.items()}
        state, _ = step(state, batch if mesh is None else mine)
        out = engine(policy.cast_to_compute(mine["x"]))
        engine.backward(criterion(out, mine["y"]))
        engine.step()
    want = fzero.state_dict(state, None if mesh is None else fmesh)
    got = engine.module_state_dict()
    diff = {
        k: float((want[k].double() - got[k].double()).abs().max()) for k in want if not torch.equal(want[k], got[k])
    }
    # sharded parameters (stage 3, world > 1) leave the module's parameters empty, as DeepSpeed does
    empty = all(p.numel() == 0 for p in engine.module.parameters())
    return {"differ": diff, "global_steps": engine.global_steps, "mesh": repr(engine.mesh), "module_empty": empty}


DIST_CASES = [(stage, precision, kind) for stage in (0, 1, 2, 3) for precision, kind in
              (("fp32", "gpt"), ("bf16", "gpt"), ("fp16", "mlp"))]  # fmt: skip


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store")
    results: dict = {"seed": {}, "cases": {}}
    for variant in ("plain", "retain_graph"):
        engine, returned = seed_example(fzero, steps=16, retain_graph=variant == "retain_graph")
        params = engine.module_state_dict()
        # every rank must hold the same parameters: compare with rank 0's
        flat = torch.cat([v.float().flatten() for v in params.values()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        results["seed"][variant] = {
            "mesh": repr(engine.mesh),
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "returned": [float(r) for r in returned],
            "same_on_all_ranks": bool(torch.equal(flat, ref)),
            "params": {k: v.tolist() for k, v in params.items()},
        }
    mesh = fzero.DistMesh()
    for stage, precision, kind in DIST_CASES:
        results["cases"][f"{stage}-{precision}-{kind}"] = compare_with_train_step(stage, precision, 2, kind, mesh)
    report(rank, out_dir, results)
    process_group.shutdown()


def no_backward(rank: int, world: int, out_dir: str) -> None:
    """Stage 3 on a real mesh: `engine(x)` then `engine.step()` without a backward raises, and changes nothing."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_worker(rank, world, f"{out_dir}/store-nb")
    model = tiny_gpt(0)
    config = {"train_batch_size": 2 * world, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}  # fmt: skip
    engine, *_ = fzero.initialize(model=model, config=config)
    before = engine.state.params.clone()
    engine(torch.zeros(2, model.cfg.seq_len, dtype=torch.long))
    try:
        engine.step()
    except RuntimeError as e:
        assert "no gradients since the last step" in str(e), e
    else:
        raise AssertionError("engine.step() without a backward did not raise at stage 3")
    assert torch.equal(engine.state.params, before) and engine.global_steps == 0
    dist.barrier()
    process_group.shutdown()

"""The 2-process half of tests/test_scratch.py: every preset (core and engine) trained with the step-sized buffers
reused (`fzero.scratch`) and poisoned with NaN when handed out, against the same run with every buffer fresh."""

from __future__ import annotations

import torch

import fzero
from fzero.host import process_group, scratch
from tests.spawn import init_worker, report
from tests.support import differing, lm_batches, lm_loss, tiny_gpt

CASES = [(stage, micro, precision, overlap) for stage in (0, 1, 2, 3) for micro in (1, 2)
         for precision in ("fp32", "bf16") for overlap in (False, True)]  # fmt: skip
STEPS = 3


def keep_gradients() -> fzero.Transform:
    """A transform that keeps the step's (reduced) gradient in its state, as a functional user may: the very tensor
    the reduction made, so a reused buffer would overwrite it on the next step."""

    def init(flow: fzero.Flow, ctx: fzero.Context):
        return flow, flow.params.new_zeros(flow.params.shape)

    def update(flow: fzero.Flow, state, ctx: fzero.Context):
        return flow, flow.grads

    return fzero.Transform(init, update, "keep_gradients")


def _slots() -> dict[str, int]:
    return {key[0]: kept.data_ptr() for key, kept in scratch._slots.items()}


def _core(stage: int, micro: int, precision: str, overlap: bool, mesh: fzero.DistMesh, rank: int):
    model = tiny_gpt(0)
    tx = getattr(fzero, f"zero{stage}")(fzero.adamw(1e-2), accumulate=micro,
                                        precision=None if precision == "fp32" else precision)  # fmt: skip
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True,
                            gather=fzero.GatherPolicy(overlap_reduce=overlap))  # fmt: skip
    losses, slots = [], []
    for batch in lm_batches(tiny_gpt(0), 2, micro, 2, STEPS, 5):
        state, metrics = step(state, {k: v[rank] for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
        slots.append(_slots())
    return fzero.state_dict(state, mesh), losses, slots


def _kept(mesh: fzero.DistMesh, rank: int):
    """Stage 2's pieces with `keep_gradients` after the reduction: every step's kept gradient, cloned as it is
    returned, and the last state's one (which a later step's reused buffer must not have overwritten)."""
    model = tiny_gpt(0)
    tx = fzero.chain(fzero.reduce_scatter(), keep_gradients(), fzero.shard_update(fzero.adamw(1e-2)), fzero.gather())
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, lm_loss(model), tx, mesh, donate=True)
    first = None
    for batch in lm_batches(tiny_gpt(0), 2, 1, 2, STEPS, 5):
        state, _ = step(state, {k: v[rank] for k, v in batch.items()})
        kept = state.tx_state["keep_gradients"]
        if first is None:
            first = (kept, kept.clone())  # the first step's kept gradient, and its value then
    return {"first": first[0], "first_then": first[1], "params": fzero.state_dict(state, mesh)}


def _engine(stage: int, precision: str, rank: int):
    model = tiny_gpt(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}  # fmt: skip
    engine, *_ = fzero.initialize(model=model, config=config, mesh=fzero.DistMesh(), printer=lambda _: None)
    for batch in lm_batches(tiny_gpt(0), 2, 1, 2, STEPS, 5):
        mine = {k: v[rank] for k, v in batch.items()}
        logits = engine(mine["x"])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mine["y"].flatten())
        engine.backward(loss)
        engine.step()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store")
    mesh = fzero.DistMesh()
    scratch.MIN_BYTES = 0  # the tiny model's buffers are far below the real threshold: reuse them all here
    results: dict = {}
    for stage, micro, precision, overlap in CASES:
        with scratch.disabled():
            fresh, fresh_losses, _ = _core(stage, micro, precision, overlap, mesh, rank)
        scratch.clear()
        with scratch.poisoned():
            reused, losses, slots = _core(stage, micro, precision, overlap, mesh, rank)
        results[f"core-{stage}-{micro}-{precision}-{overlap}"] = {
            "differ": differing(fresh, reused),
            "losses": losses == fresh_losses,
            "slots": slots,
        }
        scratch.clear()
    with scratch.disabled():
        fresh = _kept(mesh, rank)
    with scratch.poisoned():
        reused = _kept(mesh, rank)
    same = torch.equal(reused["first"], fresh["first"]) and not differing(fresh["params"], reused["params"])
    results["kept"] = {"first_intact": torch.equal(reused["first"], reused["first_then"]), "same_as_fresh": same}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            scratch.clear()
            with scratch.disabled():
                fresh = _engine(stage, precision, rank)
            with scratch.poisoned():
                reused = _engine(stage, precision, rank)
            results[f"engine-{stage}-{precision}"] = {"differ": differing(fresh, reused), "slots": _slots()}
    report(rank, out_dir, results)
    process_group.shutdown()

"""Worker for tests/test_config_zeropp.py: DeepSpeed configs with ZeRO++ (hpZ, qwZ, qgZ) and MiCS through
`fzero.initialize` on 4 gloo processes, against the functional `fzero.zero3` they map to on
`SimMesh(shape={"replicate": 2, "shard": 2})`, which rank 0 also runs (one thread, as every rank)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import lm_batches, tiny_gpt

WORLD = 4
SHAPE = {"replicate": 2, "shard": 2}
GAS, MICRO, STEPS, LR = 2, 2, 2, 1e-2

# DeepSpeed's ZeRO++ tutorial config (docs/_tutorials/zeropp.md), its hpZ group 2 ranks here
ZEROPP = {
    "stage": 3, "reduce_bucket_size": 10_000_000, "reduce_scatter": True, "zero_quantized_weights": True,
    "zero_hpz_partition_size": 2, "zero_quantized_gradients": True, "contiguous_gradients": True,
    "overlap_comm": True,
}  # fmt: skip
MICS = {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}
# (the tiny GPT has no frozen parameters: qwz_frozen, which zero_quantized_weights also sets, changes nothing)
CASES = {"zeropp": (ZEROPP, {"hpz": True, "qwz": True, "qgz": True}), "mics": (MICS, {"hybrid": True})}


def config(zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }


def criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batches() -> list[dict[str, torch.Tensor]]:
    """`STEPS * GAS` micro-batches `{x, y}` of shape `[WORLD, MICRO, seq]` (rank r's rows: `[r]`)."""
    return lm_batches(tiny_gpt(0), WORLD, GAS, MICRO, STEPS, 7)


def core(preset: dict) -> dict[str, torch.Tensor]:
    """The functional core: `fzero.zero3(..., **preset)` on the (2, 2) `SimMesh`, as the engine builds it from the
    config (the config's AdamW runs on the fused CPU kernel, clip 1.0, accumulation GAS)."""
    model = tiny_gpt(0)
    tx = fzero.zero3(fzero.adamw(LR, weight_decay=0.01, fused=True), accumulate=GAS, clip=1.0, **preset)
    mesh = fzero.SimMesh(shape=SHAPE)

    def loss_fn(params, batch):
        return criterion(torch.func.functional_call(model, params, (batch["x"],)), batch["y"])

    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, loss_fn, tx, mesh)
    for batch in batches():
        state, _ = step(state, batch)
    return fzero.state_dict(state, mesh)


def train_on(engine, rank: int, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in micro_batches:
        engine.backward(criterion(engine(batch["x"][rank]), batch["y"][rank]))
        engine.step()


def engine_run(zero: dict, rank: int, out_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The DeepSpeed loop on this rank through `fzero.initialize` (the mesh its default); its consolidated
    parameters and what it built. Half-way, a checkpoint is saved and loaded into a fresh engine, which trains on
    beside the first: `resumed_bitwise` says whether both end with the same parameters."""
    model = tiny_gpt(0)
    engine, *_ = fzero.initialize(model=model, config=config(zero))
    half = len(batches()) // 2
    train_on(engine, rank, batches()[:half])
    engine.save_checkpoint(f"{out_dir}/ckpt-{zero.get('mics_shard_size', 'zeropp')}")
    resumed, *_ = fzero.initialize(model=tiny_gpt(1), config=config(zero))
    resumed.load_checkpoint(f"{out_dir}/ckpt-{zero.get('mics_shard_size', 'zeropp')}")
    train_on(engine, rank, batches()[half:])
    train_on(resumed, rank, batches()[half:])
    layout = engine.state.layout
    got, again = engine.module_state_dict(), resumed.module_state_dict()
    built = {"mesh": repr(engine.mesh), "layout_world": layout.world, "global_steps": engine.global_steps,
             "resumed_bitwise": all(torch.equal(got[k], again[k]) for k in got)}  # fmt: skip
    return got, built


NODE = 2  # ranks per node, as torchrun numbers 2 nodes of 2 (qgZ quantizes across nodes only)


def run(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % NODE), LOCAL_WORLD_SIZE=str(NODE))
    init_worker(rank, world, f"{out_dir}/store")
    results: dict = {}
    for name, (zero, preset) in CASES.items():
        got, built = engine_run(zero, rank, out_dir)
        flat = torch.cat([v.flatten() for v in got.values()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        built["same_on_all_ranks"] = bool(torch.equal(flat, ref))
        if rank == 0:
            want = core(preset)
            built["keys_match"] = want.keys() == got.keys()
            built["differ"] = {
                k: float((want[k].double() - got[k].double()).abs().max())
                for k in want
                if k in got and not torch.equal(want[k], got[k])
            }
        results[name] = built
    report(rank, out_dir, results)
    process_group.shutdown()

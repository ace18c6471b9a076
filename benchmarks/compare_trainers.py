"""`benchmarks/compare.py`'s model, data and trainers (each a builder `(model, precision) -> step`), and the process
settings of its `-tuned` rows.

Importing this module changes nothing process-wide unless the environment asks for the tuned settings
(`FZERO_BENCH_TUNED=1`, set by `compare.py --tuned` for its second pair of processes only): then, at import, before the
first tensor, `fzero.hostmem.enable_huge_pages()` and, unless `FZERO_BENCH_MALLOC=default`, `retain_freed_memory()`,
the settings `fzero train` makes. A user's own script makes neither, so the default rows measure what users run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.examples.gpt import GPT, GPTConfig

TUNED = "FZERO_BENCH_TUNED"
"""The environment variable that asks this module, at import, for the tuned process settings ("1")."""
MALLOC = "FZERO_BENCH_MALLOC"
"""With `TUNED`: "default" leaves glibc's malloc be (huge pages only; `compare.py --default-malloc`)."""


def apply_tuning() -> str:
    """The `-tuned` rows' process settings, where the environment asks for them (`TUNED`, `MALLOC`); called at
    import, before this process's first tensor (torch reads the huge-page setting at its first CPU allocation).

    Returns:
      What this process runs with, for the report: "none" (a user's script: no `fzero.hostmem` call), "huge pages",
      or "huge pages, freed memory kept".
    """
    if os.environ.get(TUNED) != "1":
        return "none"
    fzero.hostmem.enable_huge_pages()
    if os.environ.get(MALLOC) == "default":
        return "huge pages"
    fzero.hostmem.retain_freed_memory()
    return "huge pages, freed memory kept"


TUNING = apply_tuning()

CFG = GPTConfig(vocab_size=8192, seq_len=64, n_layer=6, n_head=8, d_model=512)
MICRO, LR, WD = 4, 1e-4, 0.01
COLLECTIVE_TIMEOUT_S = 600  # longer than any one trainer's steps between two barriers here (24 layers: ~20 s)
Step = Callable[[dict[str, torch.Tensor]], None]


def make_model(n_layer: int = CFG.n_layer) -> GPT:
    """The benchmark's model, `CFG` with `n_layer` blocks (seed 0, an untied head); equal at every call: no copies."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CFG, n_layer=n_layer))
    model.head.weight = nn.Parameter(torch.randn(CFG.vocab_size, CFG.d_model) * 0.02)  # untied: 27.3M at 6 layers
    return model


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def device_type(model: nn.Module) -> str:
    """Where `model`'s parameters are: "cpu" here, "cuda" for `benchmarks/gpu.py`, which runs these trainers."""
    return next(model.parameters()).device.type


def ddp(model: nn.Module, precision: str, compile: bool = False) -> Step:
    """DDP with torch's fused AdamW; `compile`: on `torch.compile(model)` (DDP's compiled path: the graph broken at
    its buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    where = device_type(model)
    net = DistributedDataParallel(torch.compile(model) if compile else model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast(where, torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(net(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fsdp2(stage: int, compile: bool = False) -> Callable[[nn.Module, str], Step]:
    """FSDP2 on every block and the root; `compile`: each block compiled under `fully_shard` (torchtitan's way)."""

    def build(model: nn.Module, precision: str) -> Step:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp_policy = MixedPrecisionPolicy()
        if precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)
            if compile:
                block.compile()
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

        def step(batch: dict[str, torch.Tensor]) -> None:
            lm_loss(model(batch["x"]), batch["y"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return build


def ds_config(stage: int, precision: str, micro: int = MICRO) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "steps_per_print": 10**9,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def deepspeed_engine(stage: int, compile: bool = False) -> Callable[[nn.Module, str], Step]:
    """DeepSpeed's engine; `compile`: `engine.compile()` (DeepSpeed's default backend)."""

    def build(model: nn.Module, precision: str) -> Step:
        import deepspeed

        config = ds_config(stage, precision)
        # its default memory_efficient_linear would replace torch.nn.functional.linear for the whole process (every
        # trainer in the rotation would then run through DeepSpeed's linear; fzero's engine refuses to)
        config["zero_optimization"]["memory_efficient_linear"] = False
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine_step(engine, compile)

    return build


def engine_step(engine: Any, compile: bool) -> Step:
    """A DeepSpeed-style engine's step (DeepSpeed's or fzero's), after `engine.compile()` if `compile`."""
    if compile:
        engine.compile()

    def step(batch: dict[str, torch.Tensor]) -> None:
        engine.backward(lm_loss(engine(batch["x"]), batch["y"]))
        engine.step()

    return step


def grid(world: int) -> dict[str, int]:
    """The 2-D trainers' mesh shape for `world` processes: shard groups of 2 consecutive ranks (a node of 2)."""
    if world % 2:
        raise ValueError(f"the 2-D trainers need an even number of processes (shard groups of 2), got --nproc {world}")
    return {"replicate": world // 2, "shard": 2}


@functools.cache
def grid_mesh() -> fzero.DistMesh:
    """This process's 2-D `DistMesh`, made once and shared by the trainers (its sub-groups are collectives to make)."""
    return fzero.DistMesh(shape=grid(dist.get_world_size()))


def fzero_core(
    stage: int,
    overlap: bool | None = None,
    two_d: bool = False,
    compile: bool = False,
    reuse: int = 0,
    units: str | None = None,
    **options: bool,
) -> Callable[..., Step]:
    """fzero's functional step under `fzero.zero{stage}(..., **options)`.

    Args:
      stage: the ZeRO stage.
      overlap: overlap each unit's reduction with the backward (`GatherPolicy(overlap_reduce=...)`; None: the
        default, decided by the mesh).
      two_d: on `grid_mesh()` instead of the 1-D `DistMesh()`.
      compile: `train_step(compile=True)`: each unit compiled (`fzero.sharding.compile`).
      reuse: `GatherPolicy(reuse_distance=...)`: stage 3 keeps the units this distance covers gathered from their
        forward into their backward (0, the core's default: the last only; 10**9, DeepSpeed's: every unit here).
      units: `fzero.init(units=...)`: None, the default (`fzero.layout.Auto()`: the blocks, the embedding and the
        head each a unit); "module_list" keeps the embedding and the head in the root unit (the default before
        2026-11-29).
      options: the preset's ZeRO++ and hybrid flags (`hybrid`, `hpz`, `qwz`, `qgz`).

    Returns:
      `build(model, precision, mesh=None)`; `mesh` overrides the trainer's own (the `--comm` ledger's).
    """

    def build(model: nn.Module, precision: str, mesh: fzero.DistMesh | None = None) -> Step:
        if mesh is None:
            mesh = grid_mesh() if two_d else fzero.DistMesh()
        preset = getattr(fzero, f"zero{stage}")
        # fused: the C kernel where the master weights are on the CPU, torch's fused kernel (DDP's) on a GPU
        tx = preset(fzero.adamw(LR, weight_decay=WD, fused=True), precision=None if precision == "fp32" else precision,
                    **options)  # fmt: skip

        def loss_fn(params: dict, batch: dict) -> torch.Tensor:
            return lm_loss(fzero.call(model, params, batch["x"]), batch["y"])

        policy = fzero.GatherPolicy(overlap_reduce=overlap, reuse_distance=reuse)
        train = fzero.train_step(model, loss_fn, tx, mesh, donate=True, gather=policy, compile=compile)
        box = [fzero.init(model, tx, mesh, units=units)]
        model.to("meta")  # the state holds the parameters: free the template's own (as `fully_shard` replaces them)

        def step(batch: dict[str, torch.Tensor]) -> None:
            box[0], _ = train(box[0], batch)

        return step

    return build


def fresh_buffers(build: Callable[..., Step]) -> Callable[..., Step]:
    """`build`'s trainer with every step-sized buffer fresh (`fzero.scratch.disabled()`), as before fzero reused
    them: the paired comparison in one rotation."""

    def wrapped(model: nn.Module, precision: str, **kw: Any) -> Step:
        with fzero.scratch.disabled():
            step = build(model, precision, **kw)

        def run(batch: dict[str, torch.Tensor]) -> None:
            with fzero.scratch.disabled():
                step(batch)

        return run

    return wrapped


def fzero_engine(
    stage: int, micro: int = MICRO, compile: bool = False, reuse: int | None = None
) -> Callable[[nn.Module, str], Step]:
    """fzero's engine from `ds_config`; `compile`: `engine.compile()` (per unit, inductor); `reuse`: the config's
    `stage3_max_reuse_distance` (None: unset, fzero's 0)."""

    def build(model: nn.Module, precision: str) -> Step:
        config = ds_config(stage, precision, micro)
        if reuse is not None:
            config["zero_optimization"]["stage3_max_reuse_distance"] = reuse
        engine, *_ = fzero.initialize(model=model, config=config, mesh=fzero.DistMesh(), printer=lambda line: None)
        return engine_step(engine, compile)

    return build


def floor_forward_backward(model: nn.Module, precision: str) -> Step:
    """The model's forward and backward on this rank's micro-batch alone: no communication, no optimizer (bf16:
    under autocast, as `ddp`)."""

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(model(batch["x"]), batch["y"])
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def floor_update(model: nn.Module, precision: str) -> Step:
    """The update alone, as ZeRO shares it: torch's fused AdamW over a 1/W share of the parameters (fp32 master)."""
    share = -(-sum(p.numel() for p in model.parameters()) // dist.get_world_size())
    flat = torch.zeros(share, requires_grad=True)
    flat.grad = torch.full((share,), 1e-3)
    opt = torch.optim.AdamW([flat], lr=LR, weight_decay=WD, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        opt.step()

    return step


AGAIN = "ddp-again"  # the A/A row: DDP built a second time, timed in the same rotation


def rotated(order: list[str], r: int) -> list[str]:
    """Round `r`'s order of a rotation: `order` started `r` places on, so each name leads in turn and machine noise
    hits them alike."""
    k = r % len(order)
    return order[k:] + order[:k]


FLOOR = ("floor-fwdbwd", "floor-update")
SWEEP = ("ddp", "fsdp2-zero3", "deepspeed-zero3", "fzero-zero3", "fzero-engine-zero3")  # --sweep's default --only
PEERS3 = ("fsdp2-zero3", "deepspeed-zero3")  # --sweep: the stage-3 peak RSS that fzero's rows should stay within
ZEROPP3 = {  # on the 2-D mesh; named in --only to run
    "fzero-hybrid3": {"hybrid": True},
    "fzero-hpz3": {"hpz": True},
    "fzero-qwz3": {"qwz": True},
    "fzero-qgz3": {"qgz": True},
    "fzero-zero++3": {"hpz": True, "qwz": True, "qgz": True},
}


def ddp_core_engine(micro: int = MICRO) -> dict[str, Callable[[nn.Module, str], Step]]:
    """DDP, the core and the engine at stages 0-3 (what `benchmarks/gpu.py` and `host_overhead.py` time), the engine
    with `micro` sequences per micro-batch."""
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp": ddp}
    out.update({f"fzero-zero{s}": fzero_core(s) for s in range(4)})
    out.update({f"fzero-engine-zero{s}": fzero_engine(s, micro) for s in range(4)})
    return out


def trainers() -> dict[str, Callable[[nn.Module, str], Step]]:
    """Every trainer by name: `ddp` and `ddp-again` (a second, separately built DDP: the A/A row), FSDP2, DeepSpeed,
    fzero's core and engine variants, the floor's two parts, the 2-D ZeRO++ / hybrid rows and the compiled rows."""
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp": ddp, AGAIN: ddp}
    for stage in (2, 3):
        out[f"fsdp2-zero{stage}"] = fsdp2(stage)
    for stage in (1, 2, 3):
        out[f"deepspeed-zero{stage}"] = deepspeed_engine(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}"] = fzero_core(stage)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}-serial"] = fzero_core(stage, overlap=False)
    for stage in (0, 1, 2):
        out[f"fzero-zero{stage}-fresh"] = fresh_buffers(fzero_core(stage))
    for stage in (0, 1, 2, 3):
        out[f"fzero-engine-zero{stage}"] = fzero_engine(stage)
    for stage in (2, 3):
        out[f"fzero-zero{stage}-rooted"] = fzero_core(stage, units="module_list")
    out["fzero-zero3-keep"] = fzero_core(3, reuse=10**9)  # every unit kept into its backward: DeepSpeed's default
    out["fzero-engine-zero3-keep"] = fzero_engine(3, reuse=10**9)
    out.update(zip(FLOOR, (floor_forward_backward, floor_update), strict=True))
    for name, options in ZEROPP3.items():
        out[name] = fzero_core(3, two_d=True, **options)
    out.update(compiled_trainers())
    return out


COMPILED = "-compiled"
"""The suffix of the compiled trainers' names (`compare.py --compile`)."""


def compiled_trainers() -> dict[str, Callable[[nn.Module, str], Step]]:
    """The compiled rows, each named after its eager one: DDP on `torch.compile(model)` (twice: the compiled A/A
    row), FSDP2 with each block compiled, DeepSpeed's `engine.compile()`, fzero's core (`train_step(compile=True)`)
    and engine (`engine.compile()`), at the stages of the eager rows."""
    compiled_ddp = functools.partial(ddp, compile=True)
    out: dict[str, Callable[[nn.Module, str], Step]] = {"ddp" + COMPILED: compiled_ddp, AGAIN + COMPILED: compiled_ddp}
    for stage in (2, 3):
        out[f"fsdp2-zero{stage}{COMPILED}"] = fsdp2(stage, compile=True)
    for stage in (1, 2, 3):
        out[f"deepspeed-zero{stage}{COMPILED}"] = deepspeed_engine(stage, compile=True)
    for stage in (0, 1, 2, 3):
        out[f"fzero-zero{stage}{COMPILED}"] = fzero_core(stage, compile=True)
        out[f"fzero-engine-zero{stage}{COMPILED}"] = fzero_engine(stage, compile=True)
    return out


def has_ledger(name: str) -> bool:
    """Whether the `--comm` table measures trainer `name` (fzero's functional core: its builder takes `mesh=`)."""
    return name in ZEROPP3 or (name.startswith("fzero-zero") and not name.startswith("fzero-engine"))


def step_ledger(
    name: str, precision: str, data: list[dict[str, torch.Tensor]], n_layer: int = CFG.n_layer
) -> dict[str, dict[str, int]]:
    """One step's ledger (after one warm-up step) of a fresh `name` trainer on `grid_mesh()`, this rank's."""
    mesh = grid_mesh()
    step = trainers()[name](make_model(n_layer), precision, mesh=mesh)
    step(data[0])
    with mesh.record() as ledger:
        step(data[1 % len(data)])
    return ledger.as_dict()


def batches(rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    """`n` micro-batches of `MICRO` x `CFG.seq_len` tokens for `rank` (seeded by rank: equal at every call), each
    `{"x": inputs, "y": the next tokens}`."""
    g = torch.Generator().manual_seed(100 + rank)
    toks = [torch.randint(0, CFG.vocab_size, (MICRO, CFG.seq_len + 1), generator=g) for _ in range(n)]
    return [{"x": t[:, :-1], "y": t[:, 1:]} for t in toks]


def build_all(names: list[str], precision: str, n_layer: int = CFG.n_layer) -> tuple[dict[str, Step], dict[str, str]]:
    """Builds each trainer in `names` on its own `make_model(n_layer)`.

    Returns:
      `(steps, skipped)`: the step functions by name, and why each missing one was skipped (DeepSpeed not installed).
    """
    steps, skipped = {}, {}
    for name in names:
        try:
            steps[name] = trainers()[name](make_model(n_layer), precision)
        except ImportError as e:  # DeepSpeed not installed
            skipped[name] = f"not installed ({e.name})"
    return steps, skipped

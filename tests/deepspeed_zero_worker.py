"""Workers of tests/test_deepspeed_zero.py: DeepSpeed 0.19.8 itself (CPU accelerator, gloo) and fzero side by side in
the same processes, on one process and on two: `zero.Init`, `GatheredParameters` before and after `initialize`, the
`safe_get_*` / `safe_set_*` functions, and Hugging Face's `from_pretrained` under fzero's `zero.Init`.

Both libraries run the same steps in lockstep on the same data, so every comparison is made in the worker, on the
same run; rank 0 reports what it found (`tests.spawn.report`). DeepSpeed's config turns off its memory-efficient
`linear` (which would replace `torch.nn.functional.linear` for the whole process) and its parameter persistence
(so that its units, like fzero's, are gathered on demand).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fzero.host import process_group
from tests.spawn import init_worker, report
from tests.support import proc_status

GLOBAL, STEPS = 8, 6


class Net(nn.Module):
    """Two units in a ModuleList between a root embedding and head; a LayerNorm whose bias is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 10)
        self.ln = nn.LayerNorm(10)
        self.ln.bias.requires_grad_(False)
        self.layers = nn.ModuleList([nn.Linear(10, 10) for _ in range(2)])
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.ln(self.emb(x)))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class Scaled(nn.Module):
    """A parent that initialises its children with `apply` (as GPT-2 does), drawing from the random stream."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


class Shared(nn.Module):
    """The root's forward uses a weight of the first unit outside that unit's forward (registered as external)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        return self.layers[1](h + h @ self.layers[0].weight)


class Overwrites(nn.Module):
    """A parent whose `__init__` writes to a child's parameter after the child was built (lost under zero.Init)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        nn.init.zeros_(self.a.weight)


def config(world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def on_nvme(rank: int, world: int, out_dir: str, cfg: dict[str, Any], zero: Any, fzero: Any) -> dict[str, Any]:
    """`zero.Init` with the config's `offload_param` on `nvme`: the partitions in files under its `nvme_path`, bitwise
    those kept in memory, taking none of the process's anonymous memory (the in-memory build is the control: it
    grows by its partition); `fzero.init` builds the same state from either."""
    path = os.path.join(out_dir, f"nvme-{world}-{rank}")
    os.mkdir(path)
    offload = {"offload_param": {"device": "nvme", "nvme_path": path}}
    nvme_cfg = {**cfg, "zero_optimization": {**cfg["zero_optimization"], **offload}}
    built, grown = {}, {}
    for where, c in (("nvme", nvme_cfg), ("memory", cfg)):
        torch.manual_seed(2)
        before = proc_status("RssAnon")
        with zero.Init(config_dict_or_path=c):
            built[where] = nn.Linear(2048, 2048)
        grown[where] = proc_status("RssAnon") - before
    pairs = list(zip(built["nvme"].parameters(), built["memory"].parameters(), strict=True))
    states = {
        k: fzero.state_dict(fzero.init(m, fzero.zero3(fzero.adamw()), fzero.SimMesh(2))) for k, m in built.items()
    }
    return {
        "nvme_bitwise": all(torch.equal(a.ds_tensor, b.ds_tensor) for a, b in pairs)
        and all(torch.equal(v, states["memory"][k]) for k, v in states["nvme"].items()),
        "nvme_grown": grown["nvme"],
        "memory_grown": grown["memory"],
        "partition_bytes": sum(p.ds_tensor.numel() * 4 for p in built["memory"].parameters()),
    }


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)
    n = GLOBAL // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def same(a: Any, b: Any) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a.float(), b.float()))


def gathered_fragments(local: torch.Tensor, numel: int) -> torch.Tensor:
    """Every rank's `local` fragment in rank order, as one flat tensor of the parameter's `numel` elements
    (DeepSpeed's partitions carry padding past the end)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.detach().reshape(-1))
    return torch.cat(parts)[:numel]


def loss_of(engine: Any, step: int, rank: int, world: int, read: Any = None) -> float:
    x, y = batch(step, rank, world)
    loss = (engine(x) - y).square().mean()
    engine.backward(loss)
    if read is not None:
        read()
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return (total / world).item()


def run(rank: int, world: int, out_dir: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_worker(rank, world, f"{out_dir}/store-{world}")
    import deepspeed

    import fzero
    import fzero.deepspeed as fds
    from fzero.deepspeed import zero

    # (the modules: `deepspeed.utils.tensor_fragment` as an attribute is DeepSpeed's dataclass of that name)
    ds_tf = importlib.import_module("deepspeed.utils.tensor_fragment")
    fz_tf = importlib.import_module("fzero.deepspeed.utils.tensor_fragment")

    out: dict[str, Any] = {}
    cfg = config(world)
    # ---------------------------------------------------------------------------------------- construction
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        theirs = Net()
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path=cfg):
        ours = Net()
    pairs = list(zip(theirs.parameters(), ours.parameters(), strict=True))
    out["attributes"] = all(
        o.shape == t.shape == (0,) and o.ds_shape == t.ds_shape and o.ds_numel == t.ds_numel
        and o.ds_status == zero.ZeroParamStatus.NOT_AVAILABLE and t.ds_status.name == "NOT_AVAILABLE"
        and torch.equal(o.ds_tensor, t.ds_tensor)
        for t, o in pairs
    )  # fmt: skip
    with zero.GatheredParameters(ours.parameters()), deepspeed.zero.GatheredParameters(theirs.parameters()):
        out["built_as_normal"] = all(
            torch.equal(o, r) for o, r in zip(ours.parameters(), ref.parameters(), strict=True)
        )
        out["built_as_deepspeed"] = all(torch.equal(o, t) for t, o in pairs)
        out["status_inside"] = all(o.ds_status == zero.ZeroParamStatus.AVAILABLE for o in ours.parameters())
    torch.manual_seed(1)
    normal = Scaled()
    torch.manual_seed(1)
    with zero.Init():
        scaled = Scaled()
    with zero.GatheredParameters(scaled.parameters()):
        out["apply_gathered"] = all(
            torch.equal(a, b) for a, b in zip(scaled.parameters(), normal.parameters(), strict=True)
        )
    try:
        with zero.Init():
            Overwrites()
        out["lost_write"] = "no error"
    except RuntimeError as e:
        out["lost_write"] = str(e)
    with zero.Init(enabled=False):
        plain = nn.Linear(2, 2)
    out["disabled"] = plain.weight.shape == (2, 2) and not hasattr(plain.weight, "ds_id")
    # under a bf16 config the values are rounded through bf16 (where a DeepSpeed run's master starts), kept in fp32
    torch.manual_seed(0)
    with zero.Init(config_dict_or_path={**cfg, "bf16": {"enabled": True}}):
        rounded = Net()
    with zero.GatheredParameters(rounded.parameters()):
        out["bf16_rounded"] = all(
            a.dtype == torch.float32 and torch.equal(a, b.to(torch.bfloat16).float())
            for a, b in zip(rounded.parameters(), ref.parameters(), strict=True)
        )
    # the functional core builds its state from the partitions too, on any mesh (here 2 simulated ranks)
    state = fzero.init(rounded, fzero.zero3(fzero.adamw()), fzero.SimMesh(2))
    expected = {k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()}
    out["functional_init"] = all(torch.equal(v, expected[k]) for k, v in fzero.state_dict(state).items())
    out.update(on_nvme(rank, world, out_dir, cfg, zero, fzero))
    # ------------------------------------------------------------- a write before initialize, on rank 0 only
    value = torch.arange(30, dtype=torch.float32).view(3, 10) / 100
    for z, model in ((deepspeed.zero, theirs), (zero, ours)):
        with z.GatheredParameters([model.head.weight], modifier_rank=0), torch.no_grad():
            model.head.weight.copy_(value if rank == 0 else torch.full_like(value, 7.0))
        with z.GatheredParameters([model.head.bias]), torch.no_grad():
            model.head.bias.fill_(9.0)  # (no modifier_rank: dropped)
    with zero.GatheredParameters([ours.head.weight, ours.head.bias]):
        out["written_before"] = torch.equal(ours.head.weight, value) and not bool((ours.head.bias == 9).any())
    # ------------------------------------------------------------------------------------- training, side by side
    ds_engine, *_ = deepspeed.initialize(model=theirs, config=cfg, model_parameters=theirs.parameters())
    fz_engine, *_ = fds.initialize(model=ours, config=cfg, model_parameters=ours.parameters(), printer=lambda _: None)
    ds_params, fz_params = dict(ds_engine.module.named_parameters()), dict(fz_engine.module.named_parameters())
    # (at world 1 fzero's module holds the values: nothing is sharded at rest)
    status = zero.ZeroParamStatus.NOT_AVAILABLE if world > 1 else zero.ZeroParamStatus.AVAILABLE
    out["after_initialize"] = all(
        p.ds_status == status and p.ds_numel == ds_params[n].ds_numel and p.ds_shape == ds_params[n].ds_shape
        and not hasattr(p, "_fzero_partition") for n, p in fz_params.items()
    )  # fmt: skip
    losses: dict[str, list[float]] = {"deepspeed": [], "fzero": []}
    checks: dict[str, bool] = {}

    def read_grads() -> None:  # between backward and step
        for n, p in fz_params.items():
            ds_full, fz_full = ds_tf.safe_get_full_grad(ds_params[n]), fz_tf.safe_get_full_grad(p)
            checks[f"full_grad {n}"] = same(ds_full, fz_full)
            if fz_full is not None:
                ours_local = gathered_fragments(fz_tf.safe_get_local_grad(p), p.ds_numel)
                theirs_local = gathered_fragments(ds_tf.safe_get_local_grad(ds_params[n]), p.ds_numel)
                checks[f"local_grad {n}"] = same(ours_local.view_as(fz_full), fz_full) and same(
                    ours_local, theirs_local
                )

    for step in range(1, 4):
        losses["deepspeed"].append(loss_of(ds_engine, step, rank, world))
        losses["fzero"].append(loss_of(fz_engine, step, rank, world, read_grads if step == 3 else None))
    for n, p in fz_params.items():
        for key in (None, "exp_avg", "exp_avg_sq"):
            get = fz_tf.safe_get_full_fp32_param if key is None else fz_tf.safe_get_full_optimizer_state
            get_ds = ds_tf.safe_get_full_fp32_param if key is None else ds_tf.safe_get_full_optimizer_state
            args = () if key is None else (key,)
            full = get(p, *args)
            checks[f"full {key} {n}"] = same(full, get_ds(ds_params[n], *args))
            if full is not None:
                get_local = fz_tf.safe_get_local_fp32_param if key is None else fz_tf.safe_get_local_optimizer_state
                get_local_ds = ds_tf.safe_get_local_fp32_param if key is None else ds_tf.safe_get_local_optimizer_state
                mine = gathered_fragments(get_local(p, *args), p.ds_numel)
                checks[f"local {key} {n}"] = same(mine.view_as(full), full) and same(
                    mine, gathered_fragments(get_local_ds(ds_params[n], *args), p.ds_numel)
                )
    # ----------------------------------------------------------------------- writes after initialize
    seen = {}
    for z, engine in ((deepspeed.zero, ds_engine), (zero, fz_engine)):
        named = dict(engine.module.named_parameters())
        with z.GatheredParameters(list(named.values())):
            seen[z] = {n: p.detach().clone() for n, p in named.items()}
        w = named["layers.0.weight"]
        with z.GatheredParameters(w, modifier_rank=0), torch.no_grad():
            w.mul_(0.5 if rank == 0 else 3.0)
        if z is deepspeed.zero:
            # DeepSpeed writes its compute partition only; its next step would overwrite it from the fp32 master
            # (which fzero writes too): its own refresh_fp32_params() copies it there, for the comparison
            out["deepspeed_keeps_it"] = same(ds_tf.safe_get_full_fp32_param(w), seen[z]["layers.0.weight"] * 0.5)
            engine.optimizer.refresh_fp32_params()
    out["gathered_after"] = all(torch.equal(seen[zero][n], v) for n, v in seen[deepspeed.zero].items())
    halved = seen[zero]["layers.0.weight"] * 0.5
    checks["modified lands"] = same(fz_tf.safe_get_full_fp32_param(fz_params["layers.0.weight"]), halved)
    checks["refreshed deepspeed"] = same(ds_tf.safe_get_full_fp32_param(ds_params["layers.0.weight"]), halved)
    g = torch.Generator().manual_seed(5)
    new_bias, new_avg = torch.randn(10, generator=g) * 0.1, torch.randn(10, 6, generator=g) * 0.01
    new_sq = torch.rand(10, generator=g) * 1e-3
    for tf, params in ((ds_tf, ds_params), (fz_tf, fz_params)):
        tf.safe_set_full_fp32_param(params["emb.bias"], new_bias)
        tf.safe_set_full_optimizer_state(params["emb.weight"], new_avg, "exp_avg")
    # local writes: each rank its own piece of the same full value (DeepSpeed's partition, fzero's fragment)
    n_ds = ds_params["layers.1.bias"].ds_tensor.numel()
    padded = torch.cat([new_sq, new_sq.new_zeros(n_ds * world - 10)])
    ds_tf.safe_set_local_optimizer_state(ds_params["layers.1.bias"], padded[rank * n_ds : (rank + 1) * n_ds],
                                         "exp_avg_sq")  # fmt: skip
    ds_tf.safe_set_local_fp32_param(ds_params["layers.1.bias"], padded[rank * n_ds : (rank + 1) * n_ds] + 0.5)
    mine = fz_tf.safe_get_local_fp32_param(fz_params["layers.1.bias"]).numel()
    start = torch.tensor([mine])
    starts = [torch.zeros_like(start) for _ in range(world)]
    dist.all_gather(starts, start)
    first = int(sum(s.item() for s in starts[:rank]))
    fz_tf.safe_set_local_optimizer_state(fz_params["layers.1.bias"], new_sq[first : first + mine], "exp_avg_sq")
    fz_tf.safe_set_local_fp32_param(fz_params["layers.1.bias"], new_sq[first : first + mine] + 0.5)
    # DeepSpeed's setters write its fp32 master, which its next update copies to the compute partitions: fzero's
    # write both at once (it may compute with the master itself); DeepSpeed's own copy, done now, for the comparison
    for group in range(len(ds_engine.optimizer.fp16_partitioned_groups_flat)):
        ds_engine.optimizer._reassign_or_swap_out_partitioned_parameters(group)
    checks["set local"] = same(fz_tf.safe_get_full_fp32_param(fz_params["layers.1.bias"]), new_sq + 0.5)
    for step in range(4, STEPS + 1):
        losses["deepspeed"].append(loss_of(ds_engine, step, rank, world))
        losses["fzero"].append(loss_of(fz_engine, step, rank, world))
    out["checks"] = {k: v for k, v in checks.items() if not v} or "all equal"
    out["checked"] = len(checks)
    out["losses"] = {k: [x.hex() for x in v] for k, v in losses.items()}
    out["errors"] = errors(fz_engine, fz_params, zero, fz_tf)
    del ds_engine, fz_engine
    out["stages"] = stages(rank, world, deepspeed, fds, ds_tf, fz_tf)
    out["external"] = external(rank, world, deepspeed, fds, zero)
    out["pretrained"] = pretrained(rank, world, out_dir, fds, zero, cfg)
    report(rank, out_dir, out)
    process_group.shutdown()


def stages(rank: int, world: int, deepspeed: Any, fds: Any, ds_tf: Any, fz_tf: Any) -> dict[str, Any]:
    """Stages 3, 2 and 1 with two micro-steps per step, side by side: after each micro-step's backward the gradient
    so far (the window's mean, reduced: DeepSpeed's stage 3 holds it; its stages 1-2 on the CPU do not give it), and
    after two steps the parameters and Adam's moments. The first micro-step's gradient depends only on the initial
    parameters and the data, and each element is the same sum at every stage: fzero's stages 1-2 are held to
    DeepSpeed's stage 3 there."""
    found: dict[str, Any] = {}
    first: dict[str, torch.Tensor] = {}
    for stage in (3, 2, 1):
        cfg = config(world)
        cfg["zero_optimization"]["stage"] = stage
        cfg.update(gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=GLOBAL // world // 2)
        engines = []
        for make in (deepspeed.initialize, fds.initialize):
            torch.manual_seed(0)
            model = Net()
            extra = {"printer": lambda _: None} if make is fds.initialize else {}
            engines.append(make(model=model, config=cfg, model_parameters=model.parameters(), **extra)[0])
        named = [dict(e.module.named_parameters()) for e in engines]
        trainable = [n for n, p in named[1].items() if p.requires_grad]
        checks = []
        for step in (1, 2):
            x, y = batch(step, rank, world)
            half = x.shape[0] // 2
            for k in (0, 1):
                for e in engines:
                    e.backward((e(x[k * half : (k + 1) * half]) - y[k * half : (k + 1) * half]).square().mean())
                ours = {n: fz_tf.safe_get_full_grad(named[1][n]) for n in trainable}
                if stage == 3:
                    checks += [same(ds_tf.safe_get_full_grad(named[0][n]), ours[n]) for n in trainable]
                    checks += [same(gathered_fragments(fz_tf.safe_get_local_grad(named[1][n]), ours[n].numel()),
                                    ours[n].reshape(-1)) for n in trainable]  # fmt: skip
                    if step == 1 and k == 0:
                        first = ours
                elif step == 1 and k == 0:
                    checks += [same(first[n], ours[n]) for n in trainable]
                for e in engines:
                    e.step()
        for n in trainable:
            checks.append(
                same(ds_tf.safe_get_full_fp32_param(named[0][n]), fz_tf.safe_get_full_fp32_param(named[1][n]))
            )
            for key in ("exp_avg", "exp_avg_sq"):
                checks.append(same(ds_tf.safe_get_full_optimizer_state(named[0][n], key),
                                   fz_tf.safe_get_full_optimizer_state(named[1][n], key)))  # fmt: skip
        found[f"stage {stage}"] = f"{sum(checks)} of {len(checks)} equal"
        del engines
    return found


def external(rank: int, world: int, deepspeed: Any, fds: Any, zero: Any) -> dict[str, Any]:
    """A weight used outside its unit's forward, registered (`register_external_parameter`) on a model built under
    `zero.Init`, before `initialize`: both train alike; unregistered, fzero's stage 3 trains as registered (the read,
    after the unit's forward, gathers it again: `Gatherer.read`), and its stage 2 as DeepSpeed's."""
    cfg = config(world)
    stage2 = {**cfg, "zero_optimization": {**cfg["zero_optimization"], "stage": 2}}

    def losses(make: Any, config: dict[str, Any], zero_init: Any = None) -> list[float]:
        """Two steps' losses of `Shared` under `make` (`initialize`), built under `zero_init`'s `Init` with the weight
        registered, or plainly (unregistered) without it."""
        torch.manual_seed(0)
        if zero_init is None:
            model = Shared()
        else:
            with zero_init.Init(config_dict_or_path=config):
                model = Shared()
            zero_init.register_external_parameter(model, model.layers[0].weight)
        extra = {"printer": lambda _: None} if make is fds.initialize else {}
        engine = make(model=model, config=config, model_parameters=model.parameters(), **extra)[0]
        return [loss_of(engine, step, rank, world) for step in (1, 2)]

    registered = losses(deepspeed.initialize, cfg, deepspeed.zero)
    return {
        "same_losses": registered == losses(fds.initialize, cfg, zero),
        "stage3_unregistered_same": registered == losses(fds.initialize, cfg),
        # DeepSpeed's stage 2 needs no registration
        "stage2_unregistered_same": losses(deepspeed.initialize, stage2) == losses(fds.initialize, stage2),
    }


def errors(engine: Any, params: dict[str, Any], zero: Any, tf: Any) -> dict[str, str]:
    """What misuse says."""
    found = {}
    attempts = {
        "outer_overlap": lambda: _nested(zero, params["head.weight"]),
        "grad_outside": lambda: tf.safe_get_full_grad(params["head.weight"]),
        "no_engine": lambda: tf.safe_set_full_fp32_param(nn.Parameter(torch.zeros(2)), torch.zeros(2)),
        "bad_key": lambda: tf.safe_get_full_optimizer_state(params["head.weight"], "momentum_buffer"),
        "bad_modifier": lambda: zero.GatheredParameters(params["head.weight"], modifier_rank=5),
        "mpu": lambda: zero.Init(mpu=object()),
        "tiled": lambda: zero.TiledLinear,
        "set_grad": lambda: tf.safe_set_full_grad,
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = "no error"
        except (RuntimeError, ValueError, NotImplementedError) as e:
            found[name] = f"{type(e).__name__}: {e}"
    found["frozen_is_none"] = str(tf.safe_get_full_fp32_param(params["ln.bias"]))
    return found


def _nested(zero: Any, p: Any) -> None:
    with zero.GatheredParameters(p), zero.GatheredParameters([p]):
        pass


def pretrained(rank: int, world: int, out_dir: str, fds: Any, zero: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's `from_pretrained` under ZeRO-3 with fzero's `HfDeepSpeedConfig`: transformers imports `deepspeed`
    by name, and gets `fzero.deepspeed` while the config lives, though DeepSpeed itself is imported in this process."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = os.path.join(out_dir, f"gpt2-{world}")
    torch.manual_seed(3)
    source = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    if rank == 0:
        source.save_pretrained(path)
    dist.barrier()
    saved = {k: v.clone() for k, v in source.state_dict().items()}
    real = sys.modules.get("deepspeed")
    result: dict[str, Any] = {}

    def build() -> Any:
        # as DeepSpeed-Chat's create_hf_model: the config lives in the function, DeepSpeed itself is imported too
        dschf = zero.HfDeepSpeedConfig({**cfg, "train_micro_batch_size_per_gpu": 1})
        import deepspeed  # the import inside transformers' functions: fzero's while dschf lives

        assert deepspeed is fds and sys.modules["deepspeed.zero"] is zero and dschf.is_zero3()
        model = GPT2LMHeadModel.from_pretrained(path)
        result["partitioned"] = all(p.shape == (0,) and hasattr(p, "ds_id") for p in model.parameters())
        # at ZeRO-3 even an unchanged size takes the gathering path; the new embedding is whole, as in DeepSpeed
        model.resize_token_embeddings(64)
        return model

    model = build()
    result["deepspeed_back"] = sys.modules.get("deepspeed") is real and real is not fds
    params = dict(model.named_parameters())
    with zero.GatheredParameters(list(params.values())):
        result["loaded"] = all(torch.equal(p, saved[n]) for n, p in params.items())
    # under bf16 DeepSpeed's partitions are bf16: the checkpoint's values land rounded, as the initial ones did
    dschf = zero.HfDeepSpeedConfig({**cfg, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    rounded = dict(GPT2LMHeadModel.from_pretrained(path).named_parameters())
    del dschf
    with zero.GatheredParameters(list(rounded.values())):
        result["loaded_bf16"] = all(torch.equal(p, saved[n].bfloat16().float()) for n, p in rounded.items())
    engine, *_ = fds.initialize(model=model, config={**cfg, "train_micro_batch_size_per_gpu": 1},
                                model_parameters=model.parameters(), printer=lambda _: None)  # fmt: skip
    reference, *_ = fds.initialize(model=source, config={**cfg, "train_micro_batch_size_per_gpu": 1},
                                   model_parameters=source.parameters(), printer=lambda _: None)  # fmt: skip
    ids = torch.arange(8).view(1, 8) + rank
    same_losses = []
    for e in (engine, reference):
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss)
        e.step()
        same_losses.append(loss.item())
    result["trains_as_loaded"] = same_losses[0] == same_losses[1]
    return result

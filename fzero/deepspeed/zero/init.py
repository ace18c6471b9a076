"""DeepSpeed's `zero.Init`: a model constructed inside is built partitioned, so no rank ever holds it whole.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = MyLargeModel()                  # each parameter: an empty stand-in, its values in partitions
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())

How, and why this way. Inside the context every `nn.Module` subclass's `__init__` is wrapped (DeepSpeed's own
mechanism): when a module's outermost `__init__` returns, its own parameters, initialised as the module initialised
them, are cut across the ranks (`fzero.sharding.construct.Partition`: DeepSpeed's per-parameter partition, rank
`r` keeping elements `[r * n, (r + 1) * n)` of the flattened tensor, `n = ceil(numel / world)`, rank 0's values) and
replaced by an empty stand-in. The module is constructed for real, in the order the script constructs it, so
torch's random stream is drawn exactly as without the context: the values are bitwise those of the model built
normally with the same seed, whatever initialisation code the modules run in their `__init__`. (Recording each
module's initialisation to replay it later on `meta` tensors cannot promise that: code in an `__init__` cannot be
re-run, and a replay unit by unit draws in another order.) At any time a rank holds its partitions plus the
parameters of the one module being finished (rank 0's values are received 256 KiB at a time, by `Partition.cut`, each
rank keeping its piece; the pages of what is freed are handed back as it goes: `fzero.host.heap`); with
`remote_device="nvme"` (or the config's `offload_param` on `nvme`) each partition is written to a file of its own under
`nvme_path` and its pages dropped, so the partitions take no memory either until `initialize` reads them, one unit at a
time (ZeRO-Infinity: a model larger than the host's memory). `Module.apply(fn)`
(a parent initialising its children, as GPT-2 and Hugging Face models do) runs `fn` on each module with its
parameters gathered and rank 0's result partitioned again, as DeepSpeed does; a parent's `__init__` that writes to a
child's parameter after the child was partitioned would write to the stand-in and lose the value: it is an error
naming the parameter (use `apply`, or `GatheredParameters(p, modifier_rank=0)`).

The values live in the partitions until `deepspeed.initialize` (`fzero.init`) builds the state from them, one unit
at a time, gathering each unit from its parameters' partitions (`fzero.sharding.construct.partitioned_parameters`);
the engine then drops them. `GatheredParameters` reads and writes them before that. Each parameter carries
DeepSpeed's attributes: `ds_id`, `ds_status` (`ZeroParamStatus.NOT_AVAILABLE`), `ds_numel`, `ds_shape`, `ds_tensor`
(this rank's partition), `ds_persist`.

Departures: DeepSpeed also makes every tensor created inside in the config's dtype (bf16 / fp16, and, with no config,
what the accelerator supports: bf16 on a CPU) and runs the initialisers in it; fzero keeps the dtype the module
creates (the master's) and, where the config enables bf16 or fp16 or `dtype` says so, rounds the values through it,
which is where a DeepSpeed run's master weights start for a model built without `Init` (`fzero.state.precision.
round_params`). Buffers are not partitioned (nor are they in DeepSpeed). A module created on `meta` inside is left
there. Nested contexts are one context.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...engine import init_distributed
from ...engine.parameters import mark
from ...host import accelerator
from ...host.heap import HeapRelease
from ...mesh import DistMesh
from ...sharding.construct import PARTITION, Partition, partition_of
from ...storage import spilled
from .gathered import GatheredParameters

__all__ = ["Init"]

_DTYPES = {torch.float16: torch.float16, torch.half: torch.float16, torch.bfloat16: torch.bfloat16}


class _Patches:
    """The process-wide patching of `nn.Module` that an active `Init` keeps (one, however nested)."""

    def __init__(self) -> None:
        self.depth = 0
        self.active: Init | None = None
        self.inits: dict[type, Callable[..., None]] = {}  # class -> its own __init__, unwrapped
        self.entered: set[int] = set()  # modules whose outermost __init__ is running
        self.apply: Callable[..., Any] = nn.Module.apply
        self.init_subclass: Any = None  # nn.Module's own __init_subclass__, if it has one

    def wrap(self, cls: type) -> None:
        if "__init__" in cls.__dict__ and cls not in self.inits:
            self.inits[cls] = cls.__dict__["__init__"]
            cls.__init__ = self._after(cls.__dict__["__init__"])  # type: ignore[misc]

    def _after(self, init: Callable[..., None]) -> Callable[..., None]:
        """`init`, then, when it was the object's outermost `__init__`, the context's post-init."""

        @functools.wraps(init)
        def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            outermost = id(module) not in self.entered
            if outermost:
                self.entered.add(id(module))
            try:
                init(module, *args, **kwargs)
            finally:
                if outermost:
                    self.entered.discard(id(module))
            if outermost and self.active is not None:
                self.active.post_init(module)

        return wrapper

    def enter(self, context: Init) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.active = context
        for cls in _subclasses(nn.Module):
            self.wrap(cls)
        self.init_subclass = nn.Module.__dict__.get("__init_subclass__")
        patches = self

        def init_subclass(cls: type[nn.Module], **kwargs: Any) -> None:  # classes defined inside the context
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patches.wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment,method-assign]
        self.apply = nn.Module.apply
        nn.Module.apply = _gathering_apply(self.apply)  # type: ignore[method-assign]

    def exit(self) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        for cls, init in self.inits.items():
            cls.__init__ = init  # type: ignore[misc]
        self.inits.clear()
        if self.init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self.init_subclass  # type: ignore[method-assign]
        nn.Module.apply = self.apply  # type: ignore[method-assign]
        self.active = None


_PATCHES = _Patches()


def _subclasses(cls: type) -> Iterator[type]:
    yield cls
    sub: type
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def _gathering_apply(apply: Callable[..., Any]) -> Callable[..., Any]:
    """`Module.apply` whose function sees each module's partitioned parameters gathered, rank 0's result kept."""

    @functools.wraps(apply)
    def gathering(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
        return apply(module, _with_gathered(fn))

    return gathering


def _with_gathered(fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    if getattr(fn, "_fzero_gathered", False):
        return fn

    @functools.wraps(fn)
    def run(module: nn.Module) -> None:
        params = [p for p in module.parameters(recurse=False) if partition_of(p) is not None]
        if not params:
            fn(module)
            return
        with GatheredParameters(params, modifier_rank=0):
            fn(module)

    run._fzero_gathered = True  # type: ignore[attr-defined]
    return run


class Init:
    """DeepSpeed's `deepspeed.zero.Init` (see the module docstring): a context in which models are constructed
    partitioned, or, with `module`, a call that partitions an existing model.

    Args:
      module: partition this already constructed model (as if it had been built inside).
      data_parallel_group: the group to partition over: None or the world group (other groups: not supported).
      mem_efficient_linear: DeepSpeed's memory-saving `linear` for its partitioned parameters; fzero's parameters
        are gathered unit by unit by the engine, so it has nothing to do (accepted).
      remote_device: where the partitions live: None (the accelerator), "cpu", or "nvme" (each in a file under
        the config's `zero_optimization.offload_param.nvme_path`, its pages dropped: `fzero.storage.spilled`);
        default: the config's `offload_param.device`.
      pin_memory: pin the partitions (CPU partitions, with a GPU present).
      config_dict_or_path: the DeepSpeed config (a dict or a JSON file): its bf16 / fp16 `enabled` and
        `zero_optimization.offload_param.device` and `nvme_path` are read.
      config: DeepSpeed's deprecated name for `config_dict_or_path`.
      enabled: False: the context does nothing (models are built normally).
      dtype: round the values through this dtype (torch.half or torch.bfloat16; torch.float: as they are);
        default from the config.
      mpu, zero_param_parallel_group, zero_quantized_weights, zero_quantized_nontrainable_weights,
        sequence_data_parallel_group, param_swapper, tensor_overrides: DeepSpeed's; only their defaults are
        supported (each other value raises `NotImplementedError` naming it and what to use instead).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: dict[str, Any] | str | os.PathLike[str] | None = None,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        _refuse_options(mpu, zero_param_parallel_group, zero_quantized_weights, zero_quantized_nontrainable_weights,
                        sequence_data_parallel_group, param_swapper, tensor_overrides)  # fmt: skip
        self.enabled = enabled
        if not enabled:
            return
        cfg = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        block = (cfg.get("zero_optimization") or {}).get("offload_param") or {}
        offload = block.get("device")
        remote_device = offload if remote_device is None and offload not in (None, "none") else remote_device
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"deepspeed.zero.Init(remote_device={remote_device!r}): expected None, 'cpu' or 'nvme'")
        self.nvme_path: str | None = None
        if remote_device == "nvme":
            if not block.get("nvme_path"):
                raise ValueError(
                    "deepspeed.zero.Init(remote_device='nvme') writes the partitions under the config's "
                    "zero_optimization.offload_param.nvme_path, which is not set: pass config_dict_or_path with it"
                )
            self.nvme_path = str(block["nvme_path"])
        self.round_to = _round_to(cfg, dtype)
        if not (dist.is_available() and dist.is_initialized()):
            init_distributed()  # (as DeepSpeed's Init does: a group of one in a plain process)
        if data_parallel_group is not None and data_parallel_group is not dist.group.WORLD:
            if dist.get_world_size(data_parallel_group) != dist.get_world_size():
                raise NotImplementedError("deepspeed.zero.Init(data_parallel_group=...) is not supported by fzero: "
                                          "it partitions over every rank (pass None)")  # fmt: skip
        self.mesh = DistMesh()
        self.device = torch.device("cpu") if remote_device in ("cpu", "nvme") else accelerator.device()
        self.pin = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        # the whole values and received chunks freed leave holes in glibc's heap that it keeps resident and cannot
        # reuse for the next ones: their pages are handed back as the construction goes (`fzero.host.heap`)
        self._heap = HeapRelease()
        if module is not None:
            for m in module.modules():
                self.post_init(m)
            self._heap.release()

    def __enter__(self) -> Init:
        if self.enabled:
            _PATCHES.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            _PATCHES.exit()
            self._heap.release()  # (what the last modules freed)

    def post_init(self, module: nn.Module) -> None:
        """Partition `module`'s own parameters, its `__init__` done (see the module docstring).

        Raises:
          RuntimeError: the `__init__` wrote to a parameter of a submodule after that was partitioned.
        """
        for name, p in module.named_parameters():
            part = partition_of(p)
            if part is not None and p._version != part.version:
                raise RuntimeError(
                    f"zero.Init: {type(module).__name__}.__init__ wrote to its parameter {name!r} (shape "
                    f"{part.shape}) after its own module had been partitioned; the write reaches an empty stand-in "
                    "and is lost. Initialise it in its own module's __init__, through module.apply(fn), or inside "
                    "deepspeed.zero.GatheredParameters(param, modifier_rank=0)"
                )
        fresh = [p for p in module.parameters(recurse=False) if partition_of(p) is None and not p.is_meta]
        # one at a time, each whole value freed once cut: beside the partitions, the module's own tensors and one
        # chunk in flight; rank 0's values, as DeepSpeed's: the ranks agree whatever their seeds
        for p in fresh:
            part = Partition.cut(self.mesh, p, self.device, src=0, round_to=self.round_to, freed=self._heap.freed)
            if self.nvme_path is not None:  # (in a file of its own: no memory until read, at initialize)
                part.shard = spilled(self.nvme_path, part.shard)
            elif self.pin:
                part.shard = part.shard.pin_memory()
            setattr(p, PARTITION, part)
            nbytes = p.numel() * p.element_size()
            p.data = stand_in(p)
            part.version = p._version
            mark(p, None, part.shape, part.shard, available=False)
            self._heap.freed(nbytes)


def _refuse_options(mpu: Any, hpz: Any, quantized: bool, quantized_frozen: bool, sequence: Any, swapper: Any,
                    overrides: Any) -> None:  # fmt: skip
    refused = {
        "mpu": (mpu is not None, "model parallelism is not supported by fzero (data parallel ZeRO only)"),
        "zero_param_parallel_group": (hpz is not None, "set zero_hpz_partition_size in the config's "
                                      "zero_optimization block: the engine builds the hybrid mesh"),
        "zero_quantized_weights": (quantized, "set it in the config's zero_optimization block: the engine "
                                   "quantizes the gathers it makes"),
        "zero_quantized_nontrainable_weights": (quantized_frozen, "not supported by fzero: frozen parameters are "
                                                "kept in their own dtype"),
        "sequence_data_parallel_group": (sequence is not None, "sequence parallelism is not supported by fzero"),
        "param_swapper": (swapper is not None, "the engine offloads to NVMe from the config at initialize"),
        "tensor_overrides": (overrides is not None, "fzero keeps the dtype and device the modules create (see "
                             "fzero.deepspeed.zero.init)"),
    }  # fmt: skip
    for name, (given, why) in refused.items():
        if given:
            raise NotImplementedError(f"deepspeed.zero.Init({name}=...) is not supported by fzero: {why}")


def _read_config(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        return source
    if isinstance(source, str | os.PathLike):
        with open(source) as f:
            out = json.load(f)
        if not isinstance(out, dict):
            raise ValueError(f"zero.Init: the config file {os.fspath(source)!r} does not hold a JSON object")
        return out
    raise TypeError(f"zero.Init: config_dict_or_path must be a dict or a path, got {type(source).__name__}")


def _round_to(cfg: dict[str, Any], dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the values are rounded through: `dtype`, else the config's bf16 / fp16, else none."""
    if dtype is not None:
        if dtype == torch.float32:
            return None
        if dtype not in _DTYPES:
            raise ValueError(f"zero.Init: dtype must be torch.half, torch.bfloat16 or torch.float, got {dtype}")
        return _DTYPES[dtype]

    def enabled(key: str) -> bool:
        return (cfg.get(key) or {}).get("enabled") is True

    if enabled("bf16") or enabled("bfloat16"):
        return torch.bfloat16
    return torch.float16 if enabled("fp16") else None


def stand_in(p: Tensor) -> Tensor:
    """The empty tensor a partitioned parameter holds in place of its values (DeepSpeed's)."""
    return torch.empty(0, dtype=p.dtype, device=p.device)

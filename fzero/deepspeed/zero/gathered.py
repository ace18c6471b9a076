"""DeepSpeed's `zero.GatheredParameters` and `register_external_parameter`, over fzero's partitions and engines.

    with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            model.lm_head.weight.zero_()        # lands on every rank, in the shards and the fp32 master

A parameter fzero holds partitioned is one built under `zero.Init` (its values in its `Partition`, before
`initialize`) or one of an engine's (`fzero.engine.parameters.owner`: its values in the engine's state). Inside the
context each listed parameter holds its full value (gathered: one all-gather per kind of owner and dtype); on exit,
with `modifier_rank=r`, rank `r`'s values are broadcast and written where the parameter's values live: its
partition, or the engine's fp32 master, its compute copy and the module (DeepSpeed writes its compute partition,
which is the master only in fp32); without, what was written is dropped. Either way the parameter gets its stand-in
back. The full value of an engine's parameter is its fp32 master (DeepSpeed's is the compute copy: they differ
under bf16 by the rounding). Parameters fzero does not hold partitioned are left alone (as DeepSpeed leaves them);
if none is, the context does nothing. A body that raises writes nothing back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from torch import Tensor, nn

from ...engine.parameters import ParameterAccess, ZeroParamStatus, owner
from ...host.heap import HeapRelease
from ...layout import ROOT_UNIT
from ...sharding.construct import EXTERNAL, Partition, broadcast_tensors, gather_partitions, partition_of

__all__ = ["GatheredParameters", "is_zero_param", "register_external_parameter", "unregister_external_parameter"]

_HEAP = HeapRelease()  # (one count for every context: many small ones add up to a release too)

_DEPTH = "_fzero_gathered"  # on a parameter inside a GatheredParameters context


def is_zero_param(param: Any) -> bool:
    """Whether `param` is a ZeRO-3 partitioned parameter (DeepSpeed's test: it has a `ds_id`)."""
    return hasattr(param, "ds_id")


class GatheredParameters:
    """DeepSpeed's `deepspeed.zero.GatheredParameters` (see the module docstring).

    Args:
      params: a parameter, or an iterable of them (anything else is ignored, as in DeepSpeed).
      modifier_rank: the rank whose values are kept on exit (None: nothing written is kept).
      fwd_module: register `params` as external parameters of this module (`register_external_parameter`).
      enabled: False: the context does nothing.

    Raises:
      ValueError: `modifier_rank` is not a rank.
      RuntimeError: a parameter is already gathered by an enclosing context; or a write while the engine is inside a
        micro-step (between `engine(...)` and `engine.step()`).
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:  # fmt: skip
        self.enabled = enabled
        self.params: list[Tensor] = []
        if not enabled:
            return
        listed = list(params) if isinstance(params, Iterable) and not isinstance(params, Tensor) else [params]
        unique = list({id(p): p for p in listed if isinstance(p, Tensor)}.values())
        held = [p for p in unique if partition_of(p) is not None or owner(p) is not None]
        # the same order on every rank, whatever order each was given (DeepSpeed sorts by ds_id too)
        self.params = sorted(held, key=lambda p: getattr(p, "ds_id", -1))
        if not self.params:
            self.enabled = False
            return
        world = self._world()
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
            raise ValueError(f"GatheredParameters: modifier_rank must be a rank in [0, {world}) or None, "
                             f"got {modifier_rank!r}")  # fmt: skip
        self.modifier_rank = modifier_rank
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, cast(nn.Parameter, p))

    def _world(self) -> int:
        p = self.params[0]
        part = partition_of(p)
        if part is not None:
            return part.mesh.world
        engine = owner(p)
        assert engine is not None  # (held)
        return engine.mesh.world

    def _groups(self) -> tuple[list[Tensor], dict[int, tuple[ParameterAccess, list[Tensor]]]]:
        """The parameters held in partitions, and those of each engine."""
        parts: list[Tensor] = []
        engines: dict[int, tuple[ParameterAccess, list[Tensor]]] = {}
        for p in self.params:
            if partition_of(p) is not None:
                parts.append(p)
            else:
                engine = owner(p)
                assert engine is not None  # (held)
                engines.setdefault(id(engine), (engine, []))[1].append(p)
        return parts, engines

    def __enter__(self) -> None:
        if not self.enabled:
            return
        nested = [getattr(p, "ds_id", "?") for p in self.params if getattr(p, _DEPTH, False)]
        if nested:
            raise RuntimeError("Nested GatheredParameters contexts cannot overlap parameters; parameter ds_ids "
                               f"already gathered by an outer context: {nested}")  # fmt: skip
        parts, engines = self._groups()
        values = dict(zip(map(id, parts), gather_partitions([_partition(p) for p in parts]), strict=True))
        for engine, ps in engines.values():
            values.update(zip(map(id, ps), engine.gathered_values(ps), strict=True))
        # what to put back: the stand-ins (or the engine's views), and the states
        self._kept = [(p.data, getattr(p, "ds_status", None)) for p in self.params]
        for p in self.params:
            p.data = values[id(p)]
            setattr(p, _DEPTH, True)
            if hasattr(p, "ds_status"):
                cast(Any, p).ds_status = ZeroParamStatus.AVAILABLE

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._write_back(self.modifier_rank)
        finally:
            gathered = sum(p.data.numel() * p.data.element_size() for p in self.params)
            for p, (data, status) in zip(self.params, self._kept, strict=True):
                p.data = data
                p.__dict__.pop(_DEPTH, None)
                if status is not None:
                    cast(Any, p).ds_status = status
                part = partition_of(p)
                if part is not None:
                    part.version = p._version  # (putting the stand-in back is no write to it)
            # the gathered values' pages back, every few MiB (`fzero.host.heap`): a loop over modules (transformers
            # loading a checkpoint) would otherwise leave a resident hole per module
            _HEAP.freed(gathered)

    def _write_back(self, src: int) -> None:
        parts, engines = self._groups()
        for p in self.params:  # (checked before any collective: a broadcast of another size would not pair)
            engine = owner(p)
            expected = engine._place(p).leaf.shape if engine is not None else _partition(p).shape
            if tuple(p.data.shape) != tuple(expected):
                raise ValueError(f"GatheredParameters: parameter ds_id {getattr(p, 'ds_id', '?')} now has shape "
                                 f"{tuple(p.data.shape)}, not {tuple(expected)}: its shape is fixed")  # fmt: skip
        for p in parts:  # rank `src`'s values received a chunk at a time, each rank keeping its piece
            _partition(p).assign(p.data, src=src, freed=_HEAP.freed)
        for engine, ps in engines.values():
            engine.assign_values(ps, broadcast_tensors(engine.mesh, [p.data for p in ps], src=src))


def _partition(p: Tensor) -> Partition:
    part = partition_of(p)
    assert part is not None  # (asked of partitioned parameters only)
    return part


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: `parameter` is used in `module`'s forward though `module` does not own it. fzero gathers by
    unit: at `initialize` such a parameter goes to the root unit (gathered through the step) unless `module` lies in
    the parameter's own unit. Registered after `initialize` it is accepted where it changes nothing.

    Raises:
      RuntimeError: `parameter` is not an `nn.Parameter` (DeepSpeed's message).
      NotImplementedError: registered after `initialize`, for a module outside the parameter's unit at stage 3 (the
        units are fixed then: register it before `deepspeed.initialize`).
    """
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    engine = owner(parameter)
    if engine is not None and engine.state.plan.stage == 3:
        unit = engine.state.layout.units[engine._place(parameter).leaf.unit].name
        path = next((n for n, m in engine.module.named_modules() if m is module), None)
        inside = unit == ROOT_UNIT or (path is not None and (path == unit or path.startswith(unit + ".")))
        if not inside:
            raise NotImplementedError(
                "register_external_parameter after deepspeed.initialize is not supported by fzero for a module "
                f"outside the parameter's unit {unit!r}: the units are fixed at initialize; register it before"
            )
    if not hasattr(module, EXTERNAL):
        _init_external(module)
    getattr(module, EXTERNAL)[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: undo `register_external_parameter` (before `initialize`, where it has an effect).

    Raises:
      RuntimeError: `parameter` is not an `nn.Parameter`, or not registered for `module` (DeepSpeed's messages).
    """
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    registered = getattr(module, EXTERNAL, {})
    if id(parameter) not in registered:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del registered[id(parameter)]


def _init_external(module: nn.Module) -> None:
    """DeepSpeed's attributes of a module with external parameters: `_external_params` and its two readers."""
    table: dict[int, nn.Parameter] = {}
    object.__setattr__(module, EXTERNAL, table)
    object.__setattr__(module, "ds_external_parameters", lambda: table.items())
    object.__setattr__(module, "all_parameters",
                       lambda: [*module.named_parameters(recurse=False), *table.items()])  # fmt: skip

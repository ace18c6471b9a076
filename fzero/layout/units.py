"""Unit policies: which parameters ZeRO-3 gathers together. A policy maps a parameter's name to its unit's name
(a module path, or `ROOT_UNIT` for what no unit claims); `fzero.layout.flat.from_module` lays the units out.

- `Auto()` (the default): each child of an `nn.ModuleList` is a unit (a transformer's blocks), and so is each
  module outside the list with `min_numel` elements or more of its own that no other module shares (an untied
  embedding, a language-model head); unless that would leave one unit holding most of a model of a million elements
  or more (a model without a `ModuleList`: an `nn.Sequential`, a CNN); then units follow the modules, as DeepSpeed's
  ZeRO-3 gathers each module's own parameters, with the modules under `min_numel` elements merged into the unit
  around them (`BySize(min_numel)`).
- `"module_list"`: the `ModuleList` children alone; `BySize(n)`: module subtrees of at least `n` elements;
  `"single"`: one unit; `"param"`: one unit per parameter; or any callable from a name to a unit's name.

Any choice trains to the same parameters bitwise (the same per-element arithmetic; only the gradient norm's
summation order follows the layout): the choice is how much stage 3 holds gathered at once, and how many
collectives a step makes.

    >>> import torch
    >>> model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)))
    >>> unit_of = unit_policy(model, None)
    >>> [unit_of(n) for n, _ in model.named_parameters()]
    ['0', '1', '2']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ROOT_UNIT", "Auto", "BySize", "concentrated", "module_list_units", "size_units", "unit_policy"]

ROOT_UNIT = "<root>"
_AUTO_MODEL_NUMEL = 1 << 20  # below a million elements, memory is not what the units are for: the ModuleList rule


def _check_min_numel(owner: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}(min_numel=...) needs an int >= 1, got {value!r}")


@dataclass(frozen=True)
class BySize:
    """A size-based unit policy (FSDP's size-based auto-wrap): visiting modules children first, a module whose
    parameters not yet in a unit number at least `min_numel` elements becomes a unit with all of them; what is
    left belongs to the root unit. For models without an `nn.ModuleList` (a CNN's stages and blocks).
    """

    min_numel: int

    def __post_init__(self) -> None:
        _check_min_numel("BySize", self.min_numel)


@dataclass(frozen=True)
class Auto:
    """The default unit policy: the `nn.ModuleList` children, and outside the list every module owning `min_numel`
    elements or more (counted children first) that share no parameter with another module; or, where those would
    leave one unit holding more than half of a model of at least 2**20 elements, `BySize(min_numel)`: every module
    owning `min_numel` elements or more a unit, as DeepSpeed gathers module by module.

    A language model's embedding and head are then units of their own, not part of the root unit: at stages 1-2 the
    head is gathered in the forward when its turn comes (the root unit, gathered before the first layer, waits for
    nothing else to overlap with) and its gradient is reduced as the backward starts, overlapped with it, where the
    root unit's is reduced after the backward's end (2026-11-29, a 27.3M GPT on 2 gloo ranks: stage 2's step 3-12%
    faster than with both in the root unit in four runs, stage 3's as fast and its peak 4-7% lower;
    docs/performance.md, `benchmarks/compare.py --fresh`'s `-rooted` rows). A parameter tied between two modules
    (a head sharing the embedding's weight) stays in the root unit, gathered for the whole step, since both modules
    read it.

    Attributes:
      min_numel: the smallest unit below the root, in elements; smaller modules join the unit around them. The
        default is DeepSpeed's `stage3_param_persistence_threshold` (100,000), under which DeepSpeed keeps a
        parameter gathered for the whole step; the engine passes the config's value.
    """

    min_numel: int = 100_000

    def __post_init__(self) -> None:
        _check_min_numel("Auto", self.min_numel)


def module_list_units(model: nn.Module) -> Callable[[str], str]:
    """The `ModuleList` policy: each child of an `nn.ModuleList` (the outermost, if nested) is a unit; every other
    parameter belongs to the root unit."""
    prefixes = sorted(
        (f"{name}.{child}." if name else f"{child}.")
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for child, _ in module.named_children()
    )

    def unit_of(param: str) -> str:
        for prefix in prefixes:  # sorted, so an outer list's child precedes the lists nested in it
            if param.startswith(prefix):
                return prefix[:-1]
        return ROOT_UNIT

    return unit_of


def size_units(
    model: nn.Module, min_numel: int, eligible: Callable[[str, nn.Parameter], bool] | None = None
) -> Callable[[str], str]:
    """The `BySize(min_numel)` policy (see `BySize`): parameters (trainable and frozen, tied ones once) counted
    children first; a module other than the root whose not-yet-assigned elements reach `min_numel` becomes a
    unit. With `eligible`, only the parameters it accepts (by name and tensor) count and are assigned; the others
    map to `ROOT_UNIT` here (the caller's other policy places them)."""
    assigned: dict[str, str] = {}
    seen: set[int] = {id(p) for n, p in model.named_parameters() if eligible is not None and not eligible(n, p)}

    def visit(prefix: str, module: nn.Module) -> list[tuple[str, int]]:
        """The (name, numel) of the parameters under `module` not yet in a unit."""
        loose: list[tuple[str, int]] = []
        for child_name, child in module.named_children():
            loose += visit(f"{prefix}.{child_name}" if prefix else child_name, child)
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                loose.append((f"{prefix}.{name}" if prefix else name, p.numel()))
        if prefix and sum(n for _, n in loose) >= min_numel:
            assigned.update((name, prefix) for name, _ in loose)
            return []
        return loose

    visit("", model)
    return lambda name: assigned.get(name, ROOT_UNIT)


def concentrated(sizes: Mapping[str, int]) -> str | None:
    """The unit that holds more than half of a model of at least 2**20 elements, given every unit's element count
    (trainable and frozen, tied parameters once), or None: where gathering unit by unit saves little memory."""
    total = sum(sizes.values())
    biggest = max(sizes, key=sizes.__getitem__, default=None)
    return biggest if biggest is not None and total >= _AUTO_MODEL_NUMEL and sizes[biggest] > total / 2 else None


def _module_list_and_leftovers(model: nn.Module, min_numel: int) -> Callable[[str], str]:
    """`Auto`'s first rule: the `ModuleList` children, then, of the parameters left in the root unit, those of each
    module with `min_numel` of them or more, unshared (`size_units` over the leftovers)."""
    by_list = module_list_units(model)
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # (a tied one: 2 or more)
    leftovers = size_units(model, min_numel, lambda name, p: by_list(name) == ROOT_UNIT and owners[id(p)] == 1)

    def unit_of(name: str) -> str:
        unit = by_list(name)
        return leftovers(name) if unit == ROOT_UNIT else unit

    return unit_of


def _sizes(model: nn.Module, unit_of: Callable[[str], str]) -> dict[str, int]:
    """Each unit's element count under `unit_of` (tied parameters once, frozen ones included)."""
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = unit_of(name)
        sizes[unit] = sizes.get(unit, 0) + p.numel()
    return sizes


def unit_policy(model: nn.Module, units: str | BySize | Auto | Callable[[str], str] | None) -> Callable[[str], str]:
    """The name-to-unit function of a policy (see the module's docstring); None is `Auto()`.

    Raises:
      ValueError: `units` is none of the policies.
    """
    if units is None or units == "auto":
        units = Auto()
    if isinstance(units, Auto):
        listed = _module_list_and_leftovers(model, units.min_numel)
        return size_units(model, units.min_numel) if concentrated(_sizes(model, listed)) else listed
    if units == "module_list":
        return module_list_units(model)
    if units == "single":
        return lambda name: ROOT_UNIT
    if units == "param":
        return lambda name: name
    if isinstance(units, BySize):
        return size_units(model, units.min_numel)
    if callable(units):
        return units
    raise ValueError(
        f"units must be None, 'auto', 'module_list', 'single', 'param', fzero.layout.Auto(n), "
        f"fzero.layout.BySize(n) or a callable, got {units!r}"
    )

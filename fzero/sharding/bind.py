"""Bind named tensors into a module for the whole of a forward *and* its backward.

`torch.func.functional_call` swaps tensors into a module for the duration of the call only. Activation
checkpointing (`torch.utils.checkpoint`, HF's `gradient_checkpointing_enable()`) recomputes parts of the forward
during the backward, *after* `functional_call` has put the module's own tensors back: the recompute would run
with them instead of the step's parameters (silently wrong gradients). fzero's step therefore binds the step's
tensors into the module around the forward and the backward; `functional_call` inside a user's `loss_fn` then swaps
in the same tensors and, on its way out, restores the bound ones, so every recompute sees exactly the step's
parameters.

Parameters that are not available (units gathered on demand, outside their module's forward) are bound to
`Unavailable` placeholders: reading one gets the parameter's gathered tensor where its unit can give it (stages 0-2;
at stage 3 between its module's forward and its backward), and raises an error that names it where not, instead of
computing with a stale tensor.

Since the step has bound them, `functional_call`'s swapping in and back out is work that changes nothing: `call`
skips it where the tensors it is given are exactly those bound (`bound_to`), and is `functional_call` elsewhere.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> w = torch.zeros(1, 2)
    >>> with bound(model, {"weight": w}):
    ...     model.weight is w
    True
    >>> isinstance(model.weight, torch.nn.Parameter)
    True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Unavailable", "bound", "bound_to", "call", "carry_attributes", "refuse_replaced_linear", "submodules"]

# each module's innermost binding: the mapping `bound` was given and its items as they were bound
_BOUND: weakref.WeakKeyDictionary[nn.Module, tuple[Mapping[str, Tensor], tuple[tuple[str, Tensor], ...]]] = (
    weakref.WeakKeyDictionary()
)


def submodules(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule of `model` by its path (`""`: `model`), a shared one under each of its paths: one walk of
    the tree, for looking up many tensors' owners, where `get_submodule` walks each one's path again."""
    return dict(model.named_modules(remove_duplicate=False))


def _slot(model: nn.Module, name: str, modules: Mapping[str, nn.Module]) -> tuple[dict[str, Any], str]:
    """The dict (`_parameters` or `_buffers` of the owning module) and key that hold tensor `name`; `modules` is
    `submodules(model)`."""
    owner_path, _, short = name.rpartition(".")
    module = modules.get(owner_path)
    if module is None:
        raise KeyError(f"{type(model).__name__} has no submodule {owner_path!r} (for tensor {name!r})")
    for table in (module._parameters, module._buffers):
        if short in table:
            return table, short
    raise KeyError(f"{type(model).__name__} has no parameter or buffer {name!r}")


def carry_attributes(original: Any, value: Any) -> None:
    """Give the tensor bound in a parameter's place the attributes a user (or a library) set on the parameter,
    which the module's forward may read: mup's `MuReadout` reads `self.weight.infshape`, DeepSpeed's Muon tags
    `use_muon`. Placeholders (`Unavailable`) stay bare."""
    extra = getattr(original, "__dict__", None)
    if isinstance(original, Unavailable) or isinstance(value, Unavailable) or value is original:
        return  # (a placeholder's attributes are fzero's, not the parameter's)
    if extra and isinstance(value, Tensor):
        for key, attr in extra.items():
            if not hasattr(value, key):
                setattr(value, key, attr)


@contextlib.contextmanager
def bound(model: nn.Module, tensors: Mapping[str, Tensor]) -> Iterator[None]:
    """Put `tensors` (parameter and buffer names of `model`, tied names included) in place of the module's own,
    with the parameters' own attributes (`carry_attributes`), and put the module's own back on exit, in reverse
    order. Every forward fzero runs with a step's parameters enters it, so it is where a process-wide replaced
    `linear` is refused (`refuse_replaced_linear`: DeepSpeed's stage 3 may be built after fzero's step or engine).

    Raises:
      RuntimeError: `torch.nn.functional.linear` is DeepSpeed's (`refuse_replaced_linear`).
    """
    saved: list[tuple[dict[str, Any], str, Any]] = []
    modules = submodules(model)
    refuse_replaced_linear()
    outer = _BOUND.get(model)
    try:
        for name, value in tensors.items():
            table, key = _slot(model, name, modules)
            saved.append((table, key, table[key]))
            carry_attributes(table[key], value)
            table[key] = value
        _BOUND[model] = (tensors, tuple(tensors.items()))
        yield
    finally:
        for table, key, value in reversed(saved):
            table[key] = value
        if outer is None:
            _BOUND.pop(model, None)
        else:
            _BOUND[model] = outer


def refuse_replaced_linear() -> None:
    """Refuse to run a forward through DeepSpeed's `zero3_linear_wrap`: DeepSpeed's ZeRO-3 (`deepspeed.initialize`
    at stage 3, or its `zero.Init`, with `memory_efficient_linear` on, its default) replaces
    `torch.nn.functional.linear` for the whole process, and keeps it replaced. Its arithmetic is not torch's
    (a matmul, then the bias added), so a model trained by fzero in that process would differ from plain PyTorch.

    Raises:
      RuntimeError: `torch.nn.functional.linear` is DeepSpeed's, naming the config key that stops it.
    """
    module = getattr(torch.nn.functional.linear, "__module__", None) or ""
    if module.startswith("deepspeed."):
        raise RuntimeError(
            f"torch.nn.functional.linear is DeepSpeed's {torch.nn.functional.linear.__name__} ({module}) in this "
            "process: a DeepSpeed ZeRO-3 engine or deepspeed.zero.Init made here replaced it process-wide "
            "(memory_efficient_linear), and fzero would train through it rather than torch's linear. Set "
            '"memory_efficient_linear": false in that DeepSpeed config\'s zero_optimization block, or run it in '
            "another process"
        )


def bound_to(model: nn.Module) -> Mapping[str, Tensor] | None:
    """The mapping the innermost `bound` has put into `model` now, or None outside any."""
    entry = _BOUND.get(model)
    return None if entry is None else entry[0]


def call(model: nn.Module, params: Mapping[str, Tensor], /, *args: Any, **kwargs: Any) -> Any:
    """`model(*args, **kwargs)` computed with `params` in place of its tensors: `torch.func.functional_call(model,
    params, args, kwargs)`, the same tensors and so the same result bitwise.

    Inside `fzero.train_step` and `fzero.eval_step` the `params` a `loss_fn` receives are already bound into the
    model for its forward and backward (`bound`), and `functional_call` would swap each of them in again and back
    out on return: host time per tensor per step that changes nothing. `call` then calls the model directly. Any
    other mapping (a copy, the bound one with an entry since replaced, added or removed, a call outside a step)
    goes through `functional_call`.

    Args:
      model: the module the step was built for.
      params: the named tensors (`loss_fn`'s first argument).
      args, kwargs: the forward's arguments (`model` and `params` are positional-only, so a forward may take
        keywords of those names).

    Returns:
      The forward's output.

    Example:
        >>> import torch
        >>> import fzero
        >>> model = torch.nn.Linear(2, 1)
        >>> params = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> fzero.call(model, params, torch.tensor([[1.0, 2.0]]))  # outside a step: functional_call
        tensor([[3.]])
    """
    entry = _BOUND.get(model)
    if entry is not None and entry[0] is params and _unchanged(params, entry[1]):
        return model(*args, **kwargs)
    return torch.func.functional_call(model, dict(params), args, kwargs)


def _unchanged(params: Mapping[str, Tensor], items: tuple[tuple[str, Tensor], ...]) -> bool:
    """Whether `params` holds exactly `items` still (the same names, each the same tensor object)."""
    return len(params) == len(items) and all(params.get(name) is value for name, value in items)


# what a placeholder answers without data (a property's or a method's name): a read of these gathers nothing
_METADATA = frozenset({
    "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "is_cuda", "is_cpu", "is_meta",
    "is_sparse", "is_quantized", "is_nested", "is_inference", "names", "grad", "grad_fn", "itemsize", "nbytes",
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "storage_offset", "is_contiguous", "get_device", "type", "__len__", "__hash__",
})  # fmt: skip


def _reads_data(func: Any) -> bool:
    """Whether a torch function (a property's getter: by the property's name) may read its tensors' data."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name not in _METADATA


def _real(x: Unavailable) -> Tensor:
    """The parameter's tensor where its unit gives it (`Unavailable.read`), else the placeholder."""
    real = x.read() if x.read is not None else None
    return x if real is None else real


class Unavailable(Tensor):
    """A placeholder with a parameter's shape, dtype and device, and no data, bound where a unit's parameter is not
    gathered. Its metadata is there; an operation reading its data gets the parameter's real tensor in its place
    where the unit can give it exactly (`read`: a weight read outside its module, as x-transformers' tied logits
    read the embedding's, is then the same tensor its module computes with, its gradient included), and otherwise
    raises an error that names the parameter (at stage 3, a read before the unit's forward or after its backward)."""

    param_name: str
    unit_name: str
    read: Callable[[], Tensor | None] | None

    @classmethod
    def __torch_function__(  # type: ignore[override]  # (torch's stubs type the base's as a plain attribute function)
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _reads_data(func):
            args, kwargs = torch.utils._pytree.tree_map_only(Unavailable, _real, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():  # (metadata, or a placeholder left: its dispatch raises)
            return func(*args, **kwargs)

    @staticmethod
    def __new__(
        cls,
        name: str,
        unit: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        read: Callable[[], Tensor | None] | None = None,
    ) -> Unavailable:
        t = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t.param_name, t.unit_name, t.read = name, unit, read
        return t

    def __repr__(self) -> str:  # type: ignore[override]  # Tensor's takes a keyword this class has no use for
        return f"Unavailable({self.param_name!r}, unit {self.unit_name!r}, shape {tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # (torch's stubs type the base's as a plain attribute function)
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        found = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, Unavailable)), None)
        name, unit = (found.param_name, found.unit_name) if found is not None else ("?", "?")
        raise RuntimeError(
            f"parameter {name!r} was used ({func}) outside the forward of its stage-3 unit {unit!r}: at stage 3 a "
            "unit's parameters exist while its module runs, and outside it only between its forward and its "
            "backward (gathered again there), not before its forward or after its backward. Keep that parameter "
            "in a unit that is gathered for the whole step (e.g. fzero.init(..., units=...) placing it in the root "
            "unit; in the DeepSpeed shell, deepspeed.zero.register_external_parameter(the module reading it, the "
            "parameter) before initialize), or call the module instead of reading its parameter"
        )

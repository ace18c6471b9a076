"""Sharded construction (DeepSpeed's `zero.Init`): parameters from a `meta`-device model, one unit at a time.

For each unit, the modules that own its parameters are materialised (`to_empty`) and initialised by the user's
`initializer(module)`, the unit is flattened, rank 0's values are broadcast (so ranks agree whatever their random
state), each rank keeps its shard, and the modules get their original `meta` tensors back (the model object is left
exactly as it was, ties included). The full model never exists on a rank: at most one unit (twice: the module's
tensors and the unit's flat buffer) on top of the shards.

Modules that own frozen parameters or buffers but no trainable parameter are materialised with the first unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .layout import Layout, dtype_of
from .mesh import Mesh, SimMesh

__all__ = ["sharded_parameters"]


def _owners(model: nn.Module, layout: Layout) -> list[list[nn.Module]]:
    """For each unit, the modules whose own (non-recursive) parameters or buffers it must materialise."""
    unit_of = {leaf.name: leaf.unit for leaf in layout.leaves}
    groups: list[list[nn.Module]] = [[] for _ in layout.units]
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        units = {unit_of[n] for n in names if n in unit_of}
        owns = names or list(module.named_buffers(recurse=False))
        if not owns or id(module) in seen:
            continue
        seen.add(id(module))
        groups[min(units) if units else 0].append(module)
    return groups


def sharded_parameters(
    model: nn.Module,
    layout: Layout,
    mesh: Mesh,
    initializer: Callable[[nn.Module], None],
    device: torch.device | str = "cpu",
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Each rank's shard of the trainable parameters, and the frozen parameters and buffers, of a `meta` model.

    Args:
      model: a module on the `meta` device (left unchanged).
      layout: its layout (`fzero.layout.from_module`).
      mesh: the mesh (rank 0's values are broadcast unit by unit).
      initializer: `initializer(module)` initialises the parameters and buffers a module owns directly, in place
        (e.g. `lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None`).
      device: where the shards live.

    Returns:
      `(shard, frozen, buffers)`: the shard per rank (`[shard_numel]`, or `[world, shard_numel]` on a SimMesh, in
      the layout's dtype) and per-rank frozen parameters and buffers by name.
    """
    world = layout.world
    pieces: list[Tensor] = []
    frozen: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    frozen_names = {s.name for s in layout.frozen}
    buffer_names = {s.name for s in layout.buffers}
    module_names = {id(m): n for n, m in model.named_modules()}
    for unit_index, modules in enumerate(_owners(model, layout)):
        unit = layout.units[unit_index]
        originals = [(dict(m._parameters), dict(m._buffers)) for m in modules]  # restored below: ties stay intact
        for m in modules:
            m.to_empty(device=device, recurse=False)
            with torch.no_grad():
                initializer(m)
        named = {}
        for m in modules:
            prefix = module_names[id(m)]
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                named[f"{prefix}.{n}" if prefix else n] = t
        flat = torch.zeros(unit.size, dtype=dtype_of(layout.dtype), device=device)
        with torch.no_grad():
            for leaf in layout.leaves:
                if leaf.unit == unit_index:
                    start = leaf.offset - unit.start
                    flat[start : start + leaf.numel].copy_(named[leaf.name].reshape(-1))
        flat = mesh.broadcast(mesh.replicate(flat), src=0)
        rows = flat.view(*flat.shape[:-1], world, -1)  # [(world,) world, unit shard]
        if isinstance(mesh, SimMesh):
            pieces.append(torch.stack([rows[r, r] for r in range(world)]))
        else:
            pieces.append(rows[mesh.rank].clone())
        for name, t in named.items():
            target = frozen if name in frozen_names else buffers if name in buffer_names else None
            if target is not None:
                target[name] = mesh.broadcast(mesh.replicate(t.detach().clone()), src=0)
        for m, (params, bufs) in zip(modules, originals, strict=True):
            m._parameters.update(params)
            m._buffers.update(bufs)
        del flat, rows, named
    return torch.cat(pieces, dim=-1), frozen, buffers

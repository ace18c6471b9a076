"""Model-state memory per rank, read off the actual state (to set against the ZeRO paper's formulas).

With `N` the padded parameter count, `W` the world size, fp32 master weights and Adam, a rank holds between steps:

| stage | master + Adam moments | compute copy, bf16/fp16 (fp32) | accumulator (k > 1, fp32) |
|---|---|---|---|
| 0 | 12 N | 2 N (0: the master itself) | 4 N |
| 1 | 12 N / W | 2 N / W (0) | 4 N |
| 2 | 12 N / W | 2 N / W (0) | 4 N / W |
| 3 | 12 N / W | 2 N / W (0) | 4 N / W |

Between steps every ZeRO stage keeps the compute copy as a shard; stages 1-2 gather it as the forward reaches each
unit and keep it to the end of the backward (and through an accumulation window), stage 3 frees each unit after
its forward.

(the paper's `(2 + 2 + K) Psi / N_d` counts a 16-bit gradient buffer too, which fzero only holds during a step).

Example:
    >>> import torch, fzero
    >>> state = fzero.init(torch.nn.Linear(64, 64), fzero.zero3(fzero.adamw(), precision="bf16"), fzero.SimMesh(4))
    >>> b = state_bytes(state)
    >>> (b["master"], b["optimizer"], b["compute"]) == (4 * 4160 // 4, 8 * 4160 // 4, 2 * 4160 // 4)
    True
"""

from __future__ import annotations

from typing import Any

import optree
from torch import Tensor

from ..storage import Offloaded
from .plan import Role
from .train_state import TrainState

__all__ = ["state_bytes"]

# a role's state counts under its category (the plan says which transform plays it, whatever its name or type);
# counters (0-d) are "other"
_CATEGORIES: dict[Role, str] = {"update": "optimizer", "accumulate": "accumulator"}


def state_bytes(state: TrainState) -> dict[str, int]:
    """Bytes one rank holds, by category: `master`, `compute` (not counted again where it is the master tensor
    itself), `optimizer`, `accumulator`, `frozen` (frozen parameters: all of them, or this rank's shard at stage
    3), `other` (buffers, counters, the loss scale, the random seed), `staging` (the NVMe tier's I/O buffers,
    held while an update streams through the store: mapped for it, handed back after), `total` (the sum: memory);
    `offloaded`, the bytes of the leaves kept on disk (`fzero.Offload("nvme")`;
    one version, not in the total); and `secondary`, what hpZ (`gather(secondary=axis)`) holds during a step on
    top of that, from each unit's forward to its backward: `1/S` of the compute and frozen parameters (`S` the
    axis's size), at most (units gathered for the whole step keep none), not in the total.

    Args:
      state: a `TrainState`; on a `SimMesh` the leading world axis is divided out.
    """
    per_rank = state.layout.world if state.simulated else 1
    seen: set[tuple[int, Any]] = set()
    out = dict.fromkeys(("master", "compute", "optimizer", "accumulator", "frozen", "other", "staging"), 0)
    offloaded, stores = 0, {}

    def add(category: str, t: Tensor | Offloaded) -> None:
        nonlocal offloaded
        if isinstance(t, Offloaded):
            if (id(t.store), t.name) not in seen:
                seen.add((id(t.store), t.name))
                offloaded += t.nbytes // (per_rank if t.store.stacked else 1)
                stores[id(t.store)] = t.store
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return
        seen.add(key)
        out[category] += t.numel() * t.element_size() // (per_rank if t.ndim and t.shape[0] == per_rank else 1)

    add("master", state.params)
    if state.compute is not None:
        add("compute", state.compute)

    def walk(node: Any, category: str) -> None:
        for leaf in optree.tree_leaves(node, namespace="fzero"):
            if isinstance(leaf, (Tensor, Offloaded)):  # a leaf that is neither (a number) holds no memory
                add(category if leaf.ndim else "other", leaf)

    for role, category in _CATEGORIES.items():
        walk(state.plan.state_of(state.tx_state, role), category)
    walk(state.tx_state, "other")  # the rest (seen tensors are not counted twice)
    if state.frozen is not None:
        add("frozen", state.frozen)
    for rest in (state.buffers, state.step, state.seed):
        walk(rest, "other")
    out["staging"] = sum(s.staging_bytes // (per_rank if s.stacked else 1) for s in stores.values())
    out["total"] = sum(out.values())
    out["offloaded"] = offloaded
    out["secondary"] = 0
    if state.plan.gather_spec.secondary is not None:
        size = state.plan.state_of(state.tx_state, "gather").secondary_size
        out["secondary"] = state.layout.numel * state.plan.compute_dtype.itemsize // size
        frozen_layout = state.layout.frozen_layout
        if frozen_layout is not None and state.frozen is not None:
            out["secondary"] += frozen_layout.numel * (state.frozen_dtype or state.frozen.dtype).itemsize // size
    return out

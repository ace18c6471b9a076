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

import optree
from torch import Tensor

from .optim import AdamState
from .optim.sgd import SGDState
from .state import TrainState
from .transforms import AccumulateState

__all__ = ["state_bytes"]

# a transform's state counts by its type (whatever the transform is called in the chain), or, for an optimizer of
# the user's own whose state type fzero cannot know, by the name `shard_update` gives it; counters (0-d) are "other"
_KINDS: tuple[tuple[type, str], ...] = (
    (AccumulateState, "accumulator"),
    (AdamState, "optimizer"),
    (SGDState, "optimizer"),
)
_CATEGORIES = {"shard_update": "optimizer"}


def state_bytes(state: TrainState) -> dict[str, int]:
    """Bytes one rank holds, by category: `master`, `compute` (not counted again where it is the master tensor
    itself), `optimizer`, `accumulator`, `frozen` (frozen parameters: all of them, or this rank's shard at stage
    3), `other` (buffers, counters, the loss scale, the random seed), `total`.

    Args:
      state: a `TrainState`; on a `SimMesh` the leading world axis is divided out.
    """
    per_rank = state.layout.world if state.simulated else 1
    seen: set[tuple[int, int]] = set()
    out = dict.fromkeys(("master", "compute", "optimizer", "accumulator", "frozen", "other"), 0)

    def add(category: str, t: Tensor) -> None:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return
        seen.add(key)
        out[category] += t.numel() * t.element_size() // (per_rank if t.ndim and t.shape[0] == per_rank else 1)

    add("master", state.params)
    if state.compute is not None:
        add("compute", state.compute)

    def walk(node: object, category: str) -> None:
        for leaf in optree.tree_leaves(node, namespace="fzero"):
            if isinstance(leaf, Tensor):  # a leaf that is no tensor (a number in a custom state) holds no memory
                add(category if leaf.ndim else "other", leaf)

    def walk_chain(tx_state: object) -> None:
        if not isinstance(tx_state, dict):
            walk(tx_state, "other")
            return
        for name, sub in tx_state.items():
            category = next((c for kind, c in _KINDS if isinstance(sub, kind)), None) or _CATEGORIES.get(
                name.split("#")[0]
            )
            walk(sub, category) if category else walk_chain(sub)

    walk_chain(state.tx_state)
    if state.frozen is not None:
        add("frozen", state.frozen)
    for rest in (state.buffers, state.step, state.seed):
        walk(rest, "other")
    out["total"] = sum(out.values())
    return out

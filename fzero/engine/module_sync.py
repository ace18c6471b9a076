"""`ModuleSync`: the user's model kept showing the engine's state.

The engine trains a `TrainState` of flat buffers; DeepSpeed scripts read the model itself (`engine.module`). After
every step the module's parameters are pointed at views of this rank's compute parameters (stages 0-2, no copy;
stages 1-2 all-gather them once per update) or emptied (stage 3, where they are sharded, as DeepSpeed leaves them),
and its buffers at the state's. `module_state_dict()` gives the consolidated parameters whatever the stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..layout import unflatten
from ..mesh import RankMesh
from ..state import TrainState
from ..step import state_dict as consolidated
from ..step.microstep import compute_params
from ..storage import Offloaded

__all__ = ["ModuleSync"]


class ModuleSync:
    """The module's parameters and buffers as views of the engine's state, for `fzero.Engine`.

    The engine runs one rank per process, on that rank's view of the mesh (`fzero.mesh.ranks.rank_view`): its
    per-rank values are its own.
    """

    state: TrainState
    mesh: RankMesh
    # stages 1-2: (the state's compute shard, its all-gather), valid until the next update (a donated update changes
    # the shard in place: then the shard is None, and the buffer is refilled in place)
    _gathered: tuple[Tensor | None, Tensor] | None

    if TYPE_CHECKING:  # (the engine's)

        @property
        def module(self) -> nn.Module: ...

    def _compute(self) -> Tensor | None:
        """This rank's full compute parameters for the next forward, or None at stage 3 (gathered unit by unit).
        At stages 1-2 the state keeps them sharded: they are all-gathered once per update (what DeepSpeed does after
        its step), so that `engine.module` holds them, and kept for the micro-steps of the accumulation window."""
        state = self.state
        compute = state.compute if state.compute is not None else state.params
        if isinstance(compute, Offloaded):  # the copy on disk: read unit by unit
            return None
        if not state.plan.sharded_at_rest:
            return compute
        if not state.plan.keep_gathered:
            return None
        if self._gathered is None or self._gathered[0] is not compute:  # stale after every update (see step)
            # refilled in place: the module's parameters are views of it, so a new buffer would hold the model
            # twice while they still point at the old one
            old = None if self._gathered is None else self._gathered[1]
            self._gathered = (compute, compute_params(state, self.mesh, out=old))
        return self._gathered[1]

    def _sync_module(self) -> None:
        """Point the module's parameters at the state's compute parameters (stages 0-2; no copy), empty them at
        stage 3 (they are sharded), and its buffers at the state's."""
        state = self.state
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            # the frozen parameters show where they are whole (not sharded at rest)
            frozen = None if state.plan.sharded_at_rest else state.frozen
            for lay, flat in ((state.layout, self._compute()), (state.layout.frozen_layout, frozen)):
                if lay is None:
                    continue
                full = flat is not None
                views = unflatten(lay, flat) if flat is not None else {}
                for leaf in lay.leaves:
                    p = named[leaf.name]
                    p.data = views[leaf.name] if full else torch.empty(0, dtype=p.dtype, device=p.device)
            module_buffers = dict(self.module.named_buffers())
            for name, value in self.state.buffers.items():
                if name in module_buffers:
                    module_buffers[name].data = value

    def module_state_dict(self) -> dict[str, Tensor]:
        """The consolidated parameters (fp32 master), frozen parameters and buffers: what the model's
        `load_state_dict` accepts. At stage 3 on several processes this all-gathers: call it on every rank."""
        # (`fzero.state_dict` uses the mesh only where the ranks run in processes of their own)
        return consolidated(self.state, self.mesh)

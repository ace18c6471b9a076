"""`ModelSave`: DeepSpeed's `engine.save_16bit_model`, the model's weights in the compute dtype in one file.

DeepSpeed pickles them (`torch.save` to ``pytorch_model.bin``); fzero never pickles: the same tensors go into a
safetensors file. A pickle's name is given the safetensors name beside it (`safetensors_name`): DeepSpeed's default
``pytorch_model.bin`` becomes ``model.safetensors`` (the pair Hugging Face's `from_pretrained` looks for), any other
``NAME.bin`` / ``.pt`` / ``.pth`` becomes ``NAME.safetensors``; another name is kept. The tensors are DeepSpeed's:
every parameter (frozen ones too, unless excluded) in the compute dtype (fp32, bf16 or fp16: the master weights
rounded as the forward sees them), the persistent buffers as they are, tied parameters under each name (each a
copy: safetensors has no aliasing); `safetensors.torch.load_file(path)` feeds `model.load_state_dict`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..checkpoint.coord import Coordinator
from ..checkpoint.safetensors_io import TensorSpec, write_safetensors
from ..config import Config
from ..mesh import RankMesh
from ..state import TrainState
from ..state.precision import Policy

__all__ = ["ModelSave", "safetensors_name"]

_PICKLES = (".bin", ".pt", ".pth")


def safetensors_name(filename: str) -> str:
    """The safetensors file written for DeepSpeed's `save_filename` (see the module docstring)."""
    if filename == "pytorch_model.bin":
        return "model.safetensors"
    stem, suffix = os.path.splitext(filename)
    return stem + ".safetensors" if suffix in _PICKLES else filename


class ModelSave:
    """`save_16bit_model` (and its old name `save_fp16_model`), for `fzero.Engine`."""

    config: Config
    state: TrainState
    mesh: RankMesh
    monitor: Any
    global_steps: int
    _policy: Policy

    if TYPE_CHECKING:  # (the engine's)

        def module_state_dict(self) -> dict[str, Tensor]: ...

    def _16bit_state_dict(self, exclude_frozen_parameters: bool) -> dict[str, Tensor]:
        """The weights as DeepSpeed's 16-bit module holds them (see the module docstring). On several processes
        where the parameters are sharded this all-gathers: every rank calls it."""
        layout = self.state.layout
        frozen = {leaf.name for leaf in layout.frozen_layout.leaves} if layout.frozen_layout is not None else set()
        frozen |= {alias for alias, name in layout.aliases if name in frozen}
        params = {leaf.name for leaf in layout.leaves} | {alias for alias, _ in layout.aliases} | frozen
        dtype = self._policy.compute_dtype
        out = {}
        for name, t in self.module_state_dict().items():
            if exclude_frozen_parameters and name in frozen:
                continue
            cast = name in params and dtype is not None and t.is_floating_point()
            out[name] = t.to(dtype) if cast else t
        return out

    def save_16bit_model(
        self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:  # fmt: skip
        """DeepSpeed's `save_16bit_model`: the weights in the compute dtype, as safetensors (see the module
        docstring), written by rank 0. Every rank calls it (the parameters may be gathered).

        Args:
          save_dir: the directory (created if needed).
          save_filename: DeepSpeed's file name; a pickle's name is written as its safetensors name.
          exclude_frozen_parameters: leave out the parameters that do not require gradients.

        Returns:
          True when the file was written; False, writing nothing, at stage 3 without
          `stage3_gather_16bit_weights_on_model_save` (as DeepSpeed, which would not gather the weights).
        """
        path = Path(save_dir) / safetensors_name(save_filename)
        zero = self.config["zero_optimization"]
        if self.config.stage == 3 and not zero["stage3_gather_16bit_weights_on_model_save"]:
            if self.mesh.rank == 0:
                self.monitor.printer(
                    f"fzero: did not save the model {path} because stage3_gather_16bit_weights_on_model_save is False"
                )
            return False
        tensors = self._16bit_state_dict(exclude_frozen_parameters)
        error: BaseException | None = None
        if self.mesh.rank == 0:
            try:
                _write(path, tensors, {"format": "pt", "fzero.global_steps": str(self.global_steps)})
            except Exception as e:  # the other ranks raise it too (below)
                error = e
        if len(self.mesh.local_ranks) != self.mesh.world:  # ranks in processes of their own: they learn the verdict
            Coordinator(self.mesh, True, self.mesh.world, self.state.params.device).agree(error, "save_16bit_model")
        elif error is not None:
            raise error
        return True

    def save_fp16_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Tensor] | None:
        """DeepSpeed's (Accelerate's `get_state_dict` calls it at stage 3): the 16-bit weights on rank 0, None on
        the other ranks; every rank calls it.

        Raises:
          ValueError: not stage 3, as DeepSpeed.
        """
        if self.config.stage != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        tensors = self._16bit_state_dict(exclude_frozen_parameters)
        return tensors if self.mesh.rank == 0 else None


def _write(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """`tensors` as one safetensors file at `path`, appearing whole (written beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    specs = [TensorSpec(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write_safetensors(tmp, specs, lambda i: tensors[names[i]], metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

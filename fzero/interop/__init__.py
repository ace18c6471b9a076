"""Where fzero meets other tools' files: DeepSpeed ZeRO checkpoints in, PyTorch DCP (FSDP2) both ways, Hugging Face
model folders out.

May import: `fzero.layout`, `fzero.mesh`, `fzero.checkpoint`, `fzero.engine`.
"""

from .dcp import export_dcp, import_dcp
from .deepspeed import import_deepspeed
from .ds_files import UnsafeCheckpointError
from .ds_state import DeepSpeedState, read_deepspeed
from .hf import export_hf

__all__ = [
    "DeepSpeedState",
    "UnsafeCheckpointError",
    "export_dcp",
    "export_hf",
    "import_dcp",
    "import_deepspeed",
    "read_deepspeed",
]

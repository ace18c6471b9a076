"""Where fzero meets other tools' files: DeepSpeed ZeRO checkpoints in, Hugging Face model folders out.

May import: `fzero.layout`, `fzero.mesh`, `fzero.checkpoint`, `fzero.engine`.
"""

from .deepspeed import import_deepspeed
from .ds_files import UnsafeCheckpointError
from .ds_state import DeepSpeedState, read_deepspeed
from .hf import export_hf

__all__ = ["DeepSpeedState", "UnsafeCheckpointError", "export_hf", "import_deepspeed", "read_deepspeed"]

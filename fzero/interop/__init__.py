"""Where fzero meets other tools' files: DeepSpeed ZeRO checkpoints in, and plain state dicts out.

May import: `fzero.layout`, `fzero.mesh`, `fzero.checkpoint`, `fzero.engine`.
"""

from .deepspeed import import_deepspeed
from .ds_files import UnsafeCheckpointError
from .ds_state import DeepSpeedState, read_deepspeed

__all__ = ["DeepSpeedState", "UnsafeCheckpointError", "import_deepspeed", "read_deepspeed"]

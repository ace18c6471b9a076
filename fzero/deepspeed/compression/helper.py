"""`deepspeed.compression.helper`: DeepSpeed 0.19.8's deprecated shim, kept with its `FutureWarning` on import;
`recursive_getattr` and `recursive_setattr` live in `fzero.deepspeed.utils.module_utils`."""

from __future__ import annotations

import warnings

from ..utils.module_utils import recursive_getattr, recursive_setattr

warnings.warn(
    "deepspeed.compression.helper is deprecated; import recursive_getattr and recursive_setattr from "
    "deepspeed.utils.module_utils instead. See https://github.com/deepspeedai/DeepSpeed/issues/8489",
    FutureWarning,
    stacklevel=2,
)

__all__ = ["recursive_getattr", "recursive_setattr"]

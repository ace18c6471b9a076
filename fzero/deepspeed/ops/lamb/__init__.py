"""`deepspeed.ops.lamb`: DeepSpeed's `FusedLamb` over `fzero.lamb`."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

"""`deepspeed.ops.adagrad`: DeepSpeed's `DeepSpeedCPUAdagrad` over `fzero.cpu_adagrad`."""

from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]

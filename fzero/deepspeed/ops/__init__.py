"""`deepspeed.ops`: DeepSpeed's optimizer classes, over fzero's functional optimizers.

    from fzero.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam    # was: from deepspeed.ops.adam import ...
    from fzero.deepspeed.ops.lamb import FusedLamb
    from fzero.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from fzero.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from fzero.deepspeed.ops.random_ltd import gpt_sample_tokens, GatherTokens   # random-LTD's token ops, in torch

Each is a `torch.optim.Optimizer` with DeepSpeed's constructor and state keys, whose `step()` is the fzero optimizer
the matching config `optimizer` block runs (`optimizer.FunctionalOptimizer`); passed to `fzero.initialize` as the
optimizer, the engine runs that optimizer on its shards:

| DeepSpeed | config block | fzero |
|---|---|---|
| `DeepSpeedCPUAdam(adamw_mode=True / False)` | `Adam` | `cpu_adamw` / `cpu_adam` |
| `FusedAdam(adam_w_mode=True / False)` | `Adam` | `adam(w)(fused=True)`: in CPU memory `cpu_adam(w)` |
| `FusedLamb` | `Lamb` | `lamb` |
| `DeepSpeedCPULion`, `FusedLion` | `Lion` | `cpu_lion`; `FusedLion` elsewhere `lion` |
| `DeepSpeedCPUAdagrad` | `Adagrad` | `cpu_adagrad` |

DeepSpeed's kernels themselves (`op_builder`, `transformer`, the quantizers, async I/O, ...) are not part of fzero:
their names raise `NotImplementedError` saying what to use instead.
"""

from typing import Any

from ..refusal import refuse
from . import adagrad, adam, lamb, lion, random_ltd

__all__ = ["adagrad", "adam", "lamb", "lion", "random_ltd"]

_KERNELS = "DeepSpeed's CUDA / C++ kernels are not part of fzero"
_UNSUPPORTED = {
    "op_builder": "fzero builds its only native code, the CPU optimizer kernels, with cffi on first use "
    "(fzero.native); there are no DeepSpeed ops to build or load",
    "transformer": f"{_KERNELS}: use the model's own layers (torch.nn.TransformerEncoderLayer, or your model's)",
    "DeepSpeedTransformerLayer": f"{_KERNELS}: use the model's own layers (torch.nn.TransformerEncoderLayer, or "
    "your model's)",
    "DeepSpeedTransformerConfig": f"{_KERNELS}: use the model's own layers and their configuration",
    "fp_quantizer": f"{_KERNELS}: ZeRO++'s quantized collectives are the config's zero_quantized_weights / "
    "zero_quantized_gradients (fzero.zero3(qwz=..., qgz=...))",
    "quantizer": f"{_KERNELS}: ZeRO++'s quantized collectives are the config's zero_quantized_weights / "
    "zero_quantized_gradients (fzero.zero3(qwz=..., qgz=...))",
    "aio": "fzero's NVMe tier does its own I/O (fzero.storage): the config's offload_optimizer.device 'nvme'",
    "gds": "GPUDirect Storage is not supported by fzero: its NVMe tier (offload_optimizer.device 'nvme') reads and "
    "writes through host memory",
    "pin_memory": "fzero keeps host buffers itself (fzero.hostmem); there is no op to load",
    "sparse_attention": f"{_KERNELS}: use torch.nn.functional.scaled_dot_product_attention",
    "triton_ops": f"{_KERNELS}: use torch.nn.functional.scaled_dot_product_attention or torch.compile",
    "deepspeed4science": f"{_KERNELS}: DeepSpeed4Science's attention kernels are not supported",
    "compile": f"{_KERNELS}: compile the model with torch.compile",
    "__compatible_ops__": "fzero has no DeepSpeed ops to probe: its optimizers are in fzero.deepspeed.ops.adam, "
    "lamb, lion and adagrad",
}


def __getattr__(name: str) -> Any:
    return refuse(__name__, name, _UNSUPPORTED)

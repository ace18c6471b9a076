"""What a run reports: throughput and TFLOPS, the console line, JSONL records, the loss curve (`log`), and
DeepSpeed's monitors: TensorBoard, Weights & Biases, CSV, Comet (`monitors`).

May import: nothing of fzero.
"""

from .log import (
    Monitor,
    Throughput,
    format_line,
    plot_loss_curve,
    read_jsonl,
    transformer_flops,
)

__all__ = [
    "Monitor",
    "Throughput",
    "format_line",
    "plot_loss_curve",
    "read_jsonl",
    "transformer_flops",
]

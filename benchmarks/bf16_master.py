"""The error bf16 master weights cost (`fzero.optim.stored_in`, DeepSpeed's `bf16_master_weights_and_grads`) against
float32 master weights, both with bf16 compute, measured against full-batch float32 `torch.optim.AdamW`: the
scenario of `tests/test_bf16_master.py` (an MLP 6-5-3, ZeRO-2, 3 steps at lr 1e-2, worlds 1-3).

    PYTHONPATH=. .venv/bin/python benchmarks/bf16_master.py
"""

from __future__ import annotations

import torch

import fzero
from fzero.optim import stored_in
from tests.support import mlp, reference_run, regression_batches, regression_loss
from tests.test_bf16_master import _policy, train


def main() -> None:
    print("world  master  max |w - w_ref|  mean |w - w_ref| / mean |w_ref - w_0|")
    for world in (1, 2, 3):
        model = mlp([6, 5, 3], 0)
        start = model.state_dict()
        batches = regression_batches(model, world, 1, 2, 3, 0)
        ref = reference_run(model, regression_loss, batches, 1, lambda p: torch.optim.AdamW(p, lr=1e-2))
        moved = sum((ref[k].double() - start[k].double()).abs().sum().item() for k in ref)
        runs = {
            "bf16": train("zero2", world, batches, model, stored_in(fzero.adamw(1e-2), torch.bfloat16), _policy()),
            "fp32": train("zero2", world, batches, model, fzero.adamw(1e-2), "bf16"),
        }
        for name, state in runs.items():
            got = fzero.state_dict(state)
            diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
            mean = sum((got[k].double() - ref[k].double()).abs().sum().item() for k in ref) / moved
            print(f"{world:5d}  {name:6s}  {diff:15.2e}  {mean:10.2%}")


if __name__ == "__main__":
    main()

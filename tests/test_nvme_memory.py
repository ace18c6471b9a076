"""The NVMe tier's host memory during the steps: bounded by what a step must hold, not by what it passed through.

One fresh process (a subprocess: the resident set must be this run's alone, with glibc's allocator as a user has
it, no `MALLOC_*` variable, no `fzero.hostmem` call) trains a stack of square bias-free `Linear` layers through
`fzero.initialize` from a DeepSpeed config with `offload_optimizer` and `offload_param` on `nvme` (stage 3, fp32
AdamW, one rank), and samples its anonymous resident memory (`RssAnon`) every 2 ms and after every step.

What a step must hold beyond what the process held once `initialize` returned, derived from the sizes:

- the gradient shard: 4 bytes a parameter (fp32, one rank: the whole gradient);
- the store's staging buffers while the update streams (`Store.staging_bytes`: buffers x chunk x 16 bytes);
- a few units at once: the one computing, the one read ahead, each one's gathered copy, its weight gradient, its
  reduction and the collectives' copies: `UNITS_IN_FLIGHT` units of 4 bytes an element;
- `SLACK` for the interpreter, autograd and the activations (a micro-batch of 8 rows: kilobytes).

Before the fix the peak was that plus what the step had freed and the process kept: every unit's spare buffer (the
whole compute shard, held through the update) and the C heap's holes (a unit's size a unit, growing step after step),
about twice the bound at this size. The second check is that nothing accumulates: after each update the resident
memory is back within a unit or two of where the first update left it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

LAYERS, WIDTH, STEPS = 12, 512, 5  # 3.1M parameters in 12 units of 1 MiB (fp32)
UNITS_IN_FLIGHT = 8
SLACK = 24 << 20
MiB = 1 << 20

WORKER = textwrap.dedent(
    """
    import json, os, sys, tempfile, threading
    import torch, torch.nn.functional as F
    import fzero

    def anon():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    layers, width, steps, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(m for _ in range(layers)
                                  for m in (torch.nn.Linear(width, width, bias=False), torch.nn.ReLU())))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path},
                                    "offload_param": {"device": "nvme", "nvme_path": path}},
              "steps_per_print": 10**9}
    engine, *_ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    state = fzero.state_bytes(engine.state)
    staging = engine.state.params.store.staging_bytes  # (one store: the master, Adam's moments, the compute copy)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], anon())

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)) for _ in range(steps)]
    base = anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    after, losses = [], []
    for x, y in data:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        after.append(anon())
        peak[0] = max(peak[0], after[-1])
        losses.append(loss.item())
    stop.set()
    thread.join()
    if hasattr(engine, "close"):
        engine.close()
    print(json.dumps({"base": base, "peak": peak[0], "after": after, "staging": staging,
                      "numel": engine.state.layout.numel, "losses": losses,
                      "offloaded": state["offloaded"]}))
    """
)


@pytest.mark.timeout(120)
def test_nvme_steps_hold_gradient_staging_and_a_few_units(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(LAYERS), str(WIDTH), str(STEPS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
        env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    numel, unit = r["numel"], WIDTH * WIDTH * 4
    assert numel == LAYERS * WIDTH * WIDTH
    gradient = 4 * numel
    bound = gradient + r["staging"] + UNITS_IN_FLIGHT * unit + SLACK
    grown = r["peak"] - r["base"]
    assert grown <= bound, (
        f"the steps' peak RssAnon grew {grown / MiB:.1f} MiB over initialize's end, more than the gradient "
        f"{gradient / MiB:.0f} + staging {r['staging'] / MiB:.0f} + {UNITS_IN_FLIGHT} units "
        f"{UNITS_IN_FLIGHT * unit / MiB:.0f} + slack {SLACK / MiB:.0f} MiB"
    )
    # nothing accumulates from one step to the next (each update hands back what the step passed through)
    first = r["after"][0]
    drift = max(r["after"][1:]) - first
    assert drift <= 2 * unit, f"RssAnon after each update: {[round(a / MiB, 1) for a in r['after']]} MiB"
    assert all(loss == loss for loss in r["losses"])  # (finite: the run trained)

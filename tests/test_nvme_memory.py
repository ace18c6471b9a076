"""The NVMe tier's host memory during `initialize` and the steps: bounded by what each must hold, not by the state.

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

What `initialize` must hold beyond what the process held with the model built (the model itself is the user's):

- the store's staging buffers while `nvme_init` streams the shard to disk;
- a few units at once: the unit being flattened, its shard piece, the heap's pages not yet handed back
  (`UNITS_AT_INIT` units);
- `INIT_SLACK` for the objects made (no step has run: no activations, no autograd).

Not the fp32 shard (4 bytes a parameter, 24 MiB here, 28 MiB with the staging and the units: more than the whole
bound), which `fzero.init` builds in a file
under the NVMe path (`fzero.storage.Spill`), each unit's pages dropped once written; before, it sat in memory
beside the model and the staging buffers.

Before the fix the steps' peak was that plus what the step had freed and the process kept: every unit's spare buffer
(the whole compute shard, held through the update) and the C heap's holes (a unit's size a unit, growing step after
step), about twice the bound at this size. The second check is that nothing accumulates: after each update the resident
memory is back within a unit or two of where the first update left it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

LAYERS, WIDTH, STEPS = 24, 512, 5  # 6.3M parameters in 24 units of 1 MiB (fp32): a 24 MiB shard
UNITS_IN_FLIGHT = 8
SLACK = 24 << 20
UNITS_AT_INIT = 4  # the unit flattened, its shard piece, their pages not yet handed back (every 2 MiB freed)
INIT_SLACK = 8 << 20  # the store's, the layout's and the engine's objects (measured: 2 MiB over staging + units)
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
    class Peak:  # RssAnon's peak from now until stop(), sampled every 2 ms
        def __init__(self):
            self.base = self.peak = anon()
            self.done = threading.Event()
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()

        def run(self):
            while not self.done.wait(0.002):
                self.peak = max(self.peak, anon())

        def stop(self):
            self.done.set()
            self.thread.join()
            self.peak = max(self.peak, anon())
            return self.peak

    watch = Peak()
    engine, *_ = fzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_base, init_peak = watch.base, watch.stop()
    del model
    state = fzero.state_bytes(engine.state)
    staging = engine.state.params.store.staging_bytes  # (one store: the master, Adam's moments, the compute copy)

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)) for _ in range(steps)]
    watch = Peak()
    base, after, losses = watch.base, [], []
    for x, y in data:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        after.append(anon())
        losses.append(loss.item())
    peak = watch.stop()
    if hasattr(engine, "close"):
        engine.close()
    print(json.dumps({"base": base, "peak": peak, "after": after, "staging": staging,
                      "init_base": init_base, "init_peak": init_peak,
                      "numel": engine.state.layout.numel, "losses": losses,
                      "offloaded": state["offloaded"]}))
    """
)


@pytest.mark.timeout(120)
def test_nvme_initialize_and_steps_hold_what_they_must(tmp_path):
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
    # initialize: the staging buffers and a few units over the built model, not the shard (4 bytes a parameter)
    init_bound = r["staging"] + UNITS_AT_INIT * unit + INIT_SLACK
    assert r["staging"] + 4 * numel > init_bound  # (so the bound catches the shard in memory beside the staging)
    init_grown = r["init_peak"] - r["init_base"]
    assert init_grown <= init_bound, (
        f"initialize's peak RssAnon grew {init_grown / MiB:.1f} MiB over the built model, more than staging "
        f"{r['staging'] / MiB:.0f} + {UNITS_AT_INIT} units {UNITS_AT_INIT * unit / MiB:.0f} + slack "
        f"{INIT_SLACK / MiB:.0f} MiB (the fp32 shard is {4 * numel / MiB:.0f} MiB)"
    )
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


def test_init_release_and_spill_keep_the_values_bitwise(tmp_path):
    """`fzero.init(..., release=True)` under the NVMe tier: the model's parameters are emptied as their units go into
    the state (built in a file under the tier's path, `fzero.storage.Spill`, on a 2-rank `SimMesh`: two rows), and
    the state holds exactly the values a plain in-memory init holds."""
    import torch

    import fzero

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    mesh = fzero.SimMesh(2)
    ref = fzero.state_dict(fzero.init(model(), fzero.zero3(fzero.adamw()), mesh), mesh)
    built = model()
    tx = fzero.zero3(fzero.cpu_adamw(), offload=fzero.Offload("nvme", params="nvme", path=str(tmp_path)))
    state = fzero.init(built, tx, mesh, release=True)
    assert [p.numel() for p in built.parameters()] == [0, 0, 0, 0]
    got = fzero.state_dict(state, mesh)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert [p.name for p in tmp_path.iterdir()] == [state.params.store.scratch.path.name]  # (the spill file is gone)

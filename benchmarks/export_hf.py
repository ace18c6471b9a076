"""Peak memory of `fzero.interop.export_hf` against the unit and shard sizes.

A Llama of 8 layers of hidden 1024 / intermediate 4096 (one unit per layer: 64 MiB fp32 each, 520 MiB in all) is
initialised (fzero.zero0 + SGD, SimMesh(1)) and saved; then, in a fresh process each, the export runs with several
--max-shard-size values while a thread samples the process's RssAnon every 2 ms; for comparison, the path without
export-hf: consolidate, load_state_dict into the model, save_pretrained.

    PYTHONPATH=. .venv/bin/python benchmarks/export_hf.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.procmem import PeakRss, rss_anon


def peak(fn):
    """`fn()`'s peak anonymous memory over the start (MiB) and its seconds."""
    base, watch = rss_anon(), PeakRss(0.002)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return (watch.stop() - base) / 2**20, seconds


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)  # fmt: skip


def make(work: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    import fzero

    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.config.save_pretrained(f"{work}/config")
    state = fzero.init(model, fzero.zero0(fzero.sgd(1e-2)), fzero.SimMesh(1))
    fzero.save(state, f"{work}/ckpt")
    lay = state.layout if hasattr(state, "layout") else None
    print("units (MiB):", [round(u.size * 4 / 2**20, 1) for u in lay.units] if lay else "?", flush=True)


def measure(work: str, how: str, size: str) -> None:
    import torch  # noqa: F401  (imported before the baseline: only the export's own memory is measured)
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM

    import fzero
    from fzero.interop.hf import export_hf

    out = f"{work}/out-{how}-{size}"
    if how == "export_hf":
        mib, s = peak(lambda: export_hf(f"{work}/ckpt", out, config=f"{work}/config", max_shard_size=size))
    else:

        def naive():
            model = LlamaForCausalLM(config())
            model.load_state_dict(fzero.consolidate(f"{work}/ckpt"))
            model.save_pretrained(out, max_shard_size=size)

        mib, s = peak(naive)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    biggest = max(os.path.getsize(f"{out}/{f}") for f in files) / 2**20
    print(json.dumps({"how": how, "max_shard_size": size, "files": len(files), "largest_file_mib": round(biggest),
                      "peak_rss_anon_mib": round(mib), "seconds": round(s, 2)}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None)
    parser.add_argument("--measure", nargs=2, default=None)
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="hf_memory")
    if args.measure:
        measure(work, *args.measure)
        return
    make(work)
    for how, size in [("export_hf", "50GB"), ("export_hf", "200MB"), ("export_hf", "50MB"),
                      ("save_pretrained", "50GB")]:  # fmt: skip
        subprocess.run([sys.executable, __file__, "--dir", work, "--measure", how, size], check=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip


if __name__ == "__main__":
    main()

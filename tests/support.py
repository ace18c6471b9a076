"""Models, data and the plain single-process reference the property tests compare against."""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fzero.examples.gpt import GPT, GPTConfig


def mlp(widths: list[int], seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def tiny_gpt(seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)).to(dtype)


def regression_loss(model: nn.Module):
    def loss_fn(params, batch):
        out = torch.func.functional_call(model, params, (batch["x"],))
        return F.mse_loss(out, batch["y"])

    return loss_fn


def lm_loss(model: nn.Module):
    def loss_fn(params, batch):
        logits = torch.func.functional_call(model, params, (batch["x"],))
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    return loss_fn


def regression_batches(model: nn.Module, world: int, micro: int, per_rank: int, steps: int, seed: int):
    """`steps * micro` batches `{x, y}` of shape `[world, per_rank, ...]`."""
    g = torch.Generator().manual_seed(seed)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    dtype = first.weight.dtype
    return [
        {
            "x": torch.randn(world, per_rank, first.in_features, generator=g).to(dtype),
            "y": torch.randn(world, per_rank, last.out_features, generator=g).to(dtype),
        }
        for _ in range(steps * micro)
    ]


def lm_batches(model: GPT, world: int, micro: int, per_rank: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    out = []
    for _ in range(steps * micro):
        toks = torch.randint(0, c.vocab_size, (world, per_rank, c.seq_len + 1), generator=g)
        out.append({"x": toks[..., :-1], "y": toks[..., 1:]})
    return out


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names of `a`'s tensors that are not bitwise those of `b`."""
    return [k for k in a if not torch.equal(a[k], b[k])]


def reference_run(model: nn.Module, loss_of, batches, micro: int, make_opt) -> dict[str, torch.Tensor]:
    """Plain single-process training on the full batch: every rank's and micro-step's examples of one step
    concatenated, `loss.backward()`, `opt.step()`."""
    ref = copy.deepcopy(model)
    opt = make_opt(ref.parameters())
    loss_fn = loss_of(ref)
    params = dict(ref.named_parameters())
    for i in range(0, len(batches), micro):
        group = batches[i : i + micro]
        full = {k: torch.cat([b[k].flatten(0, 1) for b in group]) for k in group[0]}
        opt.zero_grad()
        loss_fn({**params, **dict(ref.named_buffers())}, full).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def proc_status(key: str) -> int:
    """A size from this process's /proc/self/status (`VmHWM`, `VmRSS`, `RssAnon`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")

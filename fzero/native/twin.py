"""The pure-torch twin of the C kernels: the same signatures and the same float32 scalars, in torch operations.

It runs wherever the compiled extension is missing (no compiler at install time) or when asked for with
`FZERO_ISA=torch`. For Adam its operation order is torch's (`mul`, `add`, `addcmul`, `addcdiv`), not the kernel's
fused multiply-adds, so it agrees with the kernel within the bound `tests/test_native.py` states, not bitwise; its
low-precision copy-out is `params.to(dtype)` itself.

For Lion and Adagrad the twin performs the kernels' own operations (`native/lion.c`, `native/adagrad.c`), each
fused multiply-add emulated exactly (`fma`: the float32 product is exact in float64, the sum is rounded to odd in
float64 and then to nearest float32, which is the correctly rounded result) and the square root correctly rounded
(`sqrt`: torch's is not), so it equals the compiled paths bitwise (NaN payloads aside). It is several times slower
than torch's own Adagrad, which does not matter for a fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from .hyper import AdagradHyper, AdamHyper, LionHyper

__all__ = ["adagrad_step", "adam_step", "ceiling", "fma", "grad_stats", "lion_step", "sqrt"]


def adam_step(
    h: AdamHyper | Sequence[AdamHyper],
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    out: Tensor | None,
    params_out: Tensor,
    exp_avg_out: Tensor,
    exp_avg_sq_out: Tensor,
    segments: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """One Adam step in torch operations; arguments as `fzero.native.adam_step` after validation (outputs may be
    the inputs themselves).

    Without `segments`, `h` is the step's one `AdamHyper`. With `segments = (ends, group)` (a validated table, as
    lists of ints), `h` holds one `AdamHyper` per group, and each non-empty segment runs the ungrouped step on its
    slice of the flat buffers with `h[group[s]]`: bitwise what an ungrouped call on that slice gives, by
    construction (the same torch operations on the same views). Each segment runs whole, not in blocks.
    """
    inputs = (params, grads, exp_avg, exp_avg_sq)
    _by_segment(_adam, h, inputs, (params_out, exp_avg_out, exp_avg_sq_out), out, segments, block=None)


def _adam(h: AdamHyper, params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, out: Tensor | None,
          params_out: Tensor, exp_avg_out: Tensor, exp_avg_sq_out: Tensor) -> None:  # fmt: skip
    g = grads.to(torch.float32)
    if h.grad_scale != 1.0:
        g = g * h.grad_scale
    if h.l2 != 0.0:
        g = g.add(params, alpha=h.l2)
    m = torch.mul(exp_avg, h.beta1, out=exp_avg_out).add_(g, alpha=h.one_minus_beta1)
    v = torch.mul(exp_avg_sq, h.beta2, out=exp_avg_sq_out).addcmul_(g, g, value=h.one_minus_beta2)
    denom = v.sqrt().mul_(h.inv_sqrt_bc2).add_(h.eps)
    p = torch.mul(params, h.decay, out=params_out) if h.decay != 1.0 else _same(params, params_out)
    p.addcdiv_(m, denom, value=-h.step_size)
    if out is not None:
        out.copy_(p)


def _same(src: Tensor, dst: Tensor) -> Tensor:
    return dst if dst is src else dst.copy_(src)


def grad_stats(grads: Tensor) -> tuple[float, bool]:
    """`(sum of squares in float64, whether any element is inf or nan)`."""
    sumsq = float(torch.linalg.vector_norm(grads.reshape(-1), dtype=torch.float64) ** 2)
    return sumsq, not math.isfinite(sumsq)


def ceiling(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, a: float) -> None:
    """The bandwidth-ceiling kernel's arithmetic in torch: `x <- x + a g` for x in (params, exp_avg, exp_avg_sq)."""
    for x in (params, exp_avg, exp_avg_sq):
        x.add_(grads, alpha=a)


def fma(a: Tensor, b: Tensor | float, c: Tensor | float) -> Tensor:
    """float32 `fma(a, b, c)` elementwise, correctly rounded (one rounding), as the kernels' fused multiply-adds.

    The product of two float32 values is exact in float64 (48 significant bits), and so is every step below (no
    float64 step can overflow or fall subnormal for float32 inputs). Rounding the float64 sum to nearest and then to
    float32 rounds twice, which errs only where the float64 sum lands exactly on a float32 tie while the exact sum
    does not (had the exact sum been off the tie on one side, the sum would have rounded to a double on that side).
    Such a sum has at least its 28 low significand bits zero; on those few elements the sum is rounded to odd
    instead (one ulp towards the exact sum, whose error TwoSum gives exactly, where inexact and the last bit even),
    and a round-to-odd value of at least 2 * 24 + 2 bits rounds to float32 correctly (Boldo and Melquiond,
    "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008).

    Args:
      a: a float32 tensor; b, c: float32 tensors of its shape, or floats (float32 values).

    Example:
      >>> x = torch.tensor([1 + 2**-12])
      >>> fma(x, x, 2.0**-80).item() == 1 + 2**-11 + 2**-23    # the plain float64 sum rounds to 1 + 2**-11
      True
    """
    prod = a.double() * (b.double() if isinstance(b, Tensor) else b)
    c64 = c.double() if isinstance(c, Tensor) else torch.tensor(c, dtype=torch.float64).expand_as(prod)
    total = prod + c64
    low = total.view(torch.int64) & 0x0FFFFFFF  # 0 at every float32 tie (and every float32 value)
    if low.numel() and int(low.min()) == 0:
        at = (low.view(-1) == 0).nonzero().squeeze(1)
        t, x, y = total.view(-1)[at], prod.reshape(-1)[at], c64.reshape(-1)[at]
        back = t - x
        err = (x - (t - back)) + (y - back)  # TwoSum: t + err == x + y exactly
        odd = (err != 0) & t.isfinite()  # (the last bit of these sums is 0)
        toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
        total.view(-1)[at] = torch.where(odd, torch.nextafter(t, toward), t)
    return total.float()


def sqrt(x: Tensor) -> Tensor:
    """float32 square root elementwise, correctly rounded (as the kernels' `sqrtf`, `VSQRTPS`).

    torch's own CPU `sqrt` is not: on an AVX-512 machine (torch 2.13) 17% of random float32 results and 1.3% of
    float64 ones are an ulp off. The float64 root, within an ulp of the exact one, rounds to the correct float32
    unless it lies within a few float64 ulps of a float32 tie (bits 0-28 of its significand near 0x10000000; a
    float32's root is never subnormal). On those few elements, the float32 neighbour is taken where the square of
    the midpoint between the two shows the root lies beyond it: midpoints of adjacent float32 values have at most
    25 significant bits, so their squares (at most 50) are exact in float64; and a float32's root is never exactly a
    midpoint (an odd 25-bit number squared has over 24 bits), so there are no ties.

    Example:
      >>> x = torch.tensor([2.0, 0.0, -1.0, float("inf")])
      >>> sqrt(x)
      tensor([1.4142, 0.0000,    nan,    inf])
    """
    root = x.double().sqrt()
    y = root.float()
    near = ((root.view(torch.int64) & 0x1FFFFFFF) - 0x10000000).abs_()  # float64 ulps from a float32 tie
    if not near.numel() or int(near.min()) > 4:
        return y
    at = ((near.view(-1) <= 4) & (x.view(-1) > 0) & x.view(-1).isfinite()).nonzero().squeeze(1)
    r, x64 = y.view(-1)[at], x.view(-1)[at].double()
    up, down = torch.nextafter(r, torch.full_like(r, torch.inf)), torch.nextafter(r, torch.full_like(r, -torch.inf))
    high, low = (r.double() + up.double()) / 2, (r.double() + down.double()) / 2  # exact: 25 bits at most
    r = torch.where(high * high < x64, up, torch.where(low * low > x64, down, r))
    y.view(-1)[at] = r
    return y


_BLOCK = 1 << 16
"""Elements per block of the Lion and Adagrad twins: their float64 temporaries then stay in cache and in malloc's
heap (a buffer-sized one is a fresh mapping each time, whose page faults cost more than the arithmetic)."""


def _by_segment(
    step: Callable[..., None],
    h: object,
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
    out: Tensor | None,
    segments: tuple[Sequence[int], Sequence[int]] | None,
    block: int | None = _BLOCK,
) -> None:
    """Run `step(h, *inputs, out, *outputs)` on the flat buffers, or with `segments = (ends, group)` (a validated
    table) on each non-empty segment's slices with `h[group[s]]`, in blocks of `block` elements (None: whole).
    `inputs` are the parameters, the gradients and the states; `outputs` match `inputs` without the gradients (an
    output may be its input itself: in place, and then `step` gets the input's very slice). Every element is
    computed alone, from the inputs only, so neither blocks nor segments change a bit: a segment gives what an
    ungrouped call on its slice gives."""
    flat = [t.view(-1) for t in inputs]
    # an in-place output is its input's slice object, as in an ungrouped in-place call on that slice
    same = [next((k for k, t in enumerate(inputs) if t is o), None) for o in outputs]
    flat_outs = [t.view(-1) for t in outputs]
    flat16 = out.view(-1) if out is not None else None
    if segments is None:
        runs: list[tuple[int, int, object]] = [(0, flat[0].numel(), h)]
    else:
        per_group = cast(Sequence[object], h)
        starts = [0, *segments[0][:-1]]
        runs = [(a, b, per_group[g]) for a, b, g in zip(starts, segments[0], segments[1], strict=True) if b > a]
    for begin, end, hg in runs:
        size = block or max(end - begin, 1)
        for a in range(begin, end, size):
            b = min(a + size, end)
            ins = [t[a:b] for t in flat]
            outs = [ins[k] if k is not None else t[a:b] for k, t in zip(same, flat_outs, strict=True)]
            step(hg, *ins, flat16[a:b] if flat16 is not None else None, *outs)


def lion_step(
    h: LionHyper | Sequence[LionHyper],
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    out: Tensor | None,
    params_out: Tensor,
    exp_avg_out: Tensor,
    segments: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """One Lion step, `native/lion.c`'s operations; arguments as `fzero.native.lion_step` after validation (`h`
    one `LionHyper`, or one per group with `segments`)."""
    _by_segment(_lion, h, (params, grads, exp_avg), (params_out, exp_avg_out), out, segments)


def _lion(h: LionHyper, params: Tensor, grads: Tensor, exp_avg: Tensor, out: Tensor | None, params_out: Tensor,
          exp_avg_out: Tensor) -> None:  # fmt: skip
    g = grads.to(torch.float32) * h.grad_scale
    c = fma(g, h.one_minus_beta1, exp_avg * h.beta1)
    # the kernel's u: 0 - lr where c > 0, lr where c < 0, +0 elsewhere (torch.sign(NaN) is 0 too); the products are
    # exact, and adding +0 makes every zero +0 (0 - lr is +0 for lr = 0)
    u = torch.sign(c).mul_(-h.lr).add_(0.0)
    p = fma(params, h.decay, u)
    m = fma(g, h.one_minus_beta2, exp_avg * h.beta2)
    exp_avg_out.copy_(m)
    params_out.copy_(p)
    if out is not None:
        out.copy_(p)


def adagrad_step(
    h: AdagradHyper | Sequence[AdagradHyper],
    params: Tensor,
    grads: Tensor,
    state_sum: Tensor,
    out: Tensor | None,
    params_out: Tensor,
    state_sum_out: Tensor,
    segments: tuple[Sequence[int], Sequence[int]] | None = None,
) -> None:
    """One Adagrad step, `native/adagrad.c`'s operations; arguments as `fzero.native.adagrad_step` after
    validation (`h` one `AdagradHyper`, or one per group with `segments`)."""
    _by_segment(_adagrad, h, (params, grads, state_sum), (params_out, state_sum_out), out, segments)


def _adagrad(h: AdagradHyper, params: Tensor, grads: Tensor, state_sum: Tensor, out: Tensor | None,
             params_out: Tensor, state_sum_out: Tensor) -> None:  # fmt: skip
    g = grads.to(torch.float32) * h.grad_scale
    if h.l2 != 0.0:  # skipped, not done with 0, as the kernel does
        g = fma(params, h.l2, g)
    s = fma(g, g, state_sum)
    d = sqrt(s) + h.eps
    p = fma(g / d, -h.step_size, params)
    state_sum_out.copy_(s)
    params_out.copy_(p)
    if out is not None:
        out.copy_(p)

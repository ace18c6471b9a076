"""`fzero.layout.pieces`: a unit's gradient written into its place from its parameters' gradients in one pass, bitwise
the concatenation `split`'s backward made before; and the reductions that take pieces are exactly the ones that
say so."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fzero
from fzero.layout import make_layout
from fzero.layout.pieces import Pieces, into, takes_pieces, whole
from fzero.mesh.ranks import _DistReduction
from tests import pieces_worker
from tests.spawn import spawn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def pieces(draw):
    """Pieces of a flat gradient: some None, some 2-D, some transposed or broadcast (autograd hands any strides)."""
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    sizes, grads = [], []
    for kind in draw(st.lists(st.sampled_from(["none", "flat", "2d", "t", "expand", "scalar"]), min_size=1,
                              max_size=6)):  # fmt: skip
        rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        x = (torch.randn(rows, cols, generator=g) * 2.0 ** draw(st.integers(-20, 20))).to(dtype)
        if kind == "none":
            sizes.append(rows * cols)
            grads.append(None)
            continue
        grad = {"flat": x.reshape(-1), "2d": x, "t": x.t(), "expand": x[:1].expand(rows, cols),
                "scalar": x[0, 0]}[kind]  # fmt: skip
        sizes.append(grad.numel())
        grads.append(grad)
    if all(x is None for x in grads):
        grads[0] = torch.ones(sizes[0], dtype=dtype)
    return Pieces(tuple(sizes), tuple(grads))


def concatenation(p: Pieces) -> torch.Tensor:
    """What `split`'s backward makes: each gradient flattened in order, zeros for the missing ones."""
    return torch.cat([g.reshape(-1) if g is not None else torch.zeros(n, dtype=p.dtype) for n, g in
                      zip(p.sizes, p.grads, strict=True)])  # fmt: skip


@settings(deadline=None, max_examples=80)
@given(p=pieces(), divisor=st.sampled_from([None, 2, 3, 4, 8]), out_dtype=st.sampled_from([None, torch.float32]))
def test_pieces_into_is_the_concatenation_divided_bitwise(p, divisor, out_dtype):
    """Elementwise the same operation on the same values, so bitwise, casts to the place's dtype included; the
    place's previous contents (here nan) never show through."""
    cat = concatenation(p)
    out = torch.full((p.numel(),), float("nan"), dtype=out_dtype or p.dtype)
    want = torch.empty_like(out)
    want = want.copy_(cat) if divisor is None else torch.div(cat, divisor, out=want)
    got = p.into(out, divisor)
    assert got is out and torch.equal(got, want)
    assert torch.equal(p.whole(), cat) and torch.equal(whole(p), cat)
    assert torch.equal(into(cat, torch.empty_like(out), divisor), want)  # (a tensor: the same, in one op)


def test_bad_pieces_are_refused():
    with pytest.raises(ValueError, match="2 sizes for 1 gradients"):
        Pieces((1, 2), (torch.ones(1),))
    with pytest.raises(ValueError, match="every piece is None"):
        Pieces((3,), (None,))
    with pytest.raises(ValueError, match=r"contiguous buffer of shape \(3,\), got \(4,\)"):
        Pieces((3,), (torch.ones(3),)).into(torch.empty(4))


class _Noting:
    """A reduction function that notes what it was handed (a plain one, or one that `takes_pieces`)."""

    def __init__(self, takes: bool) -> None:
        self.seen: list[object] = []
        if takes:
            self.takes_pieces = True

    def __call__(self, grads, unit, place=None):
        self.seen.append(grads)
        return whole(grads).clone()


@pytest.mark.parametrize("takes", [False, True])
def test_only_a_reduction_that_says_so_is_handed_pieces(takes):
    layout = make_layout([("a", (3,), torch.float32), ("b", (5,), torch.float32)], world=1, align=1)
    fn = _Noting(takes)
    reduction = _DistReduction(fn, layout, None)
    p = Pieces((3, 5), (torch.arange(3.0), None))
    reduction.add(0, 0, p)
    assert (fn.seen[0] is p) == takes and torch.equal(whole(fn.seen[0]), concatenation(p))
    assert torch.equal(reduction.result(), concatenation(p))


def test_the_chains_that_take_pieces():
    """A chain's per-unit reduction takes pieces when every per-unit function up to its reduction does: the
    stages' (identity, all_reduce or reduce_scatter); not the quantized reduce-scatter (qgZ), nor one behind a
    user's per-unit transform (which is promised a tensor)."""
    for stage in (fzero.zero0, fzero.zero1, fzero.zero2, fzero.zero3):
        assert takes_pieces(stage(fzero.adamw()).unit), stage
    assert not takes_pieces(fzero.zero2(fzero.adamw(), qgz=True).unit)
    user = fzero.Transform(lambda flow, ctx: (flow, fzero.transforms.EmptyState()),
                           lambda flow, state, ctx: (flow, state), "mine",
                           unit=lambda grads, unit, ctx: grads * 1.0)  # fmt: skip
    assert not takes_pieces(fzero.chain(user, fzero.all_reduce()).unit)


@pytest.mark.timeout(300)
def test_stages_on_gloo_with_pieces_are_the_simulated_step(tmp_path):
    """Stages 0, 2 and 3 over 2 gloo processes, where each unit's gradient reaches the reduction as pieces (a
    parameter the loss does not reach among them: zeros) and is divided by the world size in the one pass that
    writes it (into the step's gradient for the all-reduce, into the reduce-scatter's input), give bitwise the
    parameters of the simulated step, whose reduction concatenates and divides after the sum (2 ranks: a + b ==
    b + a, and halving is exact), in float32 and with bfloat16 compute (reduced in float32: cast in that pass)."""
    spawn(pieces_worker.run, (2, str(tmp_path)), 2)
    threads = torch.get_num_threads()
    for name, preset, dtype in pieces_worker.CASES:
        got = load_file(tmp_path / f"{name}.st")
        torch.set_num_threads(1)  # as the workers: matmul's reduction order may depend on the thread count
        try:
            want = pieces_worker.train(fzero.SimMesh(2), preset, dtype, None)
        finally:
            torch.set_num_threads(threads)
        assert got.keys() == want.keys()
        for key, value in got.items():
            assert torch.equal(value, want[key]), (name, key)
    # the spare parameter's gradient was zeros: AdamW only decayed it (torch's, on a zero gradient)
    spare = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.AdamW([spare], lr=1e-2, weight_decay=1e-2)
    for _ in range(pieces_worker.STEPS):
        spare.grad = torch.zeros(5)
        opt.step()
    assert torch.allclose(got["blocks.1.spare"], spare.detach(), rtol=0, atol=1e-7)  # (float32 rounding of decay)

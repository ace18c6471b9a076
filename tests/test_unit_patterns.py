"""Stage 3 gathers a unit again for its backward from a hook on the unit's outputs; whatever a model then does with
those outputs, the unit must be there when autograd reaches it. Each pattern of tests/patterns.py (root parameters
before and after the units, tied or not, in-place ops on the outputs and on views of them, a unit called twice, 2-D
and 3-D activations) trains at stage 3 bitwise like stage 2: same arithmetic, only where parameters live differs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fzero
from tests import patterns, patterns_worker
from tests.patterns import ISSUE, ISSUE_TIED, Pattern
from tests.spawn import spawn
from tests.test_stages import equal


@st.composite
def pattern(draw) -> Pattern:
    embed = draw(st.booleans())
    head = draw(st.sampled_from(["none", "linear", "tied"] if embed else ["none", "linear"]))
    return Pattern(
        embed=embed, head=head, units=draw(st.integers(1, 3)),
        inplace=draw(st.sampled_from(["none", "relu", "add", "slice"])),
        reuse=draw(st.booleans()), rank3=draw(st.booleans()),
    )  # fmt: skip


@pytest.mark.parametrize("p", [ISSUE, ISSUE_TIED], ids=["issue", "issue-tied"])
def test_the_reported_case(p):
    """Embedding -> 2 x (Linear, ReLU(inplace=True)) -> head: stage 3's backward found a unit freed."""
    data = patterns.batches(p, 2, 1, 3)
    mesh = fzero.SimMesh(2)
    assert equal(patterns.train(p, "zero3", mesh, data), patterns.train(p, "zero2", mesh, data))


@given(p=pattern(), world=st.integers(1, 3), micro=st.integers(1, 2))
def test_stage3_equals_stage2_for_every_pattern(p, world, micro):
    data = patterns.batches(p, world, micro, 2)
    mesh = fzero.SimMesh(world)
    want = patterns.train(p, "zero2", mesh, data, micro)
    assert equal(patterns.train(p, "zero3", mesh, data, micro), want)


CASES = [ISSUE, ISSUE_TIED, Pattern(inplace="slice", reuse=True), Pattern(embed=False, head="none", inplace="add")]


@pytest.mark.timeout(300)
def test_two_gloo_processes(tmp_path):
    """The same on 2 gloo processes, the functional core (against stage 2 on a SimMesh) and the engine (stage 3
    against stage 2 through `fzero.initialize`)."""
    spawn(patterns_worker.run, (2, str(tmp_path), [patterns.as_dict(p) for p in CASES]), 2)
    results = json.loads((tmp_path / "results.json").read_text())
    for i, p in enumerate(CASES):
        assert results[str(i)] == {"core": [], "engine": []}, p  # the tensors that differ

"""Lamb (its norms' all-gather), Muon (its matrices' all-to-alls to their owners and back), Lion, Adagrad and the
gradient averages on 3 real gloo processes give what `SimMesh` gives, bitwise: on gloo the mesh reduce-scatters with
an all-to-all and a rank-ordered sum, Lamb's pieces' sums are added in rank order on every rank, and Muon's owners
assemble each matrix exactly (docs/equivalence.md)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import fzero
from tests import optim_worker
from tests.spawn import spawn
from tests.support import differing


@pytest.mark.timeout(600)
def test_distmesh_equals_simmesh_bitwise(tmp_path):
    world = 3
    spawn(optim_worker.run, (world, str(tmp_path)), world)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: matmul's reduction order may depend on the thread count
    try:
        for case in optim_worker.CASES:
            got = load_file(tmp_path / f"{optim_worker.name(case)}.st")
            want, _ = optim_worker.train(case, fzero.SimMesh(world), None, world)
            assert differing(got, {k: want[k] for k in got}) == [], case
    finally:
        torch.set_num_threads(threads)

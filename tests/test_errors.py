"""Bad input gets a clear error naming what is wrong."""

from __future__ import annotations

import pytest
import torch

import fzero
from tests.support import mlp, regression_batches, regression_loss


def setup(world=2, preset=fzero.zero2):
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(world)
    tx = preset(fzero.adamw(1e-2))
    return model, mesh, tx, fzero.init(model, tx, mesh)


def test_empty_model():
    with pytest.raises(ValueError, match="ReLU has no parameters: there is nothing to train"):
        fzero.init(torch.nn.ReLU(), fzero.zero2(fzero.adamw()), fzero.SimMesh(2))


def test_integer_parameters():
    model = torch.nn.Linear(2, 2)
    model.register_parameter("count", torch.nn.Parameter(torch.zeros((), dtype=torch.int32), requires_grad=False))
    with pytest.raises(TypeError, match="parameter 'count' has dtype torch.int32.*register_buffer"):
        fzero.init(model, fzero.zero1(fzero.adamw()), fzero.SimMesh(2))


def test_batch_world_axis_mismatch():
    model, mesh, tx, state = setup(world=3)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    batch = regression_batches(model, 2, 1, 4, 1, 0)[0]
    with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(2, 4, 3\).*leading world axis of 3"):
        step(state, batch)
    with pytest.raises(TypeError, match=r"batch\['n'\] is a int"):
        step(state, {"n": 3})


def test_non_scalar_loss():
    model, mesh, tx, state = setup()

    def per_example(params, batch):
        out = torch.func.functional_call(model, params, (batch["x"],))
        return ((out - batch["y"]) ** 2).mean(-1)

    step = fzero.train_step(model, per_example, tx, mesh)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar \(0-d\) tensor, got shape \(4,\)"):
        step(state, regression_batches(model, 2, 1, 4, 1, 0)[0])
    step = fzero.train_step(model, lambda p, b: 1.0, tx, mesh)
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got float"):
        step(state, regression_batches(model, 2, 1, 4, 1, 0)[0])


def test_accumulate_zero():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="accumulate\\(k\\): k must be an int >= 1"):
            fzero.accumulate(bad)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        fzero.zero2(fzero.adamw(), accumulate=0)


def test_misplaced_transforms():
    model = mlp([3, 4, 2], 0)
    mesh = fzero.SimMesh(2)
    tx = fzero.chain(fzero.shard_update(fzero.adamw()), fzero.reduce_scatter())
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    with pytest.raises(ValueError, match="put reduce_scatter\\(\\).*before shard_update"):
        step(state, regression_batches(model, 2, 1, 4, 1, 0)[0])
    with pytest.raises(ValueError, match="reduce_scatter\\(\\) appears twice"):
        fzero.init(model, fzero.chain(fzero.reduce_scatter(), fzero.reduce_scatter()), mesh)
    tx = fzero.chain(fzero.reduce_scatter(), fzero.all_reduce())
    state = fzero.init(model, tx, mesh)
    step = fzero.train_step(model, regression_loss(model), tx, mesh)
    with pytest.raises(ValueError, match="all_reduce\\(\\) needs full gradients.*before reduce_scatter"):
        step(state, regression_batches(model, 2, 1, 4, 1, 0)[0])
    with pytest.raises(TypeError, match="chain: argument 1 is a function"):
        fzero.chain(fzero.gather(), lambda: None)
    with pytest.raises(TypeError, match="fzero Optimizer"):
        fzero.shard_update(torch.optim.AdamW)


def test_wrong_objects():
    model, mesh, tx, state = setup()
    with pytest.raises(TypeError, match="expected a mesh"):
        fzero.init(model, tx, "gloo")
    with pytest.raises(TypeError, match="tx must be an fzero Transform"):
        fzero.init(model, fzero.adamw(), mesh)
    step = fzero.train_step(model, regression_loss(model), tx, fzero.SimMesh(4))
    with pytest.raises(ValueError, match="built for world 2, but the mesh has world 4"):
        step(state, regression_batches(model, 4, 1, 4, 1, 0)[0])
    with pytest.raises(TypeError, match="expects a TrainState"):
        step({}, {})

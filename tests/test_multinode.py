"""Several machines as torchrun starts them: the node layout read from the launcher (`LOCAL_WORLD_SIZE`,
`LOCAL_RANK`: `fzero.host.process_group.node_layout`), ZeRO++'s qgZ quantizing only across nodes (fp32 within a
node, nothing on one node, as DeepSpeed's stage 3), the config's mesh built from the layout; and two real
`torchrun --nnodes 2 --nproc-per-node 2` launches on this host against the same run on a 2 x 2 `SimMesh`
(docs/hybrid.md, "Several nodes")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import fzero
from fzero.config import ConfigError, ConfigWarning, parse_config
from fzero.config.build import build_transform
from fzero.config.zeropp import qgz_nodes, zero_mesh_shape, zeropp_arguments
from fzero.host import process_group
from tests.support import lm_batches, lm_loss, tiny_gpt

LAUNCHER = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def launched(monkeypatch):
    """Set the launcher's variables (`launched(LOCAL_WORLD_SIZE=2, ...)`); every other one of them unset."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


# ------------------------------------------------------------------------------------------------- the node layout
def test_node_layout_from_torchrun_and_deepspeed_variables(launched):
    assert process_group.node_layout(4) == (1, 4) and process_group.local_world_size() is None  # no launcher
    assert process_group.local_rank() == 0
    launched(LOCAL_WORLD_SIZE=2, LOCAL_RANK=1, RANK=3, WORLD_SIZE=4)  # torchrun: rank 3 = node 1, local rank 1
    assert process_group.node_layout(4) == (2, 2) and process_group.local_rank() == 1
    launched(LOCAL_SIZE=2)  # the deepspeed launcher sets both LOCAL_SIZE and LOCAL_RANK
    assert process_group.local_world_size() == 2
    launched(LOCAL_WORLD_SIZE=1, LOCAL_SIZE=1, LOCAL_RANK=0)
    assert process_group.node_layout(4) == (4, 1)  # one process per node


@pytest.mark.parametrize(
    ("env", "message"),
    [({"LOCAL_WORLD_SIZE": 3}, "LOCAL_WORLD_SIZE=3 does not divide the world size 4 (WORLD_SIZE)"),
     ({"LOCAL_SIZE": 8}, "LOCAL_SIZE=8 does not divide the world size 4"),
     ({"LOCAL_WORLD_SIZE": 0}, "LOCAL_WORLD_SIZE must be an integer >= 1, got '0'"),
     ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE must be an integer >= 1, got 'two'"),
     ({"LOCAL_WORLD_SIZE": 2, "LOCAL_SIZE": 4}, "LOCAL_WORLD_SIZE=2 and LOCAL_SIZE=4 disagree"),
     ({"LOCAL_WORLD_SIZE": 2, "LOCAL_RANK": 2}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
     ({"LOCAL_WORLD_SIZE": 2, "LOCAL_RANK": -1}, "LOCAL_RANK must be an integer >= 0, got '-1'"),
     ({"LOCAL_WORLD_SIZE": 2, "LOCAL_RANK": 0, "RANK": 3},
      "RANK=3 with LOCAL_RANK=0 and LOCAL_WORLD_SIZE=2: the ranks of a node must be consecutive")],
)  # fmt: skip
def test_an_inconsistent_layout_names_the_variable(launched, env, message):
    launched(**env)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        process_group.node_layout(4)


# ------------------------------------------------------------------------------------------------------ the config
BASE = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
QGZ = {"stage": 3, "zero_quantized_gradients": True}
NODES = {"replicate": 2, "shard": 2}


def mapped(zero: dict, world: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        cfg = parse_config({**BASE, "zero_optimization": zero}, world=world)
    return zero_mesh_shape(cfg), zeropp_arguments(cfg)


LAYOUTS = [
    # (ranks per node, zero_optimization, world) -> (mesh, zero3 arguments)
    (None, QGZ, 4, (None, {})),  # no launcher: one node, where DeepSpeed's qgZ does nothing
    (4, QGZ, 4, (None, {})),  # torchrun on one node
    (2, QGZ, 4, (NODES, {"qgz": ("replicate", "shard")})),  # 2 nodes of 2: the node mesh
    (1, QGZ, 4, ({"replicate": 4, "shard": 1}, {"qgz": ("replicate", "shard")})),  # every rank a node
    (2, {**QGZ, "zero_hpz_partition_size": 2, "zero_quantized_weights": True}, 4,
     (NODES, {"hpz": True, "qwz": True, "qwz_frozen": True, "qgz": ("replicate", "shard")})),  # the ZeRO++ tutorial
    (2, {**QGZ, "zero_hpz_partition_size": 4}, 4, (NODES, {"qgz": ("replicate", "shard")})),  # hpZ of W: plain
    (2, {"stage": 3, "zero_hpz_partition_size": 2}, 8, ({"replicate": 4, "shard": 2}, {"hpz": True})),
    (4, {"stage": 3, "zero_hpz_partition_size": 2}, 8, ({"replicate": 4, "shard": 2}, {"hpz": True})),  # not the node
    (2, {"stage": 3}, 4, (None, {})),  # no hpZ, MiCS or qgZ: several nodes change nothing
    (2, {"stage": 3, "mics_shard_size": 4}, 8, ({"replicate": 2, "shard": 4}, {"hybrid": True})),  # MiCS: its size
]  # fmt: skip


@pytest.mark.parametrize(("local", "zero", "world", "want"), LAYOUTS, ids=[f"L{x[0]}-{x[1]}-w{x[2]}" for x in LAYOUTS])
def test_qgz_maps_to_the_node_mesh_and_hpz_mics_keep_deepspeeds_defaults(launched, local, zero, world, want):
    """qgZ acts on several nodes only, over the node mesh (`shard` a node's ranks); hpZ and MiCS keep their own
    group sizes, as DeepSpeed's (neither defaults to the node)."""
    if local is not None:
        launched(LOCAL_WORLD_SIZE=local, WORLD_SIZE=world)
    assert mapped(zero, world) == want


def test_qgz_on_one_node_builds_the_plain_chain(launched):
    launched(LOCAL_WORLD_SIZE=4, WORLD_SIZE=4)
    opt = fzero.adamw(1e-3)
    plain = build_transform(parse_config({**BASE, "zero_optimization": {"stage": 3}}, world=4), opt)
    qgz = build_transform(parse_config({**BASE, "zero_optimization": QGZ}, world=4), opt)
    assert [n for n, _ in qgz.children] == [n for n, _ in plain.children]
    assert qgz_nodes(parse_config({**BASE, "zero_optimization": QGZ}, world=4)) is None


@pytest.mark.parametrize(
    ("env", "zero", "key", "message"),
    [({"LOCAL_WORLD_SIZE": 2}, {**QGZ, "zero_hpz_partition_size": 4}, "zero_hpz_partition_size",
      "4 with zero_quantized_gradients on 4 nodes of 2 ranks: fzero's hierarchical qgZ reduces over hpZ's groups"),
     ({"LOCAL_WORLD_SIZE": 3}, QGZ, "zero_quantized_gradients",
      "needs the node layout: LOCAL_WORLD_SIZE=3 does not divide the world size 8")],
)  # fmt: skip
def test_layout_errors_name_the_key(launched, env, zero, key, message):
    launched(WORLD_SIZE=8, **env)
    with pytest.raises(ConfigError) as e:
        build_transform(parse_config({**BASE, "zero_optimization": zero}, world=8), fzero.adamw(1e-3))
    assert e.value.key == f"zero_optimization.{key}" and message in str(e.value), str(e.value)


def test_initialize_refuses_a_mesh_without_the_node_axes(launched):
    launched(LOCAL_WORLD_SIZE=2, WORLD_SIZE=4)
    config = {**BASE, "zero_optimization": QGZ}
    with pytest.raises(ConfigError) as e:
        fzero.initialize(model=tiny_gpt(0), config=config, mesh=fzero.SimMesh(4))
    assert e.value.key == "zero_optimization.zero_quantized_gradients"
    assert "true on 2 nodes of 2 ranks asks for a mesh of shape {'replicate': 2, 'shard': 2} on 4 ranks" in str(e.value)


# -------------------------------------------------------------------------------------------- the functional core
def _train(tx, mesh):
    model = tiny_gpt(0)
    state, step = fzero.init(model, tx, mesh), fzero.train_step(model, lm_loss(model), tx, mesh)
    with mesh.record() as ledger:
        for batch in lm_batches(model, mesh.world, 1, 2, 2, 3):
            state, _ = step(state, batch)
    return fzero.state_dict(state, mesh), ledger


def test_qgz_on_one_node_is_bitwise_plain_stage3():
    """One node of 4 (`{"replicate": 1, "shard": 4}`): the node's fp32 reduce-scatter, nothing quantized."""
    got, ledger = _train(fzero.zero3(fzero.adamw(1e-2), qgz=("replicate", "shard")), fzero.SimMesh(shape={
        "replicate": 1, "shard": 4}))  # fmt: skip
    want, _ = _train(fzero.zero3(fzero.adamw(1e-2)), fzero.SimMesh(4))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert "all_to_all:replicate" not in ledger.entries and ledger.on("shard")["reduce_scatter"]["bytes"] > 0


# ------------------------------------------------------------------------------------- two torchrun "nodes"
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End a launch we started that is still running or failed, and its workers (its own session: one process
    group, which outlives a failed agent while any of its workers does)."""
    if proc.poll() == 0:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        os.killpg(proc.pid, signal.SIGKILL)  # (any worker the agent left behind)
    proc.wait()


def launch_two_nodes(out: Path, module: str, timeout: float = 240) -> None:
    """Two `torchrun --nnodes 2 --nproc-per-node 2` launches (node ranks 0 and 1) of `python -m module out` meeting
    at a c10d rendezvous on this host (node 0 hosts its store, on a free port), their output in `out/node{0,1}.log`.
    Both are ended as soon as either fails, or after `timeout` seconds.

    Raises:
      AssertionError: a launch failed or timed out, with the end of both logs.
    """
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER and not k.startswith(("MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launches = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", f"fzero-multinode-{port}", "--rdzv-conf", f"is_host={int(node == 0)}",
                   "--max-restarts", "0", "-m", module, str(out)]  # fmt: skip
            log = open(out / f"node{node}.log", "w")  # (closed with the launch, below)
            launches.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True), log))  # fmt: skip
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in launches) and time.monotonic() < deadline:
            if any(p.returncode for p, _ in launches):  # one failed: the other would wait for it until its timeout
                break
            time.sleep(0.2)
    finally:
        for proc, log in launches:
            _stop(proc)
            log.close()
    logs = "\n".join((out / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert [proc.returncode for proc, _ in launches] == [0, 0], logs


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """tests/multinode_worker.py on two torchrun "nodes" of 2 ranks (~30 s on 2 busy cores); its `results.json`."""
    out = tmp_path_factory.mktemp("multinode")
    launch_two_nodes(out, "tests.multinode_worker")
    return json.loads((out / "results.json").read_text())


@pytest.mark.timeout(300)
def test_torchrun_gives_each_rank_its_node(two_nodes):
    """torchrun numbers the ranks node by node: rank = node * 2 + LOCAL_RANK, and each reads the 2 x 2 layout."""
    for r, layout in enumerate(two_nodes["layouts"]):
        assert layout == {"node_layout": [2, 2], "local_rank": r % 2, "group_rank": r // 2, "rank": r}


@pytest.mark.timeout(300)
def test_qgz_across_two_nodes_equals_the_2x2_sim_mesh(two_nodes):
    """`fzero.initialize` builds the node mesh for the qgZ config, its training is bitwise the functional
    `zero3(..., qgz=("replicate", "shard"))` on that `DistMesh`, which is bitwise the same on the 2 x 2 `SimMesh`."""
    assert two_nodes["mesh"] == "DistMesh(shape={'replicate': 2, 'shard': 2}, world=4, rank=0, backend=gloo)"
    assert two_nodes["arguments"] == "{'qgz': ('replicate', 'shard')}"
    assert two_nodes["engine_vs_core"] == {} and two_nodes["same_on_all_ranks"]
    assert two_nodes["core_vs_sim"] == {}
    assert two_nodes["ledger"] == two_nodes["sim_ledger"]


@pytest.mark.timeout(300)
def test_qgz_quantizes_across_the_nodes_only(two_nodes):
    """The ledger per axis: within a node (`shard`) the gradients travel in fp32 (4 bytes per element), across the
    nodes (`replicate`) in int8 with a 4-byte scale per 256 (and each chunk padded to whole blocks); no gradient
    reduction runs over every rank at once."""
    ledger = fzero.Ledger(4, two_nodes["ledger"])
    within, across = ledger.on("shard"), ledger.on("replicate")
    assert list(within) == ["reduce_scatter"] and list(across) == ["all_to_all"]
    assert within["reduce_scatter"]["bytes"] == 4 * within["reduce_scatter"]["elements"]
    a2a = across["all_to_all"]
    # int8 values and an fp32 scale per 256 of them (each chunk padded to whole blocks): 260 bytes per 257 elements
    assert a2a["calls"] % 2 == 0 and a2a["bytes"] * 257 == a2a["elements"] * 260
    assert "reduce_scatter" not in ledger.entries and "all_to_all" not in ledger.entries

"""The manifest is covered by a checksum and checked against a declared schema.

The fuzz test mutates a real manifest 1,000 times (numbers and offsets changed, types changed, fields and items
deleted, inserted and swapped, strings edited, deep nesting). Each mutation is tried twice:

- as a damage would leave it (the digest as written): `load` and `consolidate` refuse it with
  `CorruptCheckpointError`, the checksum mismatch, before anything of it is parsed;
- with the digest rewritten to match (as a buggy tool or a deliberate edit would): the schema must refuse it with a
  checkpoint error naming the field, never another exception; a mutation it accepts must load the same state
  bitwise and consolidate to the same tensors (what only the digest guards, such as `roles` and `data_position`,
  is listed in `MEANING`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fzero
from fzero.checkpoint import CheckpointError, CheckpointWarning, CorruptCheckpointError, read_manifest
from fzero.checkpoint.manifest_schema import SCHEMA
from fzero.checkpoint.tree import KINDS

CASES = 1000
DEEP = 100_000
# fields whose values no schema can check (they say what the run means, not how the files are laid out): a change
# to them that keeps the manifest well-formed is caught by the digest alone
MEANING = ("data_position", "step", "tag", "user_state", "config", "created", "fzero_version", "torch_version",
           "precision", "roles", "simulated", "processes")  # fmt: skip


class Net(nn.Module):
    """Two units, a frozen parameter, a buffer and a tied weight: every part of a layout and of the roles."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 4)])
        self.norm = nn.BatchNorm1d(4)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks[1](self.blocks[0](x))) * self.scale


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = Net()
    tx = fzero.zero2(fzero.adamw(1e-2))
    state = fzero.init(model, tx, fzero.SimMesh(2))
    path = fzero.save(state, root, data_position=3, user_state={"epoch": [1, {"a": None}]}, config={"k": 1.5})
    like = fzero.init(Net(seed=1), tx, fzero.SimMesh(2))  # other values: a load that reads nothing would show
    loaded, _ = fzero.load(root, like)
    return root, path, like, loaded, fzero.consolidate(root)


def write(path: Path, text: str, digest: bool) -> None:
    data = text.encode()
    (path / "manifest.json").write_bytes(data)
    if digest:
        (path / "manifest.json.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  manifest.json\n")


# ---------------------------------------------------------------------------------------------------- mutations
def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, (*path, i))
    return out


def _get(data: Any, path: tuple) -> Any:
    for p in path:
        data = data[p]
    return data


def _set(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(data, path[:-1])[path[-1]] = value
    return data


_MARK = "\x00deep\x00"


def _number(rng: random.Random, v: int | float) -> Any:
    return rng.choice([v + 1, v - 1, -v, 0, 2 * v, v + 16, -1, 2**63, 10**30, v + 0.5, float(v), True])


def _other(rng: random.Random, data: dict, nodes: list[tuple], v: Any) -> Any:
    return rng.choice([None, True, False, "x", "", [], {}, 1.0, -7, [v], {"v": v}, "float32", "shard", "split",
                       copy.deepcopy(_get(data, rng.choice(nodes)))])  # fmt: skip


class Sites:
    """Where a manifest can be mutated (computed once: every mutation starts from the same manifest)."""

    def __init__(self, data: dict) -> None:
        self.nodes = _nodes(data)
        self.numbers = [p for p in self.nodes if type(_get(data, p)) in (int, float)]
        self.containers = [p for p in self.nodes if isinstance(_get(data, p), (dict, list)) and _get(data, p)]
        self.strings = [p for p in self.nodes if isinstance(_get(data, p), str)]


def mutate(rng: random.Random, original: dict, sites: Sites) -> tuple[str, tuple, str]:
    """One mutation: (what, where, the manifest's new text)."""
    data = copy.deepcopy(original)
    numbers, containers, nodes = sites.numbers, sites.containers, sites.nodes
    what = rng.choices(["number", "type", "delete", "insert", "swap", "string", "deep"], [40, 15, 15, 10, 10, 5, 5])[0]
    if what == "number":
        where = rng.choice(numbers)
        data = _set(data, where, _number(rng, _get(data, where)))
    elif what == "type":
        where = rng.choice(nodes)
        data = _set(data, where, _other(rng, original, nodes, _get(data, where)))
    elif what in ("delete", "insert", "swap"):
        where = rng.choice(containers)
        node = _get(data, where)
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if what == "delete":
            del node[rng.choice(keys)]
        elif what == "insert" and isinstance(node, dict):
            node[rng.choice(["extra", "key", "shape", *keys])] = _other(rng, original, nodes, None)
        elif what == "insert":
            node.insert(rng.randrange(len(node) + 1), copy.deepcopy(node[rng.choice(keys)]))
        else:
            a, b = rng.choice(keys), rng.choice(keys)
            if isinstance(node, dict):
                node[a], node[b] = node[b], node[a]
            else:
                node[a], node[b] = node[b], node[a]
    elif what == "string":
        where = rng.choice(sites.strings)
        s = _get(data, where)
        data = _set(data, where, rng.choice([s + "x", s[:-1], s.upper(), "", "rank-00000-of-00002.safetensors"]))
    else:
        where = rng.choice(nodes)
        data = _set(data, where, _MARK)
    text = json.dumps(data)
    if what == "deep":
        text = text.replace(json.dumps(_MARK), "[" * DEEP + "]" * DEEP)
    return what, where, text


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a),
                                                    torch.utils._pytree.tree_leaves(b), strict=True))  # fmt: skip


@pytest.mark.timeout(600)
def test_manifest_fuzz(saved):
    root, path, like, loaded, consolidated = saved
    text = (path / "manifest.json").read_text()
    digest = (path / "manifest.json.sha256").read_bytes()
    original = json.loads(text)
    sites = Sites(original)
    rng = random.Random(0)
    counts = {"refused": 0, "accepted": 0, "no-op mutations skipped": 0}
    errors: dict[str, int] = {}
    case = 0
    while counts["refused"] + counts["accepted"] < CASES:
        case += 1
        what, where, mutated = mutate(rng, original, sites)
        if mutated == json.dumps(original):  # e.g. two equal items swapped: not a mutation
            counts["no-op mutations skipped"] += 1
            continue
        label = f"case {case}: {what} at {'.'.join(map(str, where))}"
        (path / "manifest.json.sha256").write_bytes(digest)  # the damage as it is: the digest refuses it first
        write(path, mutated, digest=False)
        with pytest.raises(CorruptCheckpointError, match="manifest.json: checksum mismatch"):
            read_manifest(path)
        write(path, mutated, digest=True)  # a consistent rewrite: the schema must refuse it, or it must be harmless
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)
                read_manifest(path)
                state, _ = fzero.load(root, like)
                tensors = fzero.consolidate(root)
        except CheckpointError as e:
            counts["refused"] += 1
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            continue
        except Exception as e:
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        counts["accepted"] += 1
        assert _same(state, loaded), label
        if not where or where[0] not in MEANING:
            assert tensors.keys() == consolidated.keys() and all(
                torch.equal(tensors[k], consolidated[k]) for k in tensors
            ), label
    write(path, text, digest=True)
    print(f"manifest fuzz: {CASES} mutations, {counts}, errors {errors}")
    assert counts["refused"] > CASES // 2  # most mutations break the manifest's form; all of those were refused


def test_every_field_is_declared(saved):
    _, path, *_ = saved
    written = json.loads((path / "manifest.json").read_text())
    assert set(written) == set(SCHEMA.fields)
    for kind in KINDS:  # the leaves' kinds follow fzero.checkpoint.tree
        assert f"'{kind}'" in SCHEMA.fields["leaves"].spec.inner.fields["kind"].spec.expect


@pytest.mark.parametrize(
    "where, value, message",
    [
        (
            ("layout", "leaves", 1, "offset"),
            17,
            r"field layout.leaves\[1\].offset: is 17, inconsistent with the layout "
            r"\(expected 16\)",
        ),
        (("layout", "units", 0, "size"), 3, r"field layout.units\[0\].size: is 3, inconsistent"),
        (
            ("layout", "leaves", 0, "shape"),
            [6, 4.0],
            r"field layout.leaves\[0\].shape: expected a list of non-negative "
            r"integers, got \[6, 4.0\]",
        ),
        (("layout", "buffers", 1, "name"), "scale", r"field layout.buffers\[1\].name: 'scale' names two tensors"),
        (("layout", "leaves", 2, "unit"), 5, r"field layout.leaves\[2\].unit: expected a unit index in \[0, 3\)"),
        (("layout", "world"), 0, r"field layout: malformed \(ZeroDivisionError"),
        (("leaves", 0, "shape"), [-1], r"field leaves\[0\].shape\[0\]: expected an integer >= 0, got -1"),
        (("leaves", 0, "kind"), "frozen", r"field leaves\[0\].kind: expected one of 'shard', 'full', 'replicated'"),
        (("files", 1, "sha256"), "A" * 64, r"field files\[1\].sha256: expected 64 lower-case hex digits"),
        (("files", 0, "bytes"), 10, r"field files\[0\].bytes: is 10, less than the \d+ bytes of tensors"),
        (("roles", "params"), "nope", r"field roles.params: names leaf 'nope', which the manifest does not list"),
        (("world",), 3, r"field world: is 3, the layout's world is 2"),
        (("step",), "8", r"field step: expected an integer >= 0, got '8' \(str\)"),
        (("extra",), 1, r"unknown field extra"),
    ],
)
def test_errors_name_the_field(saved, where, value, message):
    root, path, like, *_ = saved
    text = (path / "manifest.json").read_text()
    try:
        write(path, json.dumps(_set(json.loads(text), where, value)), digest=True)
        for run in (lambda: fzero.load(root, like), lambda: fzero.consolidate(root)):
            with pytest.raises(CorruptCheckpointError, match=rf"manifest.json: malformed manifest: {message}"):
                run()
    finally:
        write(path, text, digest=True)


def test_deep_nesting_is_a_checkpoint_error(saved):
    root, path, like, *_ = saved
    text = (path / "manifest.json").read_text()
    try:
        for deep in ("[" * DEEP + "]" * DEEP, text.replace('"user_state": ', '"user_state": ' + "[" * DEEP + "]" * DEEP
                                                            + ", \"x\": ")):  # fmt: skip
            write(path, deep, digest=True)
            with pytest.raises(CorruptCheckpointError, match="nested too deeply|not an fzero checkpoint manifest"):
                fzero.load(root, like)
    finally:
        write(path, text, digest=True)


def test_format_1_without_digest_loads_with_a_warning(saved):
    """Checkpoints written before the digest (format 1) load, with a `CheckpointWarning`; a format-2 manifest
    without its digest is refused."""
    root, path, like, loaded, _ = saved
    text = (path / "manifest.json").read_text()
    digest = (path / "manifest.json.sha256").read_bytes()
    try:
        old = json.loads(text)
        old["version"] = 1
        write(path, json.dumps(old), digest=False)
        (path / "manifest.json.sha256").unlink()
        with pytest.warns(CheckpointWarning, match="format 1, written before manifests had a digest"):
            state, _ = fzero.load(root, like)
        assert _same(state, loaded)
        write(path, text, digest=False)
        with pytest.raises(CorruptCheckpointError, match=r"manifest.json.sha256: missing; a format-3 manifest is "
                           "always written with its digest"):  # fmt: skip
            fzero.load(root, like)
        (path / "manifest.json.sha256").write_text("not a digest")
        with pytest.raises(CorruptCheckpointError, match=r"manifest.json.sha256: not a sha256 line"):
            fzero.load(root, like)
    finally:
        (path / "manifest.json").write_text(text)
        (path / "manifest.json.sha256").write_bytes(digest)

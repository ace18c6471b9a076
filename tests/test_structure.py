"""The package's shape: what a newcomer relies on when adding a feature, checked on the source.

- no module imports, directly or through others, a module that imports it back (no import cycle; imports under
  `TYPE_CHECKING` and inside functions count: a cycle is a design bug however it is spelled);
- the folders are layers: each sub-package's `__init__` docstring ends with the packages it may import ("May
  import: `fzero.host`, `fzero.layout`."), every module of it imports nothing else of fzero, and the declared
  permissions form no cycle (so they order the packages bottom to top);
- nothing outside `fzero/mesh/` asks which kind of mesh it runs on: no `isinstance` or `cast` to a mesh class, no
  use of a mesh class but to construct one, no `.stacked` of a mesh (what the rest needs from a mesh is on the mesh:
  `local_ranks`, `pick`, `stack`, `run`, ...);
- no module over 600 lines, whatever its docstring says;
- no run-time decision by a transform's name: nothing in the package calls `lookup(` (a transform's role is in the
  state's `fzero.Plan`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fzero"
MAX_LINES = 600
MESH_CLASSES = {"SimMesh", "DistMesh", "SimRank"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports (anywhere in its file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in modules:  # `from . import x` names a module; `from .x import f` a member
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    modules = _modules()
    # a package imports its submodules to re-export them: that edge is not a dependency of theirs on it
    graph = {
        m: {n for n in _imports(m, p, modules) if not (p.name == "__init__.py" and n.startswith(m + "."))}
        for m, p in modules.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_a_cycle():  # the check above can fail
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _package(module: str) -> str:
    """The top-level sub-package (or top module) of `fzero.x.y`: `x`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _declared(path: Path) -> set[str] | None:
    """The packages a sub-package's `__init__` docstring says it may import (None if it says nothing)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"May import:(.*)\Z", doc, flags=re.S)
    if m is None:
        return None
    return set(re.findall(r"`fzero\.([a-z_]+)`", m.group(1))) | ({"*"} if "every package" in m.group(1) else set())


def test_the_folders_are_layers():
    modules = _modules()
    packages = {_package(m) for m in modules if m.count(".") >= 1 and (PACKAGE / _package(m)).is_dir()}
    declared = {p: _declared(PACKAGE / p / "__init__.py") for p in sorted(packages) if p != "data"}
    missing = [p for p, d in declared.items() if d is None]
    assert not missing, f"sub-packages whose __init__ docstring does not end with 'May import: ...': {missing}"
    offenders = []
    for name, path in modules.items():
        mine = _package(name)
        allowed = declared.get(mine)
        if allowed is None or "*" in allowed:
            continue
        for target in _imports(name, path, modules):
            theirs = _package(target)
            if target != "fzero" and theirs != mine and theirs not in allowed:
                offenders.append(f"{name} imports {target}")
    assert not offenders, "imports outside a package's declared layers: " + "; ".join(offenders)
    graph = {p: {q for q in d if q in declared} for p, d in declared.items() if d is not None and "*" not in d}
    cycle = _cycle({p: graph.get(p, set()) for p in graph})
    assert cycle is None, "the declared layers form a cycle: " + " -> ".join(cycle or [])


def test_the_layer_check_sees_an_import_outside_its_layers(tmp_path):  # the check above can fail
    init = tmp_path / "__init__.py"
    init.write_text('"""A package.\n\nMay import: `fzero.layout`, `fzero.mesh`.\n"""\n')
    assert _declared(init) == {"layout", "mesh"}
    init.write_text('"""A package with no statement."""\n')
    assert _declared(init) is None


def _mesh_kind_uses(source: str) -> list[int]:
    """Lines that ask which kind a mesh is: a mesh class used but to construct one (`isinstance`, `cast`, a type
    test or annotation that names it), or a mesh's `.stacked`."""
    tree = ast.parse(source)
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    lines = []
    for node in ast.walk(tree):
        named = (isinstance(node, ast.Name) and node.id in MESH_CLASSES) or (
            isinstance(node, ast.Attribute) and node.attr in MESH_CLASSES
        )
        if named and id(node) not in calls:
            lines.append(node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "stacked":
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if owner.endswith("mesh"):
                lines.append(node.lineno)
        if isinstance(node, ast.Constant) and node.value == "stacked":
            lines.append(node.lineno)
    return sorted(lines)


def test_no_mesh_kind_test_outside_the_mesh():
    mesh_package = PACKAGE / "mesh"
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{i}"
        for name, p in _modules().items()
        if mesh_package not in p.parents and name != "fzero"
        for i in _mesh_kind_uses(p.read_text())
    ]
    assert not offenders, f"a mesh's kind asked outside fzero/mesh/: {offenders}"


def test_the_mesh_kind_check_can_fail():
    assert _mesh_kind_uses("isinstance(m, SimMesh)\nx = fzero.DistMesh()\n") == [1]
    assert _mesh_kind_uses("if self.mesh.stacked:\n    pass\ny: DistMesh = z\ngetattr(mesh, 'stacked', 1)\n") == [
        1,
        3,
        4,
    ]


def test_no_module_over_600_lines():
    long = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_decision_by_a_transforms_name():
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{i}"
        for p in _modules().values()
        if p != PACKAGE / "transforms" / "chain.py"  # (where `lookup`, public for users' scripts, is defined)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\blookup\(", line) and ">>>" not in line
    ]
    assert not offenders, f"a transform's state looked up by name: {offenders}"

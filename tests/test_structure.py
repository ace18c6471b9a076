"""The package's shape (issue 21): what a newcomer relies on when adding a feature, checked on the source.

- no module imports, directly or through others, a module that imports it back (no import cycle; imports under
  `TYPE_CHECKING` and inside functions count: a cycle is a design bug however it is spelled);
- no `isinstance` test of a mesh kind outside `fzero/mesh.py`: what the rest needs from a mesh is on the mesh
  (`Mesh.stacked`, `exchange`, `set_timeout`, ...);
- no module over 500 lines without its docstring saying why;
- no run-time decision by a transform's name: nothing in the package calls `lookup(` (a transform's role is in the
  state's `fzero.Plan`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fzero"
MAX_LINES = 500


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


def test_no_mesh_kind_test_outside_the_mesh():
    pattern = re.compile(r"isinstance\([^)]*\b(SimMesh|DistMesh)\b")
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{i}"
        for p in _modules().values()
        if p.name != "mesh.py" or p.parent != PACKAGE
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, f"isinstance of a mesh kind outside fzero/mesh.py: {offenders}"


def test_no_module_over_500_lines_without_a_reason():
    long = {}
    for name, p in _modules().items():
        lines = len(p.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        if lines > MAX_LINES and "over 500 lines" not in doc.lower():
            long[name] = lines
    assert not long, f"modules over {MAX_LINES} lines whose docstring gives no reason ('over 500 lines: ...'): {long}"


def test_no_decision_by_a_transforms_name():
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{i}"
        for p in _modules().values()
        if p != PACKAGE / "transforms" / "base.py"  # (where `lookup`, public for users' scripts, is defined)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\blookup\(", line) and ">>>" not in line
    ]
    assert not offenders, f"a transform's state looked up by name: {offenders}"

"""The layers of docs/architecture.md, held against the code's own imports.

Every import counts: top-level, lazy (inside a function) and typing-only, since each is a
dependency a reader and a packager must follow. Two rules, each failing with the file, the
line and the import:
- an import runs only downward: app → daemons → config → torch runner → core → wal, and the
  two daemons never import each other;
- no module imports itself back through others (no import circle between files).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "wal": 0,
    "muser": 1,
    "muser_torch": 2,
    "cluster_config": 3,
    "proposer_mac": 4,
    "verifier_gx": 4,
    "muser_app": 5,
}
"""Package -> layer (docs/architecture.md); packages of one layer do not import each other."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:
                found[_module_name(path)] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module of this tree) for every import in `path`; `from a import b` names a.b
    when that is a module, else a."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in LAYERS:
                continue
            while target and target not in modules:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.append((node.lineno, target))
    return out


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = _sources()
    return modules, {name: _imports(path, name, modules) for name, path in modules.items()}


def _where(modules: dict[str, Path], name: str, line: int) -> str:
    return f"{modules[name].relative_to(ROOT)}:{line}"


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} <= set(LAYERS), (
        f"packages without a layer in docs/architecture.md: {sorted(packages - set(LAYERS))}"
    )


def _upward(graph: dict[str, list[tuple[int, str]]]) -> list[tuple[str, int, str]]:
    """(module, line, import) for each import of a package on the same layer or above."""
    wrong = []
    for name, edges in graph.items():
        mine = name.split(".")[0]
        for line, target in edges:
            theirs = target.split(".")[0]
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append((name, line, target))
    return wrong


def test_imports_run_only_downward():
    modules, graph = _graph()
    wrong = [
        f"{_where(modules, name, line)} imports {target}" for name, line, target in _upward(graph)
    ]
    assert not wrong, "imports that do not run down the layers:\n" + "\n".join(wrong)


def _circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for _, target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    modules, graph = _graph()
    lines = []
    for circle in _circles(graph):
        members = set(circle)
        ties = [
            f"  {_where(modules, name, line)} imports {target}"
            for name in circle
            for line, target in graph[name]
            if target in members
        ]
        lines.append(" <-> ".join(circle) + "\n" + "\n".join(ties))
    assert not lines, "import circles:\n" + "\n".join(lines)


def test_the_checker_sees_circles_and_imports_that_run_up_or_across():
    """The rules above can fail: a made-up graph with each fault is caught, and only those."""
    graph = {
        "muser.a": [(3, "muser.b"), (4, "wal.d")],
        "muser.b": [(5, "muser.a")],
        "wal.c": [(7, "muser.a")],
        "wal.d": [],
        "proposer_mac.e": [(9, "verifier_gx.f"), (10, "muser.a")],
        "verifier_gx.f": [],
    }
    assert _circles(graph) == [["muser.a", "muser.b"]]
    assert _upward(graph) == [("wal.c", 7, "muser.a"), ("proposer_mac.e", 9, "verifier_gx.f")]

"""The import rules, read from the source: engine/ imports neither voice/ nor app/; voice/ does not import app/;
none of the three imports the measurement (lab/) or training (training/) packages, which import them; and no
module of the three reaches itself again through its imports, function-local imports counted."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"engine": {"voice", "app", "lab", "training"}, "voice": {"app", "lab", "training"},
             "app": {"lab", "training"}}


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, at any depth in the file (function-local imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_served_package_imports_no_package_above_it(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    crossing = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package]) for f in files}
    assert {f: names for f, names in crossing.items() if names} == {}


def test_the_check_sees_a_crossing_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from lab.bench import main\n    import app.ui\n")
    assert imported_packages(module) == {"lab", "app"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` a file imports anywhere in it: `from a.b import c` counts a.b, and a.b.c when c is
    a module; relative imports are resolved against the file's package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found |= {source} | {f"{source}.{alias.name}" for alias in node.names}
    return (found & known) - {name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_module_imports_itself_back():
    files = [f for package in FORBIDDEN for f in sorted((ROOT / package).rglob("*.py"))]
    known = {module_name(f) for f in files}
    graph = {module_name(f): imported_modules(f, known) for f in files}
    assert sum(map(len, graph.values())) > 50  # the walk sees the imports
    assert import_cycles(graph) == []


def test_the_cycle_check_sees_a_loop_through_a_function_local_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    files = sorted((tmp_path / "pkg").rglob("*.py"))
    known = {module_name(f) for f in files}
    graph = {module_name(f): imported_modules(f, known) for f in files}
    assert graph["pkg.b"] == {"pkg", "pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]

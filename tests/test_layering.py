"""The import rule, read from the source: engine/ imports neither voice/ nor app/; voice/ does not import app/;
none of the three imports the measurement (lab/) or training (training/) packages, which import them."""

import ast
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

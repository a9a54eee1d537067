"""The test suite's own structure: shared helpers live in ``tests/helpers`` (a package on
pytest's ``pythonpath``), ``conftest.py`` files hold fixtures and hooks and are imported by no
one, no test module imports another, and a fixture is written once (not copied from module to
module)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def _modules() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def _imported(tree: ast.Module) -> set[str]:
    """The top names of every module ``tree`` imports (anywhere, also inside functions)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_conftest():
    offenders = [str(p.relative_to(TESTS)) for p in _modules()
                 if "conftest" in _imported(ast.parse(p.read_text(), str(p)))]
    assert offenders == [], (
        f"{offenders} import conftest: import shared helpers from tests/helpers "
        "(e.g. `from helpers.oracle import oracle`); conftest.py is for fixtures and hooks")


def test_no_test_module_imports_another():
    """What two test modules share is a helper: it lives in tests/helpers."""
    offenders = {str(p.relative_to(TESTS)): sorted(n for n in _imported(ast.parse(p.read_text()))
                                                   if n.startswith("test_"))
                 for p in _modules()}
    assert {p: names for p, names in offenders.items() if names} == {}


def test_helpers_live_in_the_helpers_package():
    """Every module under tests/ is a test module, a conftest, or part of tests/helpers."""
    assert (TESTS / "helpers" / "__init__.py").is_file()
    stray = [str(p.relative_to(TESTS)) for p in _modules()
             if not (p.name.startswith("test_") or p.name == "conftest.py"
                     or p.parent == TESTS / "helpers")]
    assert stray == [], f"{stray}: move shared test helpers into tests/helpers/"


def _fixture_bodies(path: Path) -> dict[str, str]:
    """name → the AST of its body (docstring left out), for each top-level fixture."""
    out = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and any(
                "fixture" in ast.dump(d) for d in node.decorator_list):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            out[node.name] = ast.dump(ast.Module(body=body, type_ignores=[]))
    return out


def test_no_fixture_is_written_twice():
    """The same fixture body in two files is one fixture for a conftest.py to hold."""
    where: dict[str, list[str]] = defaultdict(list)
    for p in _modules():
        for name, body in _fixture_bodies(p).items():
            where[body].append(f"{p.relative_to(TESTS)}::{name}")
    twice = [places for places in where.values() if len(places) > 1]
    assert twice == [], f"fixtures written more than once: {twice}"

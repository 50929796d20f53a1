"""Dependencies point one way: protocol <- persistence <- runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("protocol", "persistence", "runtime")
FORBIDDEN = {
    "protocol": {"persistence", "runtime"},
    "persistence": {"runtime"},
    "runtime": set(),
}
# protocol/ is sans I/O: it may import the standard library and attrs, nothing else.
PROTOCOL_THIRD_PARTY_ALLOWED = {"attrs", "attr"}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PROJECT)
def test_layering_no_import_points_the_wrong_way(package: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {root}"
        for path in sources(package)
        for root in imported_roots(path) & FORBIDDEN[package]
    ]
    assert not offenders, offenders


def test_layering_protocol_imports_only_stdlib_and_attrs() -> None:
    import sys

    allowed = set(sys.stdlib_module_names) | PROTOCOL_THIRD_PARTY_ALLOWED | {"protocol"}
    offenders = [
        f"{path.relative_to(ROOT)} imports {root}"
        for path in sources("protocol")
        for root in imported_roots(path) - allowed
    ]
    assert not offenders, offenders


def test_layering_checker_sees_a_wrong_arrow(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from runtime.server import serve\nimport persistence.sqlite\n")
    assert imported_roots(bad) == {"runtime", "persistence"}

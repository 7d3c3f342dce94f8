"""The package's layering (docs/architecture.md): ``passes/`` and ``runtime/`` never
import each other, ``ops/`` imports neither, the runtime reads the compiler's output only
through ``plan.py``, and the backend runs the passes through ``compiler.py``."""

from __future__ import annotations

import ast
import pathlib

import pytest

import roundpipe

ROOT = pathlib.Path(roundpipe.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    package = ".".join(("roundpipe",) + path.relative_to(ROOT).parent.parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _package(name: str) -> list[pathlib.Path]:
    return sorted((ROOT / name).glob("*.py"))


@pytest.mark.parametrize("inner, forbidden", [
    ("passes", "roundpipe.runtime"),
    ("runtime", "roundpipe.passes"),
    ("ops", "roundpipe.passes"),
    ("ops", "roundpipe.runtime"),
    ("runtime", "roundpipe.compiler"),
    ("passes", "roundpipe.api"),
    ("runtime", "roundpipe.api"),
    ("runtime", "roundpipe.optim"),
    ("passes", "roundpipe.optim"),
])
def test_layers_do_not_import_each_other(inner, forbidden):
    offenders = {p.name: sorted(m for m in _imports(p)
                                if m == forbidden or m.startswith(forbidden + "."))
                 for p in _package(inner)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_backend_runs_the_passes_through_the_compiler():
    """One pass chain: backend.py may convert Dynamo's graph and decide batching, but the
    passes from layers on come from compiler.py."""
    passes = {m for m in _imports(ROOT / "backend.py") if m.startswith("roundpipe.passes.")}
    allowed = {"roundpipe.passes.batching", "roundpipe.passes.dynamo", "roundpipe.passes.cost"}
    modules = {".".join(m.split(".")[:3]) for m in passes}
    assert modules <= allowed, modules - allowed


def test_the_import_resolver_sees_relative_imports():
    """The check above can fail: it resolves ``from ..runtime import x``."""
    found = _imports(ROOT / "passes" / "codegen.py")
    assert "roundpipe.plan" in found or any(m.startswith("roundpipe.plan") for m in found)

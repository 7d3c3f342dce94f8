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


# --- the core does not import the optimizers or the Trainer integration ---------------------

#: the modules that may import roundpipe.optim / roundpipe.hf: those packages themselves and
#: the package's façade (``roundpipe/__init__.py`` re-exports ``roundpipe.optim``).  Everything
#: else is the core (api, runtime, passes and the modules beside them): host_step.py reads a
#: class attribute of roundpipe.optim's optimizers (``reads_landed_grads``) instead.
_CORE_EXEMPT = ("optim", "hf")


def _core_modules() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if p.relative_to(ROOT).parts[0] not in _CORE_EXEMPT
                  and p != ROOT / "__init__.py")


@pytest.mark.parametrize("forbidden", ["roundpipe.optim", "roundpipe.hf"])
def test_the_core_does_not_import_optim_or_hf(forbidden):
    core = _core_modules()
    assert ROOT / "api.py" in core and ROOT / "runtime" / "optimizer.py" in core
    offenders = {str(p.relative_to(ROOT)): sorted(
        m for m in _imports(p) if m == forbidden or m.startswith(forbidden + "."))
        for p in core}
    assert {k: v for k, v in offenders.items() if v} == {}


# --- the Trainer integration, the benches and the examples use public names only ------------

REPO = ROOT.parent
#: private names of other libraries these files use, each with its reason (not roundpipe's)
_THIRD_PARTY_PRIVATE = {
    ("roundpipe/hf/trainer.py", "self.args._n_gpu"):
        "transformers' TrainingArguments: one process drives every device",
    ("bench/hf_sweep.py", "cfg._experts_implementation"): "a transformers config field",
}
_THIRD_PARTY_ROOTS = {"torch"}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_reaches(source: str) -> list[str]:
    """``x._name`` on anything but ``self``/``cls``/``super()`` (or torch), and
    ``from roundpipe... import _name``: a reach past the public API."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue  # its own private names
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                    and value.func.id == "super":
                continue
            if _root_name(value) in _THIRD_PARTY_ROOTS:
                continue
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.level or (
                node.module or "").split(".")[0] == "roundpipe"):
            found += [f"import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def _integration_files() -> list[pathlib.Path]:
    files = sorted((ROOT / "hf").glob("*.py"))
    for folder in ("bench", "examples"):
        files += sorted((REPO / folder).glob("*.py"))
    return files


def test_integrations_reach_no_private_name():
    """roundpipe/hf, bench/ and examples/ use RoundPipe's public seams (pipe.wait(),
    pipe.has_masters, pipe.resolve_run_config(), docs/guide.md "Seams for integrations"),
    never ``pipe._optimizer`` and the like, whose contract may change under them."""
    files = _integration_files()
    if not (REPO / "bench").is_dir():
        pytest.skip("bench/ and examples/ are not installed with the package (a checkout)")
    assert any(p.parent.name == "bench" for p in files)
    offenders = {}
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        found = [e for e in private_reaches(path.read_text(encoding="utf-8"))
                 if (rel, e) not in _THIRD_PARTY_PRIVATE]
        if found:
            offenders[rel] = found
    assert offenders == {}


def test_the_private_reach_check_can_fail():
    found = private_reaches(
        "pipe._optimizer.wait()\nself.trainer.pipe._state.has_masters\n"
        "from roundpipe.api import _Compiled\nself._mine()\nsuper()._save()\n"
        "torch._C._get_tracing_state()\n")
    assert sorted(found) == ["import _Compiled", "pipe._optimizer", "self.trainer.pipe._state"]

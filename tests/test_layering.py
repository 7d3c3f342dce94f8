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
    return _resolve(ast.walk(ast.parse(path.read_text(encoding="utf-8"))), _package_of(path))


def _package_of(path: pathlib.Path) -> str:
    return ".".join(("roundpipe",) + path.relative_to(ROOT).parent.parts)


def _resolve(nodes, package: str) -> set[str]:
    names: set[str] = set()
    for node in nodes:
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


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _statements(body: list[ast.stmt], *, into_functions: bool) -> list[ast.stmt]:
    """The statements that run (``into_functions=False``: when the module is imported),
    leaving out ``if TYPE_CHECKING:`` blocks, which never run."""
    found: list[ast.stmt] = []
    for node in body:
        if _is_type_checking(node):
            found += _statements(node.orelse, into_functions=into_functions)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not into_functions:
            continue
        found.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                found += _statements([n for n in inner if isinstance(n, (ast.stmt,
                                                                          ast.excepthandler))],
                                     into_functions=into_functions)
    return found


def _run_time_imports(source: str, package: str, *, module_level: bool) -> set[str]:
    """Modules imported when the code runs: at import time only (``module_level``), or
    anywhere; never those under ``if TYPE_CHECKING:``."""
    body = ast.parse(source).body
    return _resolve(_statements(body, into_functions=not module_level), package)


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


# --- the checkpoint package and the API do not import each other at import time ---------

def test_the_checkpoint_code_is_one_package():
    """Saving, loading, sharding, asynchronous saves, safe DCP reading and the safetensors
    export live in ``roundpipe/checkpoint/``, not beside the API."""
    assert {p.name for p in _package("checkpoint")} >= {
        "__init__.py", "save_load.py", "sharded.py", "asynchronous.py", "safe_dcp.py",
        "atomic.py", "export.py"}
    strays = sorted(p.name for p in ROOT.glob("*.py")
                    if p.name.startswith(("checkpoint", "safetensors")))
    assert strays == []


def test_the_api_imports_the_checkpoint_package_only_where_a_method_delegates():
    found = _run_time_imports((ROOT / "api.py").read_text(encoding="utf-8"), "roundpipe",
                              module_level=True)
    assert sorted(m for m in found if m.startswith("roundpipe.checkpoint")) == []
    anywhere = _run_time_imports((ROOT / "api.py").read_text(encoding="utf-8"),
                                 "roundpipe", module_level=False)
    assert "roundpipe.checkpoint.export" in anywhere  # save_pretrained: found when lazy


def test_the_checkpoint_package_imports_the_api_for_annotations_only():
    files = _package("checkpoint")
    assert files
    offenders = {p.name: sorted(m for m in _run_time_imports(
                     p.read_text(encoding="utf-8"), _package_of(p), module_level=False)
                     if m == "roundpipe.api" or m.startswith("roundpipe.api."))
                 for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_time_check_can_fail():
    source = ("from typing import TYPE_CHECKING\n"
              "from .checkpoint import save_checkpoint\n"
              "if TYPE_CHECKING:\n    from .api import RoundPipe\nelse:\n    import os\n"
              "try:\n    from . import plan\nexcept ImportError:\n    from . import errors\n"
              "class C:\n    from . import config\n"
              "    def m(self):\n        from .checkpoint.export import save_pretrained\n")
    at_import = _run_time_imports(source, "roundpipe", module_level=True)
    assert {"roundpipe.checkpoint", "roundpipe.plan", "roundpipe.errors", "roundpipe.config",
            "os"} <= at_import
    assert "roundpipe.api" not in at_import
    assert "roundpipe.checkpoint.export" not in at_import
    anywhere = _run_time_imports(source, "roundpipe", module_level=False)
    assert "roundpipe.checkpoint.export" in anywhere and "roundpipe.api" not in anywhere


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
        pytest.skip(reason="bench/ and examples/ are not installed with the package (a checkout)")
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


def test_the_job_runner_reads_the_executor_through_its_public_seam():
    """runtime/job_runner.py works on the call's ``CallState`` (runtime/call_state.py) and
    the executor's public names (``readers``, ``buffer_update``, ``grad_dtype``,
    ``start_load``, ``ready``, ...), not on the executor's private ``_Call`` and
    attributes, whose contract is the executor's own."""
    source = (ROOT / "runtime" / "job_runner.py").read_text(encoding="utf-8")
    into = sorted({r for r in private_reaches(source)
                   if r.startswith(("ex.", "self.ex.", "call.", "self.call.", "import "))})
    assert into == []


# --- the checkpoint package drives a pipe through its public seams --------------------------

def pipe_reaches(source: str) -> list[str]:
    """Private names reached through a RoundPipe: ``x._name`` (at any depth, e.g.
    ``pipe._state.offload``) where ``x`` is named ``pipe`` or is a parameter annotated
    ``RoundPipe``, and ``from roundpipe... import _name``.  Other objects' private names
    (torch's ``_metadata``, ``optimizer._param_to_rank``) are not the pipe's."""
    tree = ast.parse(source)
    pipes = {"pipe"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            text = ast.unparse(node.annotation).strip("'\"")
            if text.split("|")[0].strip().split(".")[-1] == "RoundPipe":
                pipes.add(node.arg)
    return [r for r in private_reaches(source)
            if r.startswith("import ") or r.split(".")[0] in pipes]


def test_the_checkpoint_package_reaches_no_private_pipe_state():
    """roundpipe/checkpoint/ uses the pipe's public members (state_dict, wait,
    enqueue_on_optimizer_thread, new_gloo_group, offload_stats, read_offloaded_state:
    docs/guide.md "Seams for integrations"), never ``pipe._optimizer`` and the like."""
    files = _package("checkpoint")
    assert files
    offenders = {p.name: found for p in files
                 if (found := pipe_reaches(p.read_text(encoding="utf-8")))}
    assert offenders == {}


def test_the_pipe_reach_check_can_fail():
    found = pipe_reaches(
        "def f(pipe, p: RoundPipe, q: 'RoundPipe | None', opt):\n"
        "    pipe._dp\n    p._optimizer.submit(fn)\n    q._state.offload\n"
        "    opt._param_to_rank\n    sd._metadata\n    torch._C._x\n    self._mine\n"
        "from ..api import _Compiled\n")
    assert sorted(found) == ["import _Compiled", "p._optimizer", "pipe._dp",
                             "q._state"]

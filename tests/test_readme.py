"""The README's quick-start block is what CI runs (``.ci/run`` executes its install lines
and its test command), and its main job exists; a block that drifts fails here or in CI."""

from __future__ import annotations

import ast
import builtins
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    match = re.search(r"```bash\n(.*?)```", text, re.S)
    assert match, "the README starts with a bash block"
    return [line.split("#", 1)[0].strip() for line in match.group(1).splitlines()
            if line.split("#", 1)[0].strip()]


def test_the_quick_start_installs_torch_roundpipe_and_the_test_tools_then_runs():
    lines = _block()
    assert lines[0].startswith("pip install torch==")  # PyTorch first, pinned
    assert 'pip install -e ".[test]"' in lines  # pytest comes with the test extra
    assert any(line.startswith("python examples/train_gpt.py") for line in lines)
    assert os.path.isfile(os.path.join(ROOT, "examples", "train_gpt.py"))
    assert lines[-1] in ("python -m pytest", "python -m pytest -n 2",
                         "python -m pytest -n 3 --dist worksteal")


def test_ci_runs_the_readme_block():
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "README.md" in script and "test_command" in script
    extra = open(os.path.join(ROOT, "pyproject.toml")).read()
    test = re.search(r"^test = \[(.*?)\]", extra, re.S | re.M).group(1)
    for tool in ("pytest", "hypothesis", "tqdm", "numpy") + (
            ("pytest-xdist",) if " -n " in _block()[-1] else ()):
        assert f'"{tool}' in test, tool


def _python_blocks() -> list[tuple[str, str]]:
    """(the section's title, the block) for every python block of the README."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0]
        blocks += [(title, b) for b in re.findall(r"```python\n(.*?)```", section, re.S)]
    return blocks


# What the snippets may leave to the reader (their own model, data and loss).
PLACEHOLDERS = {"model", "x", "y", "loss_fn", "opt", "ds", "collator", "path", "batch"}


def _undefined(code: str) -> set[str]:
    tree = ast.parse(code)
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return used - bound - set(dir(builtins))


def test_every_python_block_imports_what_it_uses():
    """A snippet names its imports (torch, roundpipe, transformers' classes); what it
    leaves to the reader is only their own model, data and loss."""
    blocks = _python_blocks()
    assert {title for title, _ in blocks} >= {"Use", "Hugging Face models",
                                              '`torch.compile(backend="roundpipe")`'}
    for title, code in blocks:
        assert _undefined(code) <= PLACEHOLDERS, (title, _undefined(code) - PLACEHOLDERS)


def test_the_use_block_runs_as_pasted_on_the_cpu(forkserver, tmp_path):
    code = next(code for title, code in _python_blocks() if title == "Use")
    assert _undefined(code) == set()  # nothing left to the reader
    # As ``python -c BLOCK`` in an empty directory, CUDA hidden.  The child is forked from
    # a process that imported only torch, tabulate and roundpipe (tests/forkserver.py,
    # CUDA not initialised), so the block's own imports and names are what it runs on,
    # as in a new interpreter; _undefined checks the names the block uses.
    proc = forkserver.run(code=code, cwd=str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""},
                          unset=["ROUNDPIPE_DEVICES"], timeout=300)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "fused" in proc.stdout  # the plan it prints


def test_the_quick_start_prints_the_plan_on_the_readmes_device_count():
    text = open(os.path.join(ROOT, "README.md")).read()
    line = next(line for line in _block() if line.startswith("python examples/train_gpt.py"))
    devices = re.search(r"--devices (\d+)", line)
    assert devices, line
    table = re.search(r"over \d+ units on (\d+) device\(s\)", text)
    assert table and table.group(1) == devices.group(1)
    assert f"train_gpt.py --devices {devices.group(1)}" in text.split("```\nstage")[0][-200:]

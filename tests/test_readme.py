"""The README's quick-start block is what CI runs (``.ci/run`` executes its install lines
and its test command), and its main job exists; a block that drifts fails here or in CI."""

from __future__ import annotations

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
    assert "python examples/train_gpt.py" in lines
    assert os.path.isfile(os.path.join(ROOT, "examples", "train_gpt.py"))
    assert lines[-1] in ("python -m pytest", "python -m pytest -n 2")


def test_ci_runs_the_readme_block():
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "README.md" in script and "test_command" in script
    extra = open(os.path.join(ROOT, "pyproject.toml")).read()
    test = re.search(r"^test = \[(.*?)\]", extra, re.S | re.M).group(1)
    for tool in ("pytest", "hypothesis", "tqdm", "numpy") + (
            ("pytest-xdist",) if " -n " in _block()[-1] else ()):
        assert f'"{tool}' in test, tool

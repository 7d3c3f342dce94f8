"""Tests for the command line, ``python -m roundpipe plan MODULE:FACTORY``, run in-process
through ``roundpipe.__main__.main`` on a small factory file."""

from __future__ import annotations

import json
import textwrap

import pytest

from roundpipe.__main__ import main

FACTORY = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def make():
        torch.manual_seed(0)
        return Net(), (torch.randn(6, 16),)

    def model_only():
        torch.manual_seed(0)
        return Net()
""")

HEADERS = ["stage", "kind", "units", "params (MiB)", "est. time", "act in/out (MiB)",
           "recompute"]


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "cli_factory_models.py"
    path.write_text(FACTORY)
    return path


def _plan_output(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_prints_the_table(factory_file, capsys):
    out = _plan_output(capsys, f"{factory_file}:make", "--devices", "2")
    lines = out.splitlines()
    assert all(h in lines[0] for h in HEADERS)
    assert "blocks.0" in out and "head" in out
    summary = [l for l in lines if " stages (" in l]
    assert len(summary) == 1
    assert "on 2 device(s), 3 microbatches" in summary[0]


def test_plan_json(factory_file, capsys):
    out = _plan_output(capsys, f"{factory_file}:make", "--json", "--devices", "2",
                       "--num-microbatch", "4")
    d = json.loads(out)
    assert d["num_devices"] == 2 and d["num_microbatch"] == 4
    assert [u["name"] for u in d["units"]] == ["blocks.0", "blocks.1", "blocks.2",
                                                "blocks.3", "head"]
    kinds = [s["kind"] for s in d["stages"]]
    assert kinds == ["fwd"] * kinds.index("fused") + ["fused"] + ["bwd"] * (
        len(kinds) - kinds.index("fused") - 1)


def test_plan_code(factory_file, capsys):
    out = _plan_output(capsys, f"{factory_file}:make", "--code", "0")
    assert "# stage 0 (fwd)" in out
    assert "class Stage0(torch.nn.Module):" in out
    assert "def forward" in out
    assert "# unit 0: blocks.0" in out
    assert out.index("stage ") < out.index("# stage 0")  # the table comes first


def test_plan_with_importable_module_and_example(factory_file, capsys, monkeypatch):
    """MODULE:FACTORY with an importable module, and --example for a factory that returns
    only the model."""
    monkeypatch.syspath_prepend(str(factory_file.parent))
    monkeypatch.chdir(factory_file.parent)
    out = _plan_output(capsys, "cli_factory_models:model_only", "--example",
                       "torch.randn(4, 16)", "--memory-cap", "1MiB")
    assert "(cap 1.0 MiB)" in out


def _error(capsys, *argv) -> str:
    """A user error: one message on stderr, status 2, no traceback."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ")
    return err


def test_user_errors_are_one_message_and_status_2(factory_file, tmp_path, capsys):
    assert "no example input" in _error(capsys, f"{factory_file}:model_only")
    assert "expected MODULE:FACTORY" in _error(capsys, str(factory_file))
    assert "no such file" in _error(capsys, f"{tmp_path / 'missing.py'}:make")
    assert "cannot import 'no_such_module'" in _error(capsys, "no_such_module:make")
    assert "has no attribute 'nope'" in _error(capsys, f"{factory_file}:nope")
    err = _error(capsys, f"{factory_file}:make", "--memory-cap", "1KiB")  # PartitionError
    assert "memory cap" in err
    # the traceback, when asked for
    with pytest.raises(Exception, match="memory cap"):
        main(["plan", f"{factory_file}:make", "--memory-cap", "1KiB", "--debug"])


def test_partition_advice_fits_what_was_asked(factory_file, capsys):
    err = _error(capsys, f"{factory_file}:make", "--memory-cap", "1KiB")
    assert "recompute_grain='layer'" in err
    err = _error(capsys, f"{factory_file}:make", "--memory-cap", "1KiB",
                 "--recompute-grain", "layer")
    assert "recompute_grain='layer'" not in err and "num_microbatch" in err


NESTED = FACTORY + textwrap.dedent("""
    class Wrapper(nn.Module):
        def __init__(self, inner, name):
            super().__init__()
            self.add_module(name, inner)
            self.name = name

        def forward(self, x):
            return getattr(self, self.name)(x)

    def nested():
        torch.manual_seed(0)
        net = Net()
        net.blocks = nn.ModuleList([Block() for _ in range(12)])
        model = Wrapper(Wrapper(Wrapper(net, "language_model_with_a_long_name"), "model"),
                        "base_model")
        return model, (torch.randn(6, 16),)
""")


def test_long_unit_names_fit_120_columns(tmp_path, capsys):
    """PEFT-style wrappers make every unit name start with the same long prefix: the table
    drops it (and says so), and JSON keeps the full names."""
    path = tmp_path / "cli_nested_models.py"
    path.write_text(NESTED)
    out = _plan_output(capsys, f"{path}:nested", "--devices", "4")
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "base_model.model.language_model_with_a_long_name." in out  # the note
    assert "blocks.0" in out
    data = json.loads(_plan_output(capsys, f"{path}:nested", "--devices", "4", "--json"))
    assert data["units"][0]["name"].startswith(
        "base_model.model.language_model_with_a_long_name.blocks")


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["-h"], []])
def test_help_answers_without_importing_torch(args):
    """``python -m roundpipe --help`` (and ``plan --help``, or no command) prints its
    usage without importing torch (seconds): -X importtime lists every module imported."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "roundpipe", *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=root)
    assert "usage: python -m roundpipe" in proc.stdout + proc.stderr
    assert proc.returncode == (0 if args else 2), proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert "roundpipe" in imported and "argparse" in imported  # the list is read right
    assert "torch" not in imported, [m for m in imported if m.startswith("torch")][:5]

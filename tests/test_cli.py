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
    assert "(cap 1.0 MiB per stage)" in out


def test_plan_without_an_example_or_colon_exits(factory_file):
    with pytest.raises(SystemExit, match="no example input"):
        main(["plan", f"{factory_file}:model_only"])
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        main(["plan", str(factory_file)])

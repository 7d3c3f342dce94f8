"""The README's main job runs end to end (a few steps) on virtual CPU devices.

Each example runs as ``python examples/X.py`` in a child forked from the session's fork
server (tests/forkserver.py), with this checkout's roundpipe first on its path."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_gpt_example_runs_and_prints_the_plan(forkserver):
    result = forkserver.run(os.path.join(ROOT, "examples", "train_gpt.py"),
                            ["--steps", "20", "--devices", "2", "--seq-len", "16"], cwd=ROOT)
    assert result.returncode == 0, result.output[-3000:]
    out = result.stdout
    assert "stage" in out and "fused" in out and "bwd" in out  # the plan table
    # Piped, progress is a plain line every tenth of the run, never a redrawn bar.
    assert "train 20/20: loss" in out and "\r" not in out + result.stderr
    first, last = out.split("loss: first")[1].split("->")
    assert float(first.split()[-1]) > float(last.split()[3]) > 0  # it learns


def test_finetune_hf_example_runs_and_reports_progress(forkserver):
    """The Hugging Face fine-tuning example: a tiny Llama from a config, on two virtual CPU
    devices, a few steps of batches whose sequence length varies."""
    pytest.importorskip("transformers", reason='needs the test extra: pip install -e ".[test]"')
    result = forkserver.run(os.path.join(ROOT, "examples", "finetune_hf.py"),
                            ["--steps", "8", "--devices", "2"], cwd=ROOT)
    assert result.returncode == 0, result.output[-3000:]
    out = result.stdout
    assert "LlamaForCausalLM" in out and "fused" in out  # the model and its plan
    assert "fine-tune 8/8: loss" in out and "\r" not in out + result.stderr  # piped
    first, last = out.split("loss: first")[1].split("->")
    assert float(first.split()[-1]) > float(last.split()[3]) > 0  # it learns
    assert "1 compiled program(s) for 8 batches" in out  # lengths vary, shapes are dynamic


def test_finetune_trainer_example_runs_through_transformers_trainer(forkserver, tmp_path):
    """RoundPipeTrainer in the example: a few steps on two virtual CPU devices, Trainer's
    own logs, then the plan and a held-out evaluation through the pipe."""
    pytest.importorskip("transformers", reason='needs the test extra: pip install -e ".[test]"')
    result = forkserver.run(os.path.join(ROOT, "examples", "finetune_trainer.py"),
                            ["--steps", "6", "--devices", "2", "--output-dir", str(tmp_path)],
                            cwd=ROOT)
    assert result.returncode == 0, result.output[-3000:]
    out = result.stdout
    assert "LlamaForCausalLM on cpu:0, cpu:1, exact steps" in out
    assert "fused" in out and "'loss':" in out  # the plan, and Trainer's log lines
    first, last = out.split("train loss: first log")[1].split(",")[0].split("->")
    assert float(first) > float(last.split()[-1]) > 0  # it learns
    assert float(out.split("held-out loss:")[1].split()[0]) > 0

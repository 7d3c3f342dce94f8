"""The README's main job runs end to end (a few steps) on virtual CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_gpt_example_runs_and_prints_the_plan():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", "4",
         "--devices", "2"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "stage" in out and "fused" in out and "bwd" in out  # the plan table
    assert "loss: first" in out
    first, last = out.split("loss: first")[1].split("->")
    assert float(first.split()[-1]) > 0 and float(last.split()[3]) > 0

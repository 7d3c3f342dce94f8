"""Every script in bench/ and examples/ runs, in its smoke mode, so none rots unnoticed.

Each case runs one script as ``python SCRIPT ARGS`` would, in a child process, and checks
its exit status and a line of its output: the bench scripts with ``--smoke`` (tiny sizes:
seconds), the examples with tiny sizes through their own arguments.  train_gpt.py,
finetune_hf.py and finetune_trainer.py run in tests/test_example.py and are not repeated.

Each child is forked from the session's fork server (tests/forkserver.py: torch and
roundpipe imported once; without ``os.fork`` a fresh interpreter).

The GPU benches: ``gpu_profile.py --smoke`` runs its whole path on two virtual CPU devices
(instrumentation included, no profiler).  ``gpu.py`` and ``gpu_optim.py`` measure CUDA
only; here they run ``--help``, their no-CUDA exit, and their CPU-runnable parts (the
shared Llama through a pipe, the optimizers gpu_optim.py builds, its /proc reader).
"""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(forkserver, script: str, args: list[str], expect: str, tmp_path,
           code: str | None = None) -> str:
    if code is None:
        result = forkserver.run(os.path.join(ROOT, script), args, cwd=str(tmp_path),
                                merge_stderr=True)
    else:
        result = forkserver.run(code=code, args=args, cwd=str(tmp_path), merge_stderr=True)
    out = result.stdout
    assert result.returncode == 0, \
        f"{script} {' '.join(args)} exited {result.returncode}:\n{out[-3000:]}"
    assert expect in out, f"{script}: {expect!r} not in its output:\n{out[-3000:]}"
    return out


# (script, arguments, a line its output must contain)
BENCH = [
    ("bench/checkpoint.py", ["--smoke"], "async sharded save"),
    ("bench/checkpoint_crash.py", ["--smoke"], "1 kills of a process saving"),
    ("bench/convergence.py", ["--smoke"], "final val loss"),
    ("bench/data_parallel.py", ["--smoke"], "2 replicas, bucket 1MiB"),
    ("bench/device_memory.py", ["--smoke"], "plan device_memory_bytes"),
    ("bench/exact_step.py", ["--smoke"], "| clipped to 1.0 | per unit |"),
    ("bench/gpu_profile.py", ["--smoke"], "=== microbatches 2"),
    ("bench/hf_sweep.py", ["--smoke"], "llama"),
    ("bench/mutants.py", ["--smoke"], "score: 1/1 caught"),
    ("bench/host_memory.py", ["--smoke"], "bf16-fp32-rpadamwdisk"),
    ("bench/optimizer.py", ["--smoke"], "roundpipe.optim.AdamW(state_dtype=bf16), native"),
    ("bench/optimizer.py", ["--smoke", "--disk-only"], "disk tier step / I/O bound"),
    ("bench/optimizer.py", ["--smoke", "--host-only"], "roundpipe.optim.SGD(momentum), fused"),
    ("bench/overhead.py", ["--smoke"], "roundpipe / eager"),
    ("bench/partition.py", ["--smoke"], "Compile time"),
    ("bench/partition_solver.py", ["--smoke"], "pipeline+mem ms"),
    ("bench/soak.py", ["--smoke"], "after warm-up"),
    ("bench/transfer.py", ["--smoke"], "peak weights / 2 stages"),
]


@pytest.mark.parametrize("script, args, expect", BENCH,
                         ids=[f"{s}{' ' + ' '.join(a[1:]) if a[1:] else ''}"
                              for s, a, _ in BENCH])
def test_bench_script_runs_in_smoke_mode(forkserver, script, args, expect, tmp_path):
    if script == "bench/hf_sweep.py":
        pytest.importorskip("transformers", reason='needs the test extra: pip install -e ".[test]"')
    out = _check(forkserver, script, args, expect, tmp_path)
    if script == "bench/hf_sweep.py":  # a sweep reports failures as rows: llama must pass
        assert any(line.split()[:2] == ["llama", "ok"] for line in out.splitlines()), out
    if script == "bench/gpu_profile.py":  # the instrumented internal phases were timed
        assert "RoundPipe._prepare" in out and "OptimizerWorker.wait" in out, out


def test_every_script_has_a_smoke_case():
    """A new script in bench/ or examples/ needs a case here (or in test_example.py)."""
    covered = {s for s, _, _ in BENCH} | {s for s, _, _ in EXAMPLES} | {
        "bench/benchutil.py", "bench/gpu.py", "bench/gpu_optim.py",  # below
        "examples/train_gpt.py", "examples/finetune_hf.py",  # tests/test_example.py
        "examples/finetune_trainer.py", "examples/progress.py"}
    scripts = {f"{d}/{f}" for d in ("bench", "examples")
               for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
    assert scripts - covered == set()


# The GPU benches' CPU-runnable parts (they measure CUDA only).
GPU_PARTS = r"""
import sys
sys.path.insert(0, {bench!r})  # as python bench/gpu.py has it
import torch
import gpu, gpu_optim, gpu_profile  # imports, and the names they take from benchutil
import roundpipe
from benchutil import PHASES, Llama, instrument, lm_loss
assert gpu.SECTIONS[0] == "machine" and callable(gpu.roundpipe_step)
assert gpu_optim.proc_status("VmRSS") > 0
instrument()  # the internal methods it wraps still exist
torch.manual_seed(0)
model = Llama(64, 64, 2, 2, 96)
x = torch.randint(0, 64, (4, 8))
pipe = roundpipe.compile(model, (x,), devices=["cpu"] * 2, optim_dtype=torch.float32)
for kind in ("torch", "rp", "rp-fused", "rp-bf16"):
    opt = gpu_optim.make_optimizer(kind, pipe.optim_parameters())
    pipe.forward_backward(input_args=(x,), label=x, loss_fn=lm_loss)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
pipe.close()
assert PHASES["RoundPipe._finish"] and PHASES["ModelState.publish"], sorted(PHASES)
print("gpu parts ok")
"""


@pytest.mark.parametrize("script", ["bench/gpu.py", "bench/gpu_optim.py"])
def test_gpu_bench_help_and_no_cuda_exit(forkserver, script, tmp_path):
    _check(forkserver, script, ["--help"], "usage:", tmp_path)
    import torch
    if not torch.cuda.is_available():
        _check(forkserver, script, [], "skipped, no CUDA device", tmp_path)


def test_gpu_bench_cpu_parts(forkserver, tmp_path):
    _check(forkserver, "bench/gpu.py", [], "gpu parts ok", tmp_path,
           code=GPU_PARTS.format(bench=os.path.join(ROOT, "bench")))


# Examples not run by tests/test_example.py, with tiny sizes through their own arguments.
EXAMPLES = [
    ("examples/train_data_parallel.py", ["--steps", "3", "--devices", "2"],
     "1 replica(s) x 2 device(s): 3 steps"),
    ("examples/plot_schedule.py", ["--devices", "2", "--layers", "2", "--out", "s.png",
                                   "--trace", "t.json"], "chart: s.png"),
]


@pytest.mark.parametrize("script, args, expect", EXAMPLES, ids=[s for s, _, _ in EXAMPLES])
def test_example_runs_with_tiny_sizes(forkserver, script, args, expect, tmp_path):
    if script == "examples/plot_schedule.py":
        pytest.importorskip("matplotlib", reason='needs the plot extra: pip install -e ".[plot]"')
    _check(forkserver, script, args, expect, tmp_path)

"""Does the suite catch plausible bugs?  Small mutations of the library, each applied on its
own to a temporary copy of the repository, each checked against the tests that should
catch it.

A mutation is a file, a piece of its text (found exactly once) and its replacement, and
the tests that should fail on it.  For each, this script copies the repository once to a
temporary directory (the working tree is never modified), swaps the text in, runs only
the listed tests (``pytest -x -q -n 0``, under a timeout) and swaps it back:

- caught: the tests failed (or ran past the timeout: a hang is a failure too);
- missed: they passed, so the change went unseen.

Before the mutants, each listed selection of tests runs once unmutated: a mutation whose
tests fail without it is reported as broken, not as caught.  ``--smoke`` runs one
mutation against one test (seconds).  The score and the verdicts are recorded in
docs/reliability.md.

Why not mutmut: it mutates every operator of every line and runs the tests for each, which
for a 20K-line library and a 12-minute suite is days of the 2-core CI machine; this list
holds the mutations that matter (a wrong scale, an off-by-one, a skipped microbatch, a
swapped beta, a missing fsync, ...) with the tests that should see each, in under an hour.

    python bench/mutants.py              # every mutation (tens of minutes)
    python bench/mutants.py --only adamw-swapped-betas fsync-file
    python bench/mutants.py --list
    python bench/mutants.py --smoke      # one mutation, its tests, unmutated and mutated
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import add_smoke_flag  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    original: str  # found exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or files; ``-k`` selections as "file::-k expr"
    what: str  # the bug it stands for


M = Mutant
CKPT = "roundpipe/checkpoint"  # the checkpoint package
MUTANTS: list[Mutant] = [
    # --- passes: the batching proof (pipe(x)'s merge and the backend's split) -----------
    M("merge-stack-dim", "roundpipe/passes/output_merge.py",
      "return _kind(state, d + 1 if dim <= d else d)",
      "return _kind(state, d + 1 if dim < d else d)",
      ("tests/test_stack_cat_merge.py",),
      "a stack at the batch's dimension merged (pipe(x)) and split (the backend) along the "
      "wrong dimension"),
    M("merge-mean-weights", "roundpipe/runtime/microbatch.py",
      "total = total + v * (b / batch)", "total = total + v * (sizes[0] / batch)",
      ("tests/test_microbatch.py", "tests/test_output_merge.py::-k loss"),
      "a mean over unequal microbatches weighted by the first one's size"),
    M("merge-sum-skips-microbatch", "roundpipe/runtime/microbatch.py",
      "for v in values[1:]:\n            total = total + v",
      "for v in values[2:]:\n            total = total + v",
      ("tests/test_microbatch.py", "tests/test_output_merge.py::-k loss"),
      "a sum merge leaves out the second microbatch"),
    M("partition-cut-off-by-one", "roundpipe/passes/partition.py",
      "stop - (r - 1))", "stop - r)", ("tests/test_partition.py",),
      "the balanced cut may leave one unit too few for the parts after it"),
    M("split-grad-mean", "roundpipe/runtime/microbatch.py",
      "return [grad * (b / batch) for b in sizes]", "return [grad / n for b in sizes]",
      ("tests/test_microbatch.py", "tests/test_output_merge.py::-k loss"),
      "the gradient of a mean merge split evenly over unequal microbatches"),
    # --- runtime: keys, accumulation, clipping, losses -----------------------------------
    M("backend-dropout-key-reuse", "roundpipe/backend.py",
      "backend._next_call() if enabled else 0", "1 if enabled else 0",
      ("tests/test_dropout_masks.py",),
      "every torch.compile call reuses the first call's dropout keys"),
    M("pipe-call-counter", "roundpipe/api.py",
      "            if count_call:  # a backward belongs to the forward call that was counted\n"
      "                self._calls += 1",
      "            if count_call:  # a backward belongs to the forward call that was counted\n"
      "                pass",
      ("tests/test_dropout_masks.py",),
      "RoundPipe never advances its call number: every step draws the same masks"),
    M("microbatch-key", "roundpipe/runtime/call.py",
      "RngKey(seed, call, first + mb)", "RngKey(seed, call, first)",
      ("tests/test_dropout_masks.py",), "every microbatch of a call draws the same masks"),
    M("seed-ignores-unit", "roundpipe/ops/rng.py",
      "(key.seed, key.call, key.microbatch, unit, ordinal)",
      "(key.seed, key.call, key.microbatch, 0, ordinal)",
      ("tests/test_dropout_masks.py",), "two dropout layers in two units share a mask"),
    M("dropout-scale", "roundpipe/ops/rng.py",
      "return x * mask * (1.0 / (1.0 - p))", "return x * mask * (1.0 / p)",
      ("tests/test_dropout_masks.py",), "kept elements scaled by 1/p instead of 1/(1-p)"),
    M("native-dropout-scale", "roundpipe/ops/rng.py",
      "scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)", "scale = 0.0 if p >= 1.0 else 1.0",
      ("tests/test_dropout_masks.py", "tests/test_codegen.py"),
      "native_dropout's kept elements not scaled"),
    M("resume-call-number", "roundpipe/api.py",
      'self._calls = int(meta.get("calls", self._calls))', "pass",
      ("tests/test_dropout_masks.py::-k resumed", "tests/test_weight_prediction.py::-k resume"),
      "a resumed run restarts the call number: it redraws the first steps' masks"),
    M("accumulate-drops-pending", "roundpipe/runtime/host_state.py",
      "total = pending + total", "total = total",
      ("tests/test_grad_landing.py::-k accumulat or kept", "tests/test_optim.py::-k accumulated"),
      "gradients of an earlier call held in low precision are dropped, not accumulated"),
    M("loss-check-skips-microbatch", "roundpipe/runtime/job_runner.py",
      "for mb, loss in enumerate(self.call.losses):",
      "for mb, loss in enumerate(self.call.losses[1:], 1):",
      ("tests/test_loss_check.py", "tests/test_faults.py::-k loss or finite"),
      "a non-finite loss of the first microbatch is not seen"),
    M("clip-scales-up", "roundpipe/runtime/grad_norm.py",
      "coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)",
      "coef = max_norm / (total + 1e-6)",
      ("tests/test_grad_clip.py::-k scales_down", "tests/test_grad_clip.py"),
      "clipping also scales small gradients up"),
    M("memory-estimate-scale", "roundpipe/passes/memory.py",
      "return weights + peak + (grads if accumulated else 0)",
      "return weights + int(peak * 1.05) + (grads if accumulated else 0)",
      ("tests/test_memory_model.py::-k band and gpt",),
      "the stage memory estimate 5% of its activations too high"),
    M("memory-estimate-2.5pct", "roundpipe/passes/memory.py",
      "return weights + peak + (grads if accumulated else 0)",
      "return int((weights + peak + (grads if accumulated else 0)) * 1.025)",
      ("tests/test_memory_model.py::-k band and gpt",),
      "every stage's memory estimate 2.5% high (inside the old [0.95, 1.15] band)"),
    M("device-memory-no-prefetch", "roundpipe/plan.py",
      "+ max(s.param_bytes for s in self.stages))", "+ 0)",
      ("tests/test_memory_model.py::-k bounds",),
      "the device memory leaves out the weights prefetched for the next job"),
    M("upload-bytes-miscounted", "roundpipe/runtime/devices.py",
      "            self._up[category] += nbytes",
      "            self._up[category] += nbytes + (nbytes if category == \"activations\" else 0)",
      ("tests/test_runtime_train.py::-k stats_report", "tests/test_streaming.py"),
      "activation uploads counted twice in the transfer stats"),
    # --- optim ---------------------------------------------------------------------------
    M("adamw-swapped-betas", "roundpipe/optim/adamw.py",
      'beta1, beta2 = (float(b) for b in group["betas"])\n        hyper',
      'beta2, beta1 = (float(b) for b in group["betas"])\n        hyper',
      ("tests/test_optim.py::-k AdamW",), "AdamW's betas swapped"),
    M("sgd-dampening", "roundpipe/optim/sgd.py",
      'dampening=float(group["dampening"])', "dampening=0.0",
      ("tests/test_optim.py::-k SGD",), "SGD's dampening ignored"),
    # --- checkpoint ----------------------------------------------------------------------
    M("fsync-file", "roundpipe/runtime/atomic_file.py",
      "            os.fsync(f.fileno())\n        os.replace(temp, path)",
      "            pass\n        os.replace(temp, path)",
      ("tests/test_checkpoint_durable.py",), "the checkpoint file is not flushed to disk"),
    M("fsync-directory", "roundpipe/runtime/atomic_file.py",
      "    fsync_directory(directory)  # the rename itself survives a power loss",
      "    pass", ("tests/test_checkpoint_durable.py",),
      "the rename of a checkpoint file is not flushed to disk"),
    M("fsync-sharded-swap", f"{CKPT}/sharded.py",
      "    os.replace(temp_dir, path)\n    fsync_directory(directory)",
      "    os.replace(temp_dir, path)", ("tests/test_checkpoint_durable.py",),
      "the swap of a sharded checkpoint's directory is not flushed to disk"),
    M("dcp-files-not-synced", f"{CKPT}/sharded.py",
      "FileSystemWriter(temp_dir, sync_files=True)",
      "FileSystemWriter(temp_dir, sync_files=False)", ("tests/test_checkpoint_durable.py",),
      "the files of a sharded checkpoint are not flushed to disk"),
    M("fsync-safetensors", f"{CKPT}/export.py",
      "                os.fsync(f.fileno())\n", "                pass\n",
      ("tests/test_checkpoint_durable.py",), "an exported safetensors shard is not flushed"),
]

# The smoke's mutation and test: a pure-Python test (no model to trace), so that each of
# the two pytest runs costs little more than its interpreter's start.
SMOKE = "partition-cut-off-by-one"
SMOKE_TESTS = ("tests/test_partition.py::test_min_max_partition_hand_worked",)
# Plugins none of the listed tests use, left out of the smoke's runs (their imports).
SMOKE_NO_PLUGINS = ("-p", "no:anyio", "-p", "no:benchmark")


def _pytest_args(tests: tuple[str, ...]) -> list[list[str]]:
    """One pytest command line per entry (a "file::-k expr" selection needs its own)."""
    runs = []
    for t in tests:
        if "::-k " in t:
            path, expr = t.split("::-k ", 1)
            runs.append([path, "-k", expr])
        else:
            runs.append([t])
    return runs


def _run_tests(copy: str, tests: tuple[str, ...], timeout: float,
               extra: tuple[str, ...] = ()) -> tuple[str, float, str]:
    """'pass', 'fail' or 'timeout' for ``tests`` in ``copy``, its seconds and its last lines
    (``extra``: more pytest options)."""
    env = {**os.environ, "PYTHONPATH": copy, "OMP_NUM_THREADS": "1"}
    start, tail = time.perf_counter(), ""
    for args in _pytest_args(tests):
        left = timeout - (time.perf_counter() - start)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
               "-W", "ignore", *extra, *args]
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                                  timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start, ""
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        if proc.returncode == 5:  # nothing collected: a stale test name, not a catch
            raise SystemExit(f"no tests selected by {' '.join(args)}:\n{tail}")
        if proc.returncode != 0:
            return "fail", time.perf_counter() - start, tail
    return "pass", time.perf_counter() - start, tail


def _copy_repo(dest: str) -> None:
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", ".pytest_cache", "results", ".hypothesis"))


def _mutate(copy: str, m: Mutant) -> str:
    """Apply ``m`` in ``copy``; returns the file's text before, for :func:`_restore`."""
    path = os.path.join(copy, m.path)
    with open(path) as f:
        text = f.read()
    if text.count(m.original) != 1:
        raise SystemExit(f"{m.name}: the original text occurs {text.count(m.original)} times "
                         f"in {m.path} (the code moved? update the list)")
    with open(path, "w") as f:
        f.write(text.replace(m.original, m.replacement, 1))
    return text


def _restore(copy: str, m: Mutant, text: str) -> None:
    with open(os.path.join(copy, m.path), "w") as f:
        f.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only these mutations (names)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per mutation's tests (a hang counts as caught)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the tests")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28s} {m.path:36s} {m.what}")
        return
    chosen = list(MUTANTS)
    extra = SMOKE_NO_PLUGINS if args.smoke else ()
    if args.smoke:
        chosen = [Mutant(m.name, m.path, m.original, m.replacement, SMOKE_TESTS, m.what)
                  for m in chosen if m.name == SMOKE]
    elif args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            raise SystemExit(f"unknown mutations: {sorted(unknown)}")
        chosen = [m for m in chosen if m.name in args.only]
    with tempfile.TemporaryDirectory(prefix="roundpipe-mutants-") as tmp:
        copy = os.path.join(tmp, "repo")
        _copy_repo(copy)
        for m in chosen:  # every original text is where the list says, before any run
            _restore(copy, m, _mutate(copy, m))
        broken: set[str] = set()
        if not args.no_baseline:  # each selection once, unmutated
            for t in dict.fromkeys(t for m in chosen for t in m.tests):
                verdict, seconds, tail = _run_tests(copy, (t,), args.timeout, extra)
                print(f"baseline {t}: {verdict} in {seconds:.0f} s", flush=True)
                if verdict != "pass":
                    broken.add(t)
                    print(tail, flush=True)
        caught = []
        for m in chosen:
            if broken & set(m.tests):
                print(f"broken {m.name:28s} its tests fail unmutated", flush=True)
                continue
            text = _mutate(copy, m)
            try:
                verdict, seconds, tail = _run_tests(copy, m.tests, args.timeout, extra)
            finally:
                _restore(copy, m, text)
            status = "missed" if verdict == "pass" else "caught"
            if status == "caught":
                caught.append(m.name)
            print(f"{status:6s} {m.name:28s} {seconds:5.0f} s  {m.what}"
                  + (f" ({verdict})" if verdict == "timeout" else ""), flush=True)
        print(f"score: {len(caught)}/{len(chosen)} caught"
              + (f"; missed: {', '.join(m.name for m in chosen if m.name not in caught)}"
                 if len(caught) < len(chosen) else ""))


if __name__ == "__main__":
    main()

"""A wrong input shape is one short error naming the user's argument, its whole-batch shape
and the model's line, at compile time or at the call; torch's fake-tensor ERROR logs from
roundpipe's tracing stay out of the user's terminal."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.nn as nn

import roundpipe
from roundpipe import InputError, RoundPipe, RoundPipeRunConfig, TraceError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))  # the line a wrong width fails on
        return self.fc2(h)


def test_an_example_the_model_cannot_run_is_a_trace_error_before_any_plan():
    """Before: export failed, the fx fallback returned a plan (the cause only in
    plan.notes) and the first call failed inside a stage."""
    with pytest.raises(TraceError) as info:
        roundpipe.compile(Net(), example_args=(torch.randn(16, 33),), devices=["cpu"] * 2)
    message = str(info.value)
    assert "Net cannot run the example input (input_args[0] (16, 33) float32)" in message
    assert "16x33 and 32x16" in message and "(6x33" not in message
    assert "test_messages_shapes.py" in message and "h = torch.relu(self.fc1(x))" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value.original, RuntimeError)  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["forward_backward", "forward"])
def test_a_call_of_the_wrong_shape_is_one_input_error_with_the_whole_batch(how):
    """Before: a StageError quoting the microbatch's shape (6x33), after pages of logs."""
    with RoundPipe(Net(), devices=["cpu"] * 2) as pipe:
        pipe.forward_backward(input_args=(torch.randn(16, 32),), loss_fn=lambda o, _: o.sum())
        x = torch.randn(16, 33)
        with pytest.raises(InputError) as info:
            if how == "forward":
                pipe(x)
            else:
                pipe.forward_backward(input_args=(x,), loss_fn=lambda o, _: o.sum())
    message = str(info.value)
    assert "Net cannot run this call's inputs (input_args[0] (16, 33) float32)" in message
    assert "16x33 and 32x16" in message and "(6x33" not in message
    assert "h = torch.relu(self.fc1(x))" in message


class Stateful(nn.Module):
    """BatchNorm in training updates its running statistics when run; dropout draws."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(torch.dropout(self.bn(self.fc(x)), 0.5, True))


def test_the_example_run_that_tells_the_cases_apart_leaves_no_trace(monkeypatch):
    """Where export fails, the model runs once eagerly before the fx fallback: its
    buffers and the RNG are as they were, and the fallback's plan is returned."""
    from roundpipe.passes import trace as trace_pass

    def export_fails(*args, **kwargs):
        raise RuntimeError("export is not available in this test")

    torch.manual_seed(0)
    model = Stateful()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    trace_pass.refuse_unrunnable_example(model, (x,), {})
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert torch.equal(torch.get_rng_state(), rng)
    monkeypatch.setattr(trace_pass, "_trace_export_sharing", export_fails)
    pipe = roundpipe.compile(model, example_args=(x,), devices=["cpu"] * 2)
    try:
        assert pipe.plan.program.trace_method == "fx"
    finally:
        pipe.close()


# One fresh interpreter imports what the script imports, then forks a child per scenario
# (an interpreter start and the imports cost seconds each): each child runs the scenario
# as a script's top level, its own stdout and stderr going to its own files, and dies as
# the script would (an uncaught error: its traceback, status 1).  What the imports print
# goes to the parent's stdout and stderr, read into every scenario's output: a user runs
# the imports and the scenario in one process.
SCRIPT = """
import atexit, os, sys, threading
import logging, torch, torch.nn as nn, roundpipe
from roundpipe import RoundPipe

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h)

def scenario(when, log):
    if log == "debug":
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("roundpipe").setLevel(logging.DEBUG)
    if when == "compile":
        roundpipe.compile(Net(), example_args=(torch.randn(16, 33),), devices=["cpu"] * 2)
    else:
        with RoundPipe(Net(), devices=["cpu"] * 2) as pipe:
            pipe.forward_backward(input_args=(torch.randn(16, 32),), loss_fn=lambda o, _: o.sum())
            pipe.forward_backward(input_args=(torch.randn(16, 33),), loss_fn=lambda o, _: o.sum())

out_dir = sys.argv[1]
sys.stdout.flush()
sys.stderr.flush()
for name in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        for fd, stream in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(out_dir, f"{name}.{stream}"), os.O_WRONLY | os.O_CREAT)
            os.dup2(f, fd)
            os.close(f)
        code = 0
        try:
            scenario(*name.split("-"))
        except BaseException as e:  # what the interpreter prints (its hook), from the
            e.with_traceback(e.__traceback__.tb_next)  # scenario's frame (the top level)
            sys.__excepthook__(type(e), e, e.__traceback__)
            code = 1
        threading._shutdown()  # as an interpreter's exit: join threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(out_dir, f"{name}.rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""
SCENARIOS = ("compile-plain", "call-plain", "compile-debug")


@functools.cache
def _outputs() -> dict[str, tuple[int, str]]:
    """Per scenario: exit status and what the user's terminal shows (stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    with tempfile.TemporaryDirectory() as out_dir:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), out_dir,
                                 *SCENARIOS], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs = {}
        for name in SCENARIOS:
            def read(stream):
                with open(os.path.join(out_dir, f"{name}.{stream}")) as f:
                    return f.read()
            outputs[name] = (int(read("rc")), result.stdout + read("out") + result.stderr
                             + read("err"))
    return outputs


def _run(when: str, log: str) -> str:
    code, out = _outputs()[f"{when}-{log}"]
    assert code == 1, out
    return out


@pytest.mark.parametrize("when", ["compile", "call"])
def test_a_wrong_shape_prints_a_screen_not_pages(when):
    """Before: 114 (compile) and 185-210 (call) lines, mostly torch's fake-tensor ERROR
    logs; eager PyTorch prints 22 for the same mistake."""
    out = _run(when, "plain")
    lines = out.strip().splitlines()
    assert len(lines) <= 22, out
    assert "failed while attempting to run meta" not in out
    assert lines[-1].startswith("roundpipe.errors." + ("TraceError" if when == "compile"
                                                        else "InputError")), lines[-1]
    assert "(16, 33)" in lines[-1]


def test_torchs_fake_tensor_errors_go_to_roundpipes_debug_log():
    """Silenced for the user, kept for whoever asks for roundpipe's debug log."""
    out = _run("compile", "debug")
    assert "DEBUG:roundpipe" in out and "failed while attempting to run meta" in out
    assert "ERROR:torch._subclasses.fake_tensor" not in out


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_the_example_run_does_not_count_as_tracing_for_hooks_that_keep_activations(
        monkeypatch):
    """The example's eager run (export failed) calls the user's forward hooks on real
    tensors; one that keeps its activations (feats.append(out), fine on the fx fallback,
    which runs it at each call) was refused as if tracing had handed it a fake tensor."""
    from roundpipe.passes import trace as trace_pass

    def export_fails(*args, **kwargs):
        raise RuntimeError("export is not available in this test")

    monkeypatch.setattr(trace_pass, "_trace_export_sharing", export_fails)
    runs = []
    for front in ("pipe", "eager"):
        torch.manual_seed(0)
        model = Hooked().double()
        feats: list[torch.Tensor] = []
        model.layers[1].register_forward_hook(lambda m, i, out: feats.append(out.detach()))
        x = torch.randn(6, 4, dtype=torch.float64)
        if front == "pipe":
            with RoundPipe(model, devices=["cpu"] * 2,
                           model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
                pipe.compile(x)
                assert pipe.plan.program.trace_method == "fx"
                feats.clear()
                pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
        else:
            for xb in x.chunk(2):
                model(xb).sum().backward()
        runs.append(feats)
    assert len(runs[0]) == len(runs[1]) == 2
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

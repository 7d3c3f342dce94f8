"""RoundPipe's public seams for integrations (docs/guide.md, "Seams for integrations"):
``pipe.wait()``, ``pipe.has_masters``, ``pipe.resolve_run_config()``, and
``roundpipe.optim``'s ``step_pairs``, which bench/optimizer.py times the kernels with."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import roundpipe.optim
from roundpipe import RoundPipe, RoundPipeRunConfig, StepError


def _pipe(**kwargs) -> RoundPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    return RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2), **kwargs)


def _call(pipe: RoundPipe) -> None:
    x = torch.randn(4, 4)
    pipe.forward_backward(input_args=(x,), label=x, loss_fn=F.mse_loss)


@pytest.mark.parametrize("optim_dtype, expected", [(torch.float32, True), (None, False)])
def test_has_masters_says_whether_the_optimizer_updates_copies(optim_dtype, expected):
    with _pipe(optim_dtype=optim_dtype) as pipe:
        assert pipe.has_masters is expected
        model_params = {id(p) for p in pipe.model.parameters()}
        # with masters the optimizer's tensors are not the model's own parameters
        assert all((id(p) in model_params) is (not expected) for p in pipe.optim_parameters())


def test_resolve_run_config_is_what_a_call_uses():
    with _pipe() as pipe:
        assert pipe.resolve_run_config().num_microbatch == 2
        assert pipe.resolve_run_config(RoundPipeRunConfig(num_microbatch=4)).num_microbatch == 4
        assert pipe.model_run_config.num_microbatch == 2  # nothing changed
        x = torch.randn(4, 4)
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=F.mse_loss,
                              run_config=RoundPipeRunConfig(num_microbatch=4))
        assert pipe.plan.num_microbatch == 4


@pytest.mark.parametrize("optim_dtype", [torch.float32, None])
def test_wait_returns_after_the_step_in_flight(optim_dtype):
    with _pipe(optim_dtype=optim_dtype) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        _call(pipe)
        before = [p.detach().clone() for p in pipe.optim_parameters()]
        done = threading.Event()

        def slow_step() -> None:
            time.sleep(0.3)
            opt.step()
            opt.zero_grad()
            done.set()

        pipe.step(slow_step, is_async=True)
        pipe.wait()
        assert done.is_set()
        assert any(not torch.equal(a, p) for a, p in zip(before, pipe.optim_parameters()))


def test_wait_raises_the_failed_step():
    with _pipe(optim_dtype=torch.float32) as pipe:
        _call(pipe)

        def failing() -> None:
            raise RuntimeError("boom in step_fn")

        pipe.step(failing, is_async=True)
        with pytest.raises(StepError, match="boom in step_fn"):
            pipe.wait()


@pytest.mark.parametrize("make", [
    lambda ps: roundpipe.optim.AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16),
    lambda ps: roundpipe.optim.SGD(ps, lr=1e-2, momentum=0.9, state_dtype=torch.bfloat16),
])
def test_step_pairs_equals_step(make):
    """step_pairs runs what step runs after finding the gradients (state allocated on the
    first step, SGD's first momentum the gradient itself), bit for bit."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(64))
    b = nn.Parameter(a.detach().clone())
    opt_a, opt_b = make([a]), make([b])
    for _ in range(3):
        g = torch.randn(64)
        a.grad = g.clone()
        opt_a.step()
        opt_b.step_pairs([(b, g.clone())])
        assert torch.equal(a, b)
    assert set(opt_a.state[a]) == set(opt_b.state[b])
    for key, value in opt_a.state[a].items():
        assert torch.equal(value, opt_b.state[b][key]), key

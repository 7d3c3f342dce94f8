"""With fp32/fp64 masters, a parameter's tensor hooks under ``pipe(x)`` + ``backward()``
run once per backward pass, on the gradient summed over every pipelined call the pass
reaches, as eager's one backward runs them (before, once per call on its own part: a
non-linear hook such as a clamp differed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from roundpipe import ParameterHookError, RoundPipe, RoundPipeRunConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh())
                           for _ in range(3))).double()


def _clamp(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.05, 0.05)  # not linear: the sum's clamp is not the clamps' sum


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, dtype=torch.double, generator=g) for _ in range(3)]


def _eager(model: nn.Module, xs, calls: int) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    model[1][0].weight.register_hook(_clamp)
    counted = []
    model[2][0].bias.register_hook(lambda g: counted.append(1))
    loss = sum((model(x) ** 2).sum() * (i + 1) for i, x in enumerate(xs[:calls]))
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, len(counted)


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("calls", [1, 2, 3])
def test_hooks_run_once_on_the_gradient_summed_over_the_pipelined_calls(devices, calls):
    base = _model()
    want, want_count = _eager(base, _inputs(), calls)
    model = copy.deepcopy(base)
    model[1][0].weight.register_hook(_clamp)
    counted = []
    model[2][0].bias.register_hook(lambda g: counted.append(1))
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        xs = _inputs()
        loss = sum((pipe(x) ** 2).sum() * (i + 1) for i, x in enumerate(xs[:calls]))
        loss.backward()
        got = {n: p.grad for n, p in pipe.optim_named_parameters()}
    assert len(counted) == want_count == 1
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, atol=1e-12, rtol=1e-10), name
    # the check can fail: the clamp bites on the sum, unlike on one call's part
    if calls > 1:
        assert (want["1.0.weight"].abs() == 0.05).any()


def test_a_raising_hook_commits_nothing_of_the_pass_and_the_next_pass_is_clean():
    model = _model()
    boom = [True]

    def hook(g):
        if boom[0]:
            raise RuntimeError("hook failed")
    model[1][0].weight.register_hook(hook)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        xs = _inputs()
        loss = (pipe(xs[0]) ** 2).sum() + (pipe(xs[1]) ** 2).sum()
        with pytest.raises(RuntimeError, match="hook failed"):
            loss.backward()
        assert all(p.grad is None for p in pipe.optim_parameters())
        boom[0] = False
        loss = (pipe(xs[2]) ** 2).sum()
        loss.backward()
        eager = copy.deepcopy(_model())
        (eager(xs[2]) ** 2).sum().backward()
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-12), name


def test_post_accumulate_hooks_with_masters_stay_refused():
    model = _model()
    model[0][0].weight.register_post_accumulate_grad_hook(lambda p: None)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64) as pipe:
        with pytest.raises(ParameterHookError):
            (pipe(_inputs()[0]) ** 2).sum().backward()


@pytest.mark.parametrize("separate_pass", [False, True])
def test_a_parameter_used_outside_the_pipe_gets_its_whole_gradient_on_its_master(
        separate_pass):
    """With masters, autograd puts the gradient of a use outside the pipe on the model's
    parameter; the optimizer reads the master.  It is added to the master (it was
    silently dropped: the optimizer stepped on the pipe's part alone)."""
    base = _model()
    xs = _inputs()
    eager = copy.deepcopy(base)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for x in xs[:2]:
        if separate_pass:
            (eager(x) ** 2).sum().backward()
            (eager[0][0].weight ** 2).sum().backward()
        else:
            ((eager(x) ** 2).sum() + (eager[0][0].weight ** 2).sum()).backward()
        opt_e.step()
        opt_e.zero_grad()
    model = copy.deepcopy(base)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        for x in xs[:2]:
            if separate_pass:
                (pipe(x) ** 2).sum().backward()
                (model[0][0].weight ** 2).sum().backward()
            else:
                ((pipe(x) ** 2).sum() + (model[0][0].weight ** 2).sum()).backward()
            pipe.step(opt)
        pipe.synchronize()
        assert model[0][0].weight.grad is None
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.allclose(p, q, atol=1e-12, rtol=1e-10), name


def test_a_hooked_parameter_used_inside_and_outside_in_one_backward_is_refused():
    model = _model()
    model[0][0].weight.register_hook(_clamp)
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=1)) as pipe:
        x = _inputs()[0]
        with pytest.raises(ParameterHookError, match="inside the pipe and outside"):
            ((pipe(x) ** 2).sum() + (model[0][0].weight ** 2).sum()).backward()
        assert all(p.grad is None for p in pipe.optim_parameters())
        assert model[0][0].weight.grad is None

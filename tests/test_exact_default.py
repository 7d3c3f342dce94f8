"""Exact steps are the default: ``pipe.step(fn)`` and ``RoundPipeTrainer`` update the
weights before the next call unless asynchronous steps are asked for, so a user who swaps
roundpipe into a plain PyTorch loop gets eager's training."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)))


def _losses(model: nn.Module, **step_kwargs) -> list[torch.Tensor]:
    torch.manual_seed(1)
    data = [(torch.randn(6, 8), torch.randn(6, 8)) for _ in range(4)]
    with RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        opt = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
        losses = []
        for x, y in data:
            losses.append(pipe.forward_backward(
                input_args=(x.to(torch.bfloat16),), label=y.to(torch.bfloat16),
                loss_fn=lambda o, t: F.mse_loss(o.float(), t.float())))
            pipe.step(lambda: (opt.step(), opt.zero_grad()), **step_kwargs)
        pipe.synchronize()
    return losses


def test_the_default_step_is_exact_on_a_bf16_model_with_fp32_masters() -> None:
    base = _model().to(torch.bfloat16)
    default = _losses(copy.deepcopy(base))
    exact = _losses(copy.deepcopy(base), is_async=False)
    stale = _losses(copy.deepcopy(base), is_async=True)
    for a, b in zip(default, exact):
        assert torch.equal(a, b)
    # the asynchronous schedule differs from the third call on, so the check can fail
    assert not torch.equal(torch.stack(stale), torch.stack(exact))


def test_the_default_step_equals_eager_training() -> None:
    torch.manual_seed(2)
    model = _model().double()
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.3)
    with RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.3)
        for step in range(3):
            x = torch.randn(4, 8, dtype=torch.double)
            want = reference.eager_forward_backward(eager, (x,), {}, x, F.mse_loss, 2)
            opt_e.step()
            opt_e.zero_grad()
            got = pipe.forward_backward(input_args=(x,), label=x, loss_fn=F.mse_loss)
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        pipe.synchronize()
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_trainer_defaults_to_exact_steps() -> None:
    import inspect

    from roundpipe.hf import RoundPipeTrainer
    assert inspect.signature(RoundPipeTrainer.__init__).parameters["async_step"].default \
        is False

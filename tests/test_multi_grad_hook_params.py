"""``torch.autograd.graph.register_multi_grad_hook`` over parameters of the pipe's model:
roundpipe runs a parameter's hooks outside the backward that reaches the parameter (on
the device's leaf copy, or on the host at the commit), where the multi-grad hook cannot
count the tensors the backward reaches: it was never called (eager: once per
microbatch's backward).  Refused before anything runs, naming the parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from roundpipe import ParameterHookError, RoundPipe, RoundPipeRunConfig


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return x


def _loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o - t) ** 2).sum()


@pytest.mark.parametrize("front", ["forward_backward", "call"])
@pytest.mark.parametrize("mode", ["all", "any"])
@pytest.mark.parametrize("masters", [False, True])
def test_multi_grad_hook_over_pipe_parameters_is_refused(front, mode, masters):
    torch.manual_seed(0)
    model = Net().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    calls = []
    handle = torch.autograd.graph.register_multi_grad_hook(
        (model.blocks[0].weight, model.blocks[2].weight), calls.append, mode=mode)
    with RoundPipe(model, devices=["cpu"] * 2,
                   optim_dtype=torch.float64 if masters else None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        with pytest.raises(ParameterHookError,
                           match=r"'blocks\.0\.weight'.*register_multi_grad_hook"):
            if front == "forward_backward":
                pipe.forward_backward((x,), label=y, loss_fn=_loss)
            else:
                _loss(pipe(x), y).backward()
        assert calls == []
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
            assert p.grad is None, n
        for _, m in pipe.optim_named_parameters():
            assert m.grad is None
        handle.remove()  # the way out: without it the call runs
        pipe.forward_backward((x,), label=y, loss_fn=_loss)

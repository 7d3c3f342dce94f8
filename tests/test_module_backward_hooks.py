"""Module backward hooks on a submodule (kept opaque, so torch runs them) run as often as in
eager's per-microbatch loop, and see the same gradients: never during compilation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh())
                                      for _ in range(3)))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


@pytest.mark.parametrize("pre", [False, True], ids=["full_backward", "backward_pre"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_submodule_backward_hook_runs_as_often_as_in_eager(pre: bool, grain: str,
                                                               devices: int) -> None:
    # The memory model's fake-tensor replay of each job ran the hook once more at compile
    # time (5 calls where eager makes 4, the extra one on a fake tensor).
    torch.manual_seed(0)
    model = Net().double()
    x, y = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 4, dtype=torch.double)

    def install(m: nn.Module, seen: list) -> None:
        if pre:
            m.blocks[1].register_full_backward_pre_hook(
                lambda mod, g_out: seen.append(g_out[0].detach().clone()))
        else:
            m.blocks[1].register_full_backward_hook(
                lambda mod, g_in, g_out: seen.append(g_out[0].detach().clone()))

    eager, eager_seen = copy.deepcopy(model), []
    install(eager, eager_seen)
    for _ in range(2):
        reference.eager_forward_backward(eager, (x,), {}, y, _loss, 2)

    piped, seen = copy.deepcopy(model), []
    install(piped, seen)
    with RoundPipe(piped, devices=["cpu"] * devices, optim_dtype=None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2,
                                                       recompute_grain=grain)) as pipe:
        for _ in range(2):
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        grads = {n: p.grad for n, p in pipe.optim_named_parameters()}
    assert len(seen) == len(eager_seen) == 4
    for got, want in zip(seen, eager_seen):
        assert not isinstance(got, torch._subclasses.FakeTensor)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("pre", [False, True], ids=["full_backward", "backward_pre"])
def test_pipe_call_with_a_module_backward_hook_is_refused_when_split(pre: bool) -> None:
    """pipe(x).backward() is eager's backward of the whole batch: a module backward hook
    would run once per microbatch instead. Refused before anything runs; one microbatch is
    exact."""
    from roundpipe import ModelError

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(4, 4, dtype=torch.double)

    def install(m: nn.Module, seen: list) -> None:
        def hook(mod, *grads):
            seen.append(grads[-1][0].shape)
        if pre:
            m.blocks[2].register_full_backward_pre_hook(hook)
        else:
            m.blocks[2].register_full_backward_hook(hook)

    eager, eager_seen = copy.deepcopy(model), []
    install(eager, eager_seen)
    eager(x).pow(2).sum().backward()

    piped, seen = copy.deepcopy(model), []
    install(piped, seen)
    with RoundPipe(piped, devices=["cpu"] * 2, optim_dtype=None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        with pytest.raises(ModelError, match="module 'blocks.2' has a module backward hook"):
            pipe(x)
        assert seen == [] and all(p.grad is None for p in pipe.optim_parameters())
        pipe(x, run_config=RoundPipeRunConfig(num_microbatch=1)).pow(2).sum().backward()
        grads = {n: p.grad for n, p in pipe.optim_named_parameters()}
    assert seen == eager_seen == [torch.Size([4, 4])]
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_the_backend_runs_a_submodule_backward_hook_as_eager() -> None:
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(6, 4, dtype=torch.double)

    def install(m: nn.Module, seen: list) -> None:
        def hook(mod, grad_in, grad_out):
            seen.append(grad_out[0].detach().clone())
            return (grad_in[0] / grad_in[0].norm(),)  # mixes samples: per microbatch differs
        m.blocks[1].register_full_backward_hook(hook)

    eager, eager_seen = copy.deepcopy(model), []
    install(eager, eager_seen)
    eager(x).pow(2).sum().backward()
    compiled, seen = copy.deepcopy(model), []
    install(compiled, seen)
    torch._dynamo.reset()
    try:
        run = torch.compile(compiled, backend="roundpipe",
                            options={"num_microbatch": 2, "devices": ["cpu"] * 2})
        run(x).pow(2).sum().backward()
    finally:
        torch._dynamo.reset()
    assert len(seen) == len(eager_seen) == 1
    torch.testing.assert_close(seen[0], eager_seen[0], rtol=1e-12, atol=1e-14)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14, msg=name)

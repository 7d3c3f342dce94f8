"""An opaque module whose ``forward`` was replaced on the instance (TRL's fused LM head,
accelerate's autocast wrapper: ``model.forward = MethodType(f, model)``) runs on the
device's copies of its weights: the per-call twin rebinds such methods to itself, so the
gradients reach the masters instead of the model's own parameters."""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn

from roundpipe import RoundPipe, RoundPipeRunConfig


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _patched_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(self.lin(x)) * 2  # reads the weights through ``self``


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_instance_patched_forward_of_an_opaque_module_trains_the_masters():
    torch.manual_seed(0)
    model = Net()
    model.blocks[1].forward = types.MethodType(_patched_forward, model.blocks[1])
    eager = copy.deepcopy(model)
    eager.blocks[1].forward = types.MethodType(_patched_forward, eager.blocks[1])
    x = torch.randn(6, 8)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     leaf_modules=["blocks.1"],
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    loss = pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.square().sum())
    ref = eager(x).square().sum()
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    grads = {n: p.grad for n, p in pipe.optim_named_parameters()}
    for name, p in eager.named_parameters():
        assert grads[name] is not None, name
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name
    # The model's own parameters never receive a gradient: the devices used copies.
    assert all(p.grad is None for p in model.parameters())

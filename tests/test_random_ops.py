"""Every random op inside a model is keyed like dropout: the same values on 1 and N
devices, wherever the stage boundaries fall, and the same values replayed in recompute.

Random factories (``torch.randn(shape)``, ``rand``, ``randint``, ``randperm``) carry their
own ``device=``; they used to fail with ``seeded() got multiple values for argument
'device'``.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig

DRAWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "randn": lambda x: torch.randn(x.shape, dtype=x.dtype) * 0.1,
    "rand": lambda x: torch.rand(x.shape[0], 1, dtype=x.dtype),
    "randint": lambda x: torch.randint(0, 2, x.shape).to(x.dtype),
    "randperm": lambda x: x[:, torch.randperm(x.shape[1])],
    "randn_device": lambda x: torch.randn(x.shape, dtype=x.dtype, device=x.device),
    "normal_": lambda x: torch.empty(x.shape[1], dtype=x.dtype).normal_(),
    "randn_like": lambda x: torch.randn_like(x),
    "bernoulli": lambda x: torch.bernoulli(torch.full_like(x, 0.7)),
    "normal_tensor": lambda x: torch.normal(torch.zeros_like(x), torch.ones_like(x)),
    "multinomial": lambda x: torch.multinomial(x.abs() + 0.1, 2).to(x.dtype).sum(-1,
                                                                                keepdim=True),
    "in_no_grad": lambda x: _no_grad_randn(x),
    "rsample": lambda x: torch.distributions.Normal(x, torch.ones_like(x)).rsample(),
}


def _no_grad_randn(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        noise = torch.randn(x.shape, dtype=x.dtype)
    return x * noise


class NoisyBlock(nn.Module):
    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h * self.draw(h) + h


class NoisyNet(nn.Module):
    def __init__(self, draw: Callable[[torch.Tensor], torch.Tensor], depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NoisyBlock(draw) for _ in range(depth))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _run(model: nn.Module, devices: int, x: torch.Tensor, y: torch.Tensor,
         num_stages: int | None = None, grain: str = "stage"
         ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    with RoundPipe(copy.deepcopy(model), devices=["cpu"] * devices, seed=11,
                   num_stages=num_stages,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3,
                                                       recompute_grain=grain)) as pipe:
        loss, out = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss,
                                          return_outputs=True)
        return loss, [p.grad.clone() for p in pipe.optim_parameters()], out


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_random_ops_are_keyed(draw: str) -> None:
    torch.manual_seed(0)
    model = NoisyNet(DRAWS[draw]).double()
    x = torch.randn(6, 8, dtype=torch.double)
    y = torch.randn(6, 1, dtype=torch.double)
    base_loss, base_grads, base_out = _run(model, 1, x, y)
    # other device counts and stage counts move the boundaries (and move the noisy units
    # between the fused stage, never recomputed, and backward stages, recomputed)
    for devices, stages, grain in ((3, None, "stage"), (2, None, "layer"), (1, 5, "stage"),
                                   (4, 3, "layer")):
        loss, grads, out = _run(model, devices, x, y, stages, grain)
        assert torch.equal(loss, base_loss), (devices, stages, grain)
        assert torch.equal(out, base_out), (devices, stages, grain)
        for a, b in zip(grads, base_grads):
            assert torch.equal(a, b), (devices, stages, grain)


def test_recompute_replays_the_forwards_draws() -> None:
    """A block whose output is its own noise: the backward's recompute must multiply by
    the same noise the forward returned, or the weight gradient disagrees with it."""
    torch.manual_seed(0)

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, dtype=torch.double))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            noise = torch.randn(x.shape, dtype=x.dtype)
            return x * self.w * noise, noise

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Scale() for _ in range(3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            noises = []
            for block in self.blocks:
                x, noise = block(x)
                noises.append(noise)
            return x, torch.stack(noises, 1)  # (batch, block, width)

    x = torch.randn(6, 8, dtype=torch.double)
    with RoundPipe(Net(), devices=["cpu"] * 3, num_stages=4,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        _, (out, noises) = pipe.forward_backward(
            input_args=(x,), loss_fn=lambda o, _: o[0].sum(), return_outputs=True)
        grads = [b.w.grad for b in pipe.model.blocks]
        assert pipe.plan.stages[0].kind == "fwd"  # block 0 is recomputed
    # d(sum x * w0 * n0 * w1 * n1 * w2 * n2)/dw_i with every w = 1
    product = x * noises[:, 0] * noises[:, 1] * noises[:, 2]
    for i in range(3):
        torch.testing.assert_close(grads[i], product.sum(0), rtol=1e-12, atol=1e-12)


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(8, 8)
        self.sd = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # argument validation on (the default): data-dependent checks export cannot trace
        return torch.distributions.Normal(self.mu(x), F.softplus(self.sd(x)) + 0.1).rsample()


class OptionalInputNet(nn.Module):
    """Hugging Face style: an optional argument left at None."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Sampler() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        if extra is not None:
            x = x + extra
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_distribution_sampling_with_an_optional_none_argument() -> None:
    """Used to fail: value 'extra_1' was not produced before it was needed (the torch.fx
    fallback kept a check reading the placeholder of an argument specialised to None)."""
    torch.manual_seed(0)
    model = OptionalInputNet().double()
    x = torch.randn(6, 8, dtype=torch.double)
    y = torch.randn(6, 1, dtype=torch.double)
    results = [_run(model, devices, x, y) for devices in (1, 3)]
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
    with RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2) as pipe:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        # the argument given later: a program of its own, which reads it
        pipe.forward_backward(input_args=(x, torch.ones_like(x)), label=y, loss_fn=F.mse_loss)
        assert len(pipe.plans) == 2
        assert "extra" in pipe.plan.program.inputs.names

"""A call under ``torch.autocast`` runs a program traced under the same autocast, so model
code that branches on a dtype autocast decides takes eager's branch (T5's float16 clamps,
``if h.dtype != torch.float32``); a call without autocast runs the program traced without.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig


class DtypeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.dtype != torch.float32:  # taken only under autocast
            h = h.clamp(-0.05, 0.05) * 10
        return torch.relu(h).float() + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DtypeBranch() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _eager(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool
           ) -> torch.Tensor:
    total = torch.zeros(())
    for a, b in zip(x.chunk(3), y.chunk(3)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.mse_loss(model(a), b)
        loss.backward()
        total = total + loss.detach()
    return total


@pytest.mark.parametrize("devices", [1, 2])
def test_dtype_branches_follow_the_callers_autocast(devices: int) -> None:
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(6, 16), torch.randn(6, 1)
    eager = copy.deepcopy(model)
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        for autocast in (True, False, True):
            for p in pipe.optim_parameters():
                p.grad = None
            eager.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            ref = _eager(eager, x, y, autocast)
            assert torch.equal(loss, ref), (autocast, loss, ref)
            for p, q in zip(pipe.optim_parameters(), eager.parameters()):
                # bf16 gradients summed in another order: within bf16 rounding
                torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)
        assert len(pipe.plans) == 2  # one program per autocast state, reused

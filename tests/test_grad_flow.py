"""Gradients flow through tensors written in place: a model that fills a preallocated
buffer (``outs[:, i] = x``, common in hand-written recurrent code) lost every gradient
upstream of the buffer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb

D = 8


class _FillsABuffer(nn.Module):
    def __init__(self, view_first: bool = False) -> None:
        super().__init__()
        self.view_first = view_first
        self.inp = nn.Linear(D, D)
        self.layer = nn.Linear(D, D)
        self.head = nn.Linear(3 * D, 2)

    def forward(self, x):
        x = self.inp(x)
        outs = torch.zeros(x.shape[0], 3, D, dtype=x.dtype)
        flat = outs.view(x.shape[0], 3 * D)  # a view made before the writes
        for i in range(3):
            x = torch.tanh(self.layer(x))
            outs[:, i] = x
        return self.head(flat if self.view_first else outs.flatten(1))


def _loss(o, t):
    return ((o - t) ** 2).sum()


@pytest.mark.parametrize("devices,view_first", [(1, False), (2, False), (2, True)])
def test_gradients_flow_through_a_buffer_written_in_place(devices, view_first):
    torch.manual_seed(1)
    model = _FillsABuffer(view_first).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, D, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
    expected = reference.eager_forward_backward(eager, (x,), {}, y, _loss, 3)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.model.named_parameters(), eager.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    pipe.close()


def test_the_backend_lets_gradients_flow_through_a_buffer_written_in_place():
    """Torch-level programs write with ``operator.setitem``."""
    rb.reset()
    torch.manual_seed(1)
    model = _FillsABuffer().double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, D, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    compiled = torch.compile(model, backend="roundpipe", options={"devices": ["cpu"] * 2})
    _loss(compiled(x), y).backward()
    _loss(eager(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    rb.reset()

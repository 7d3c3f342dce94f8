"""What autograd asks of a pipelined call, through both front ends (``pipe(x)`` and
``torch.compile(model, backend="roundpipe")``), against eager PyTorch in float64:

* which gradients: ``torch.autograd.grad(out, x)`` and ``backward(inputs=...)`` write
  only what eager writes (no parameter gradient for an input-gradient request);
* how often: double backward (``create_graph=True``) is refused at the first backward,
  with nothing committed;
* outputs eager computes without a graph stay without one (spectral_norm's power
  iteration, which Dynamo stores back into the module's buffers).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.parametrizations import spectral_norm

from roundpipe import backend as rb

TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(autouse=True)
def _float64_and_fresh_dynamo():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()
    rb.reset()
    yield
    torch._dynamo.reset()
    torch.set_default_dtype(previous)


# --- outputs without a graph -------------------------------------------------------------------

class SpectralMLP(nn.Module):
    """Two spectrally normalised layers (``torch.nn.utils.parametrizations``): each call
    runs a power iteration under no_grad that writes the ``_u``/``_v`` buffers and
    returns them, and Dynamo assigns them back to the module."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.a = spectral_norm(nn.Linear(d, d))
        self.b = nn.Linear(d, d)
        self.c = spectral_norm(nn.Linear(d, 3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("devices", [1, 3])
def test_backend_spectral_norm_parametrization_trains_like_eager(devices):
    """The second step's backward failed with "ran twice": the power iteration's outputs
    came back from the pipelined call with a grad_fn, Dynamo stored them as the module's
    ``_u``/``_v``, and the next call sent a gradient to them, into the first call's
    spent backward."""
    torch.manual_seed(0)
    model = SpectralMLP()
    eager = copy.deepcopy(model)
    piped = copy.deepcopy(model)
    compiled = torch.compile(piped, backend=rb.RoundPipeBackend(
        devices=["cpu"] * devices, num_microbatch=1))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(piped.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 5)
        out_e, out_p = eager(x), compiled(x)
        torch.testing.assert_close(out_p, out_e, **TOL)
        out_e.pow(2).sum().backward()
        out_p.pow(2).sum().backward()
        for (name, p), q in zip(piped.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"step {step}: {name}")
        for (name, b), c in zip(piped.named_buffers(), eager.buffers()):
            assert not b.requires_grad, name
            torch.testing.assert_close(b, c, **TOL, msg=f"step {step}: {name}")
        opt_e.step(), opt_p.step(), opt_e.zero_grad(), opt_p.zero_grad()

"""The two front ends, ``roundpipe.compile`` / ``RoundPipe`` and
``torch.compile(model, backend="roundpipe")``, cut a model by one rule and train it the
same: one pass chain (``compiler.assign_units`` / ``plan_from_traced``) behind both."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import models
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb
from roundpipe.compiler import analyze

@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _backend_units(model, x, **options):
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, **options)
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    (plan,) = backend.plans
    return [u.name for u in plan.units], out, compiled


def test_moe_layers_are_units_under_both_front_ends():
    """Experts do not feed one another, so each MoE layer is one unit, not one unit per
    expert and router (22 units against 6 before both front ends shared one pass chain)."""
    torch.manual_seed(0)
    model = models.SoftMoE()
    x = torch.randn(6, 6)
    api_units = [u.name for u in analyze(model, (x,)).units]
    assert api_units == ["inp", "layers.0", "layers.1", "layers.2", "layers.3", "out"]
    backend_units, _, _ = _backend_units(copy.deepcopy(model), x, num_microbatch=2)
    assert backend_units == api_units


@pytest.mark.parametrize("devices", [1, 3])
def test_moe_gradients_equal_eager_through_both_front_ends(devices):
    torch.manual_seed(0)
    model = models.SoftMoE()
    x = torch.randn(6, 6)
    y = torch.randn(6, 2)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()

    via_backend = copy.deepcopy(model)
    backend = rb.RoundPipeBackend(devices=["cpu"] * devices, num_microbatch=3)
    F.mse_loss(torch.compile(via_backend, backend=backend)(x), y).backward()

    via_api = copy.deepcopy(model)
    with RoundPipe(via_api, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        # mse over the batch is the mean of equal-sized microbatch means
        pipe.forward_backward(input_args=(x,), label=y,
                              loss_fn=lambda out, lab: F.mse_loss(out, lab) / 3)
        api_grads = [p.grad.clone() for p in pipe.optim_parameters()]
    for p, q, g in zip(via_backend.parameters(), eager.parameters(), api_grads):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt", "mlp", "convnet", "nested", "bnnet", "branchy"])
def test_zoo_models_get_the_same_units_under_both_front_ends(name):
    model, args, kwargs = models.ALL[name]()
    api_units = [u.name for u in analyze(model, args, kwargs).units]
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=1)
    torch.compile(copy.deepcopy(model), backend=backend)(*args, **kwargs)
    assert [u.name for u in backend.plans[0].units] == api_units

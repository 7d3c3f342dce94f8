"""One behaviour suite through both front ends: ``RoundPipe`` (``pipe(x)`` then
``loss.backward()``) and ``torch.compile(model, backend="roundpipe")``.  Each test runs the
same model and loss through each front end, on 1 and 3 virtual devices, and compares with
eager PyTorch in float64 (gradients of parameters and of inputs, merged outputs, buffer
writes); random ops must not depend on the device count."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from roundpipe import RoundPipe, RoundPipeError, RoundPipeRunConfig
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


class Front:
    """A model run through one front end: call it like the model; ``grads()`` reads the
    parameter gradients where that front end leaves them."""

    def __init__(self, kind: str, model: nn.Module, devices: int, num_microbatch: int,
                 seed: int = 1234) -> None:
        self.kind, self.model = kind, model
        if kind == "api":
            self.pipe = RoundPipe(model, devices=["cpu"] * devices, seed=seed,
                                  model_run_config=RoundPipeRunConfig(
                                      num_microbatch=num_microbatch))
            self.fn = self.pipe
        else:
            self.pipe = None
            self.fn = torch.compile(model, backend=rb.RoundPipeBackend(
                devices=["cpu"] * devices, num_microbatch=num_microbatch, seed=seed))

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def grads(self) -> dict[str, torch.Tensor | None]:
        named = (self.pipe.optim_named_parameters() if self.pipe is not None
                 else list(self.model.named_parameters()))
        return {n: p.grad for n, p in named}

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()


FRONTS = ["api", "backend"]


def _assert_same_grads(got: dict, want: nn.Module) -> None:
    want_grads = {n: p.grad for n, p in want.named_parameters()}
    assert got.keys() == want_grads.keys()
    for name, g in got.items():
        w = want_grads[name]
        assert (g is None) == (w is None), (name, g, w)
        if g is not None:
            torch.testing.assert_close(g, w, **TOL, msg=name)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# --- models ----------------------------------------------------------------------------------

class Heads(nn.Module):
    """Outputs merged by different rules (rows, a batch mean, a batch sum, a value that
    does not depend on the batch) from a split input, a replicated side input and a
    non-tensor keyword."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 3)

    def forward(self, x, scale, shift: float = 0.5):
        h = torch.tanh(self.a(x)) * scale + shift
        h = torch.tanh(self.b(h))
        y = self.c(h)
        return y, y.mean(), h.pow(2).sum(), self.c.weight.sum() * 2


class Tied(nn.Module):
    """One weight used by two layers that land in different stages."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.mid = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.last = nn.Linear(d, d)
        self.last.weight = self.first.weight

    def forward(self, x):
        x = torch.tanh(self.first(x))
        for layer in self.mid:
            x = torch.tanh(layer(x))
        return self.last(x)


class DropNet(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(4)])
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


class TwoOutputs(nn.Module):
    """``z`` comes from its own input and its own layer; a loss that ignores ``z`` gives
    neither of them a gradient in eager PyTorch."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.f = nn.Linear(d, d)
        self.g = nn.Linear(d, d)
        self.h = nn.Linear(d, d)

    def forward(self, x, w):
        y = self.h(torch.tanh(self.f(x)))
        z = self.g(w)
        return y, z


# --- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("devices", [1, 3])
def test_moe_model(front, devices):
    torch.manual_seed(0)
    model = models.SoftMoE()
    x, y = torch.randn(6, 6), torch.randn(6, 2)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()
    run = Front(front, model, devices, num_microbatch=3)
    try:
        out = run(x)
        torch.testing.assert_close(out, eager(x), **TOL)
        F.mse_loss(out, y).backward()
        _assert_same_grads(run.grads(), eager)
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("devices", [1, 3])
def test_merge_rules_side_inputs_and_input_gradients(front, devices):
    """Rows, a mean, a sum and a batch-independent value merge to eager's outputs; the
    split input's gradient is joined from its pieces, the replicated side input's is the
    sum over microbatches."""
    torch.manual_seed(0)
    model = Heads()
    x, scale = torch.randn(6, 5), torch.randn(5)
    eager = copy.deepcopy(model)
    ex, es = _leaf(x), _leaf(scale)
    want = eager(ex, es, shift=0.25)
    (want[0][:2].sum() + 3 * want[1] + want[2] + want[3]).backward()

    run = Front(front, model, devices, num_microbatch=3)
    try:
        rx, rs = _leaf(x), _leaf(scale)
        got = run(rx, rs, shift=0.25)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.detach(), **TOL)
        (got[0][:2].sum() + 3 * got[1] + got[2] + got[3]).backward()
        _assert_same_grads(run.grads(), eager)
        torch.testing.assert_close(rx.grad, ex.grad, **TOL)
        torch.testing.assert_close(rs.grad, es.grad, **TOL)
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
def test_a_replicated_input_gradient_is_its_own_tensor(front):
    """The replicated input's gradient is summed into a new tensor: writing to it (as an
    optimizer would) changes nothing else, and a second call accumulates like eager."""
    torch.manual_seed(0)
    model = Heads()
    x, scale = torch.randn(6, 5), torch.randn(5)
    eager = copy.deepcopy(model)
    es = _leaf(scale)
    for _ in range(2):
        eager(x, es)[2].backward()
    run = Front(front, model, 3, num_microbatch=3)
    try:
        rs = _leaf(scale)
        run(x, rs)[2].backward()
        first = rs.grad.clone()
        run(x, rs)[2].backward()
        torch.testing.assert_close(rs.grad, es.grad, **TOL)
        torch.testing.assert_close(rs.grad, 2 * first, **TOL)
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("devices", [1, 3])
def test_tied_weights(front, devices):
    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(6, 6)
    eager = copy.deepcopy(model)
    eager(x).pow(2).sum().backward()
    run = Front(front, model, devices, num_microbatch=2)
    try:
        run(x).pow(2).sum().backward()
        got = run.grads()
        _assert_same_grads(got, eager)
        assert "last.weight" not in got  # one parameter, one gradient
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
def test_an_output_the_loss_ignores_gives_no_gradients(front):
    """Eager leaves ``.grad`` None for an input and a layer only an unused output reads;
    the pipelined backward must not turn that into zeros."""
    torch.manual_seed(0)
    model = TwoOutputs()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    ex, ew = _leaf(x), _leaf(w)
    eager(ex, ew)[0].sum().backward()
    assert ew.grad is None and eager.g.weight.grad is None
    run = Front(front, model, 3, num_microbatch=2)
    try:
        rx, rw = _leaf(x), _leaf(w)
        run(rx, rw)[0].sum().backward()
        torch.testing.assert_close(rx.grad, ex.grad, **TOL)
        assert rw.grad is None
        _assert_same_grads(run.grads(), eager)
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
def test_dropout_does_not_depend_on_the_device_count(front):
    torch.manual_seed(0)
    model = DropNet()
    x = torch.randn(6, 6)
    results = []
    for devices in (1, 3):
        run = Front(front, copy.deepcopy(model), devices, num_microbatch=3, seed=7)
        try:
            out = run(x)
            out.pow(2).sum().backward()
            results.append((out.detach(), run.grads()))
        finally:
            run.close()
    (out1, g1), (out3, g3) = results
    assert torch.equal(out1, out3)
    assert (out1 == 0).any()  # dropout did drop
    for name in g1:
        assert torch.equal(g1[name], g3[name]), name


@pytest.mark.parametrize("front", FRONTS)
def test_a_second_backward_is_a_clear_error(front):
    """The stash is freed by the first backward, so ``retain_graph=True`` cannot give a
    second one; it is refused with a RoundPipeError instead of wrong gradients."""
    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(6, 6)
    run = Front(front, model, 2, num_microbatch=2)
    try:
        loss = run(x).pow(2).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RoundPipeError, match="ran twice"):
            loss.backward()
    finally:
        run.close()

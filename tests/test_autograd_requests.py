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

from roundpipe import DoubleBackwardError, RoundPipe, RoundPipeRunConfig
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
    """A model run through one front end (``api``: ``pipe(x)`` with float64 masters
    apart from the model's weights; ``backend``: torch.compile).  ``seen()`` is what
    the next optimizer step would read: the masters' gradients (read on the optimizer
    thread by ``pipe.step``), or the parameters' ``.grad``."""

    def __init__(self, kind: str, model: nn.Module, devices: int, num_microbatch: int = 2
                 ) -> None:
        self.kind, self.model = kind, model
        if kind == "api":
            self.pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=torch.float64,
                                  model_run_config=RoundPipeRunConfig(
                                      num_microbatch=num_microbatch))
            self.fn = self.pipe
        else:
            self.pipe = None
            self.backend = rb.RoundPipeBackend(devices=["cpu"] * devices,
                                               num_microbatch=num_microbatch)
            self.fn = torch.compile(model, backend=self.backend)

    def __call__(self, *args):
        return self.fn(*args)

    def seen(self, step: bool = True) -> dict[str, torch.Tensor | None]:
        """``step=False``: read after ``pipe.synchronize()``, without a step, between a
        ``pipe(x)`` and its backward (a step publishes the masters into the weights,
        which that backward refuses: it would recompute with them)."""
        if self.pipe is None:
            return {n: p.grad for n, p in self.model.named_parameters()}
        grads: dict[str, torch.Tensor | None] = {}
        if not step:
            self.pipe.synchronize()
            return {n: None if m.grad is None else m.grad.clone()
                    for n, m in self.pipe.optim_named_parameters()}

        def read() -> None:
            grads.update((n, None if m.grad is None else m.grad.clone())
                         for n, m in self.pipe.optim_named_parameters())
        self.pipe.step(read, is_async=False)
        return grads

    def grad_bytes(self) -> dict[str, int]:
        """Parameter-gradient bytes the last backward downloaded, per parameter."""
        stats = self.pipe.stats() if self.pipe is not None else self.backend.stats()
        return {n: b for n, b in stats.grad_bytes.items() if b}

    def clear(self) -> None:
        """No gradient anywhere, as after ``zero_grad(set_to_none=True)``."""
        for p in self.model.parameters():
            p.grad = None
        if self.pipe is not None:
            masters = [m for _, m in self.pipe.optim_named_parameters()]
            self.pipe.step(lambda: [setattr(m, "grad", None) for m in masters],
                           is_async=False)

    def model_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for n, p in self.model.named_parameters()}

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()


FRONTS = ["api", "backend"]


class MLP(nn.Module):
    """Three layers that land in different stages on 3 devices."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _assert_grads(got: dict, want: dict, what: str = "") -> None:
    assert got.keys() == want.keys()
    for name, g in got.items():
        w = want[name]
        assert (g is None) == (w is None), (what, name, g, w)
        if g is not None:
            torch.testing.assert_close(g, w, **TOL, msg=f"{what} {name}")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _eager_grads(model: nn.Module, x: torch.Tensor, inputs: list[str]
                 ) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Eager ``backward(inputs=...)`` of the test loss: the parameters' .grad and x's."""
    model = copy.deepcopy(model)
    xi = _leaf(x)
    named = dict(model.named_parameters())
    chosen = [xi if n == "x" else named[n] for n in inputs]
    model(xi).pow(2).sum().backward(inputs=chosen)
    return {n: p.grad for n, p in model.named_parameters()}, xi.grad


PARAMS = ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]


# --- which gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("front", FRONTS)
def test_input_gradient_leaves_parameter_gradients_alone(front, devices):
    """FGSM / saliency: torch.autograd.grad(f(pipe(x)), x).  It used to commit every
    parameter gradient to the masters, so the next optimizer step read them."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    eager = copy.deepcopy(model)
    xe = _leaf(x)
    (want_x,) = torch.autograd.grad(eager(xe).pow(2).sum(), xe)
    eager(x).pow(2).sum().backward()  # the gradients of an earlier full step
    run = Front(front, copy.deepcopy(model), devices)
    try:
        run(x).pow(2).sum().backward()
        before = {n: g.clone() for n, g in run.seen().items()}
        xi = _leaf(x)
        (got_x,) = torch.autograd.grad(run(xi).pow(2).sum(), xi)
        torch.testing.assert_close(got_x, want_x, **TOL)
        assert run.grad_bytes() == {}  # not even computed
        assert xi.grad is None
        _assert_grads(run.seen(), before, "after autograd.grad")
        _assert_grads(before, {n: p.grad for n, p in eager.named_parameters()})
        if front == "api":  # the model's own weights never hold gradients
            assert all(g is None for g in run.model_grads().values())
    finally:
        run.close()


TARGETS = [["x"], ["b.weight"], ["x", "a.bias"], ["c.weight", "a.weight"], ["x"] + PARAMS]


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("front", FRONTS)
def test_backward_with_inputs_writes_only_those_gradients(front, devices):
    """backward(inputs=[...]) over inputs and parameters, subsets of each: exactly the
    named ones get a gradient, equal to eager's."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    run = Front(front, copy.deepcopy(model), devices)
    try:
        for inputs in TARGETS:
            want, want_x = _eager_grads(model, x, inputs)
            run.clear()
            xi = _leaf(x)
            named = dict(run.model.named_parameters())
            chosen = [xi if n == "x" else named[n] for n in inputs]
            run(xi).pow(2).sum().backward(inputs=chosen)
            assert set(run.grad_bytes()) == set(inputs) - {"x"}  # only those computed
            _assert_grads(run.seen(), want, str(inputs))
            assert (xi.grad is None) == (want_x is None), inputs
            if want_x is not None:
                torch.testing.assert_close(xi.grad, want_x, **TOL)
            if front == "api":
                assert all(g is None for g in run.model_grads().values())
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
def test_autograd_grad_returns_parameter_gradients_without_writing_them(front):
    """torch.autograd.grad(out, [x, p]) returns both (eager's values) and writes no
    gradient anywhere; only those are computed."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    want, want_x = _eager_grads(model, x, ["x", "b.weight", "c.bias"])
    run = Front(front, copy.deepcopy(model), 3)
    try:
        xi = _leaf(x)
        named = dict(run.model.named_parameters())
        got = torch.autograd.grad(run(xi).pow(2).sum(),
                                  [xi, named["b.weight"], named["c.bias"]])
        for g, w in zip(got, [want_x, want["b.weight"], want["c.bias"]]):
            torch.testing.assert_close(g, w, **TOL)
        assert set(run.grad_bytes()) == {"b.weight", "c.bias"}
        assert all(g is None for g in run.seen().values())
        assert all(g is None for g in run.model_grads().values())
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS)
def test_a_hooked_parameter_runs_its_hook_only_when_its_gradient_is_asked_for(front):
    """A parameter with a tensor hook stays out of the Function's inputs under pipe(x)
    (the engine would call the hook with None); autograd.grad wrt x runs no hook and
    writes nothing, a plain backward runs it once, as in eager."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    eager = copy.deepcopy(model)
    eager.b.weight.register_hook(lambda g: g * 3)
    xe = _leaf(x)
    (want_x,) = torch.autograd.grad(eager(xe).pow(2).sum(), xe)
    eager(x).pow(2).sum().backward()
    run = Front(front, copy.deepcopy(model), 3)
    calls = []
    run.model.b.weight.register_hook(lambda g: calls.append(g) or g * 3)
    try:
        xi = _leaf(x)
        (got_x,) = torch.autograd.grad(run(xi).pow(2).sum(), xi)
        torch.testing.assert_close(got_x, want_x, **TOL)
        assert calls == []
        assert all(g is None for g in run.seen().values())
        run(x).pow(2).sum().backward()
        assert len(calls) == 1 and calls[0] is not None
        _assert_grads(run.seen(), {n: p.grad for n, p in eager.named_parameters()})
    finally:
        run.close()


@pytest.mark.parametrize("front", FRONTS + ["forward_backward"])
def test_a_parameter_frozen_between_calls_gets_no_more_gradient(front):
    """requires_grad_(False) between two calls: the second call adds nothing to that
    parameter's gradient (it keeps the first call's, as in eager)."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    eager = copy.deepcopy(model)
    for frozen in (False, True):
        eager.b.weight.requires_grad_(not frozen)
        eager(x).pow(2).sum().backward()
    run = Front("api" if front == "forward_backward" else front, copy.deepcopy(model), 3)
    try:
        for frozen in (False, True):
            run.model.b.weight.requires_grad_(not frozen)
            if front == "forward_backward":
                run.pipe.forward_backward(input_args=(x,), label=None,
                                          loss_fn=lambda out, _: out.pow(2).sum())
            else:
                run(x).pow(2).sum().backward()
        seen = run.seen()
        want = {n: p.grad for n, p in eager.named_parameters()}
        if front != "backend":  # a frozen parameter has no master: pipe.step never sees it
            assert "b.weight" not in seen
            want.pop("b.weight")
            torch.testing.assert_close(run.pipe._state.master("b.weight").grad,
                                       eager.b.weight.grad, **TOL)
        _assert_grads(seen, want)
    finally:
        run.close()


# --- double backward ----------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("front", FRONTS)
def test_double_backward_is_refused_at_the_first_backward_with_nothing_committed(
        front, devices):
    """WGAN-GP's penalty: the gradient wrt the input with create_graph=True.  It used to
    return a first-order gradient without a graph, and the penalty's backward then failed
    with "ran twice"; now the first backward is refused, commits nothing, and leaves the
    graph usable by a first-order backward."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 5)
    eager = copy.deepcopy(model)
    eager(x).pow(2).sum().backward()
    run = Front(front, copy.deepcopy(model), devices)
    try:
        xi = _leaf(x)
        out = run(xi)
        with pytest.raises(DoubleBackwardError, match="double backward.*create_graph.*"
                           "non-pipelined copy.*torch.func"):
            torch.autograd.grad(out.pow(2).sum(), xi, create_graph=True)
        assert all(g is None for g in run.model_grads().values())
        assert xi.grad is None
        assert all(g is None for g in run.seen(step=False).values())
        out.pow(2).sum().backward()  # the stash is intact
        _assert_grads(run.seen(), {n: p.grad for n, p in eager.named_parameters()})
    finally:
        run.close()


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

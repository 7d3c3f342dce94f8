"""``forward_backward`` sends the gradients of its inputs and label into the caller's
graph, as eager's per-microbatch loop ``loss_fn(model(x_i), y_i).backward()`` does: a
leaf input's ``.grad``, a parameter outside the pipe that computed an input (or a
teacher's output used as the label), a parameter of the pipe's own model reached through
an input (with and without masters, with a gradient held where it landed, with
``step=opt``), a GradScaler's scaled loss; and refuses, before anything runs, what it
cannot make exact (data parallelism, hooks on a parameter reached both ways)."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import roundpipe.optim
from roundpipe import (GradModeError, InputGradientError, RoundPipe, RoundPipeError,
                       RoundPipeRunConfig)

B = 6  # batch


class Net(nn.Module):
    """Three inputs: ``x`` (split), ``bias`` (no batch dimension: every microbatch reads
    it whole) and ``scale`` (split; given as a keyword)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x, bias, scale):
        h = torch.tanh(self.a(x) + bias)
        h = torch.tanh(self.b(h) * scale)
        return self.c(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _loss(out, y):
    return ((out - y) ** 2).sum()


def _pieces(t: torch.Tensor, n: int, split: bool) -> list[torch.Tensor]:
    return list(t.tensor_split(n)) if split else [t] * n


def _eager(model, args, kwargs, label, n, *, loss_fn=_loss, reduction="sum", split=None):
    """Eager's per-microbatch loop (the graphs outside are kept: each microbatch's
    backward goes through them again)."""
    split = split or {}
    names = [f"a{i}" for i in range(len(args))] + list(kwargs)
    values = list(args) + list(kwargs.values())
    per = [_pieces(v, n, split.get(k, v.dim() >= 1 and v.shape[0] == B))
           for k, v in zip(names, values)]
    labels = _pieces(label, n, True)
    for i in range(n):
        a = [p[i] for p in per[:len(args)]]
        k = {name: p[i] for name, p in zip(kwargs, per[len(args):])}
        loss = loss_fn(model(*a, **k), labels[i])
        if reduction == "mean":
            loss = loss / n
        loss.backward(retain_graph=True)


def _close(got, want, what):
    assert (got is None) == (want is None), f"{what}: {got} vs {want}"
    if want is not None:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=what)


def _pipe(model, devices=2, n=3, **kw):
    return RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=n), **kw)


# --- the classes of inputs -------------------------------------------------------------

def _inputs(grad_x: str, grad_bias: str, grad_scale: str, seed: int = 1):
    """Inputs whose gradient is asked for as ``"leaf"`` (a leaf that requires grad),
    ``"outside"`` (computed from a parameter outside the pipe) or ``"none"``; returns the
    inputs and the tensors whose ``.grad`` eager fills."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, 4, generator=g, dtype=torch.float64)
    b0 = torch.randn(8, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, 8, generator=g, dtype=torch.float64)
    leaves, made = [], []
    for base, how, fn in ((x0, grad_x, lambda t: t * 2), (b0, grad_bias, torch.tanh),
                          (s0, grad_scale, lambda t: t.exp())):
        if how == "none":
            made.append(base)
        elif how == "leaf":
            leaf = base.clone().requires_grad_()
            leaves.append(leaf)
            made.append(leaf)
        else:
            p = nn.Parameter(base.clone())
            leaves.append(p)
            made.append(fn(p))
    return made, leaves


@settings(max_examples=8, deadline=None)
@given(grads=st.tuples(*[st.sampled_from(["leaf", "outside", "none"])] * 3),
       n=st.sampled_from([1, 2, 3]), reduction=st.sampled_from(["sum", "mean"]),
       devices=st.sampled_from([1, 3]))
def test_input_gradients_are_eagers_per_microbatch_loop(grads, n, reduction, devices):
    """Any of three inputs (split or read whole, positional or keyword) may require grad
    as a leaf or through a parameter outside the pipe: each gets eager's gradient, and
    the pipe's parameters theirs."""
    label = torch.randn(B, 2, dtype=torch.float64)
    model = _net()
    eager = copy.deepcopy(model)
    (x, bias, scale), leaves = _inputs(*grads)
    _eager(eager, (x, bias), {"scale": scale}, label, n, reduction=reduction)
    want = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    (x, bias, scale), leaves2 = _inputs(*grads)
    with _pipe(model, devices, n) as pipe:
        pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss,
                              reduction=reduction)
        for leaf, w in zip(leaves2, want):
            _close(leaf.grad, w, "input gradient")
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            _close(p.grad, q.grad, name)


def test_input_gradients_do_not_depend_on_the_device_count():
    """1 and 3 devices: the same input gradients, bitwise."""
    label = torch.randn(B, 2, dtype=torch.float64)
    got = []
    for devices in (1, 3):
        (x, bias, scale), leaves = _inputs("outside", "leaf", "outside")
        with _pipe(_net(), devices, 3) as pipe:
            pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss)
        got.append([leaf.grad for leaf in leaves])
    for a, b in zip(*got):
        assert torch.equal(a, b)


def _hooked_run(front: str, devices: int, n: int):
    """Tensor hooks on the caller's tensors (an input split into microbatches, one read
    whole, a label, a parameter outside that computed an input, and that input itself),
    each nonlinear in its gradient (scaled by its norm); returns what each hook saw
    (name, thread, gradient), the leaves' gradients and the outside parameter's."""
    (x, bias, scale), (xl, bl, sp) = _inputs("leaf", "leaf", "outside")
    torch.manual_seed(3)
    teacher = nn.Linear(4, 2).double()
    label = teacher(x.detach())
    seen = []

    def hook(g, name):
        seen.append((name, threading.get_ident(), g.clone()))
        return g * (1.0 + g.norm())

    for name, t in (("x", xl), ("bias", bl), ("scale_param", sp), ("scale", scale),
                    ("label", label), ("teacher", teacher.weight)):
        t.register_hook(lambda g, name=name: hook(g, name))
    model = _net()
    if front == "eager":
        _eager(model, (x, bias), {"scale": scale}, label, n)
    else:
        with _pipe(model, devices, n) as pipe:
            pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss)
    return seen, [xl.grad, bl.grad, sp.grad, teacher.weight.grad]


@pytest.mark.parametrize("n", [1, 3])
def test_the_callers_graph_runs_one_backward_per_microbatch(n):
    """Hooks on the caller's tensors run once per microbatch, in microbatch order, on the
    thread that called, each seeing that microbatch's gradient (an input split by the
    default rule: zero outside the microbatch's rows), as eager's per-microbatch loop;
    every gradient bitwise eager's, and the same with 1 and 3 devices (one backward over
    the concatenated gradients ran each hook once per call, on the sum: 2026-11-27)."""
    want_seen, want = _hooked_run("eager", 1, n)
    for devices in (1, 3):
        seen, got = _hooked_run("pipe", devices, n)
        assert [s[0] for s in seen] == [s[0] for s in want_seen]
        assert {s[1] for s in seen} == {threading.get_ident()}
        for (name, _, g), (_, _, w) in zip(seen, want_seen):
            assert torch.equal(g, w), name
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert len(want_seen) == 6 * n


def test_a_view_input_keeps_its_own_graph():
    """An input that is a view of the tensor requiring grad (``h.view(...)``,
    ``retain_grad()`` on it): its own ``.grad`` and hooks, as eager's, not only its
    base's."""
    model = _net()
    eager = copy.deepcopy(model)
    (_, bias, scale), _ = _inputs("none", "none", "none")
    label = torch.randn(B, 2, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(B, 4, generator=g, dtype=torch.float64, requires_grad=True)
    he = h.detach().clone().requires_grad_()
    ue = he.view(B, 4)
    ue.retain_grad()
    eager_calls = []
    ue.register_hook(lambda grad: eager_calls.append(grad.shape))
    _eager(eager, (ue, bias), {"scale": scale}, label, 3)
    u = h.view(B, 4)
    u.retain_grad()
    calls = []
    u.register_hook(lambda grad: calls.append(grad.shape))
    with _pipe(model, 2, 3) as pipe:
        pipe.forward_backward((u, bias), {"scale": scale}, label=label, loss_fn=_loss)
    _close(u.grad, ue.grad, "the view's retained .grad")
    _close(h.grad, he.grad, "its base's .grad")
    assert calls == eager_calls == [torch.Size([B, 4])] * 3  # once per microbatch


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_leaf_input_accumulates_over_calls_and_not_under_no_grad(mode):
    """Two calls accumulate into ``x.grad``; a call under torch.no_grad() (or
    inference_mode) is refused before anything runs, as eager's ``loss.backward()``
    raises there: it used to train the pipe's parameters on that batch (a validation
    loss computed this way leaked into the next step) with the no_grad program."""
    model = _net()
    eager = copy.deepcopy(model)
    (x, bias, scale), _ = _inputs("leaf", "none", "none")
    label = torch.randn(B, 2, dtype=torch.float64)
    xe = x.detach().clone().requires_grad_()
    for _ in range(2):
        _eager(eager, (xe, bias), {"scale": scale}, label, 2)
    with _pipe(model, 2, 2) as pipe:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with mode(), pytest.raises(GradModeError, match=mode.__name__):
            pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss)
        assert x.grad is None
        assert all(p.grad is None for p in pipe.optim_parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        for _ in range(2):
            pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss)
    _close(x.grad, xe.grad, "x.grad after two calls")


def test_a_split_input_callable_and_a_split_dimension():
    """The gradient flows back through whatever made the microbatch pieces: a
    ``split_input`` callable, a split along dim 1."""
    model = _net()
    eager = copy.deepcopy(model)
    (x, bias, scale), (x_leaf, s_leaf) = _inputs("leaf", "none", "outside")
    label = torch.randn(B, 2, dtype=torch.float64)
    order = torch.tensor([5, 0, 3, 1, 4, 2])

    def split(args, kwargs, n):  # a permuted split: not a tensor_split of the input
        parts = order.tensor_split(n)
        return [((args[0][p], args[1]), {"scale": kwargs["scale"][p]}) for p in parts]

    for p in order.tensor_split(3):
        _loss(eager(x[p], bias, scale=scale[p]), label[p]).backward(retain_graph=True)
    want = (x_leaf.grad.clone(), s_leaf.grad.clone())
    x_leaf.grad = s_leaf.grad = None
    label_split = lambda y, n: [y[p] for p in order.tensor_split(n)]  # noqa: E731
    with _pipe(model, 2, 3) as pipe:
        pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss,
                              run_config=RoundPipeRunConfig(split_input=split,
                                                            split_label=label_split))
    _close(x_leaf.grad, want[0], "x.grad")
    _close(s_leaf.grad, want[1], "scale's parameter .grad")

    # split along dim 1: a model reading x transposed
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, xt):
            return self.b(torch.tanh(self.a(xt.t())))

    torch.manual_seed(0)
    m = T().double()
    e = copy.deepcopy(m)
    xt = torch.randn(4, B, dtype=torch.float64, requires_grad=True)
    for piece, y in zip(xt.tensor_split(2, dim=1), label.tensor_split(2)):
        _loss(e(piece), y).backward()
    want = xt.grad.clone()
    xt.grad = None
    with _pipe(m, 2, 2) as pipe:
        pipe.forward_backward((xt,), label=label, loss_fn=_loss,
                              run_config=RoundPipeRunConfig(split_input=((1,), {}),
                                                            split_label=0))
    _close(xt.grad, want, "x.grad, split along dim 1")


def test_a_label_that_requires_grad_backpropagates_into_its_graph():
    """A teacher's output computed with grad: its parameters get eager's gradient (the
    loss runs on the device against a leaf copy; the host backward sends it on)."""
    model = _net()
    eager = copy.deepcopy(model)
    torch.manual_seed(3)
    teacher = nn.Linear(4, 2).double()
    teacher_e = copy.deepcopy(teacher)
    (x, bias, scale), _ = _inputs("none", "none", "none")
    _eager(eager, (x, bias), {"scale": scale}, teacher_e(x), 3)
    with _pipe(model, 3, 3) as pipe:
        pipe.forward_backward((x, bias), {"scale": scale}, label=teacher(x), loss_fn=_loss)
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            _close(p.grad, q.grad, name)
    for p, q in zip(teacher.parameters(), teacher_e.parameters()):
        _close(p.grad, q.grad, "teacher parameter")


# --- an input computed from the pipe's own parameter -------------------------------------

class Tied(nn.Module):
    """The embedding is computed outside (``emb(ids)``) and read inside as the output
    head: its gradient comes from both uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h):
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return h @ self.emb.weight.t()


def _tied():
    torch.manual_seed(0)
    return Tied().double()


def _ids():
    return torch.randint(0, 10, (B,), generator=torch.Generator().manual_seed(2))


def _lm_loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _eager_tied(steps=1, lr=None):
    eager = _tied()
    ids, y = _ids(), _ids().flip(0)
    opt = torch.optim.SGD(eager.parameters(), lr=lr) if lr else None
    for _ in range(steps):
        _eager(eager, (eager.emb(ids),), {}, y, 3, loss_fn=_lm_loss)
        if opt:
            opt.step()
            opt.zero_grad()
    return eager, ids, y


@pytest.mark.parametrize("optim_dtype", [None, torch.float64])
def test_an_input_computed_from_the_pipes_own_parameter(optim_dtype):
    """Its gradient through the input reaches the parameter (without masters) or its
    master (with): eager's sum of both uses."""
    eager, ids, y = _eager_tied()
    model = _tied()
    with _pipe(model, 2, 3, optim_dtype=optim_dtype) as pipe:
        pipe.forward_backward((model.emb(ids),), label=y, loss_fn=_lm_loss)
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            _close(p.grad, q.grad, name)
        if optim_dtype is not None:  # added to the master, not left on the parameter
            assert model.emb.weight.grad is None


@pytest.mark.parametrize("through", ["parameter", "master"])
def test_a_gradient_held_where_it_landed_gets_the_part_through_the_input(through):
    """With masters a roundpipe.optim optimizer binds, the call's gradient is held in its
    download buffer; autograd's part through the input (looked up in the model's
    parameter, or in the master itself) is added to it exactly: two steps equal eager's
    SGD."""
    eager, ids, y = _eager_tied(steps=2, lr=0.1)
    model = _tied()
    with _pipe(model, 2, 3, optim_dtype=torch.float64) as pipe:
        opt = roundpipe.optim.SGD(pipe.optim_parameters(), lr=0.1)
        table = (model.emb.weight if through == "parameter"
                 else dict(pipe.optim_named_parameters())["emb.weight"])
        for _ in range(2):
            pipe.forward_backward((F.embedding(ids, table),), label=y, loss_fn=_lm_loss)
            pipe.step(opt)
            pipe.synchronize()  # the overlapped step: the weights read outside are current
        state = pipe.state_dict()
    for name, q in eager.state_dict().items():
        _close(state[name], q, name)


def test_step_opt_falls_back_to_the_plain_order_when_an_input_reaches_a_parameter(caplog):
    """forward_backward(step=opt) updates units as their gradients land, before the
    gradient through the input exists: it steps after the call instead (and says why),
    with eager's result."""
    eager, ids, y = _eager_tied(steps=2, lr=0.1)
    model = _tied()
    with _pipe(model, 2, 3, optim_dtype=torch.float64) as pipe, \
            caplog.at_level(logging.WARNING, logger="roundpipe"):
        opt = roundpipe.optim.SGD(pipe.optim_parameters(), lr=0.1)
        for _ in range(2):
            pipe.forward_backward((model.emb(ids),), label=y, loss_fn=_lm_loss, step=opt)
            pipe.synchronize()  # the plain order's step overlaps: see above
        # without the outside use the same call steps as gradients land
        assert pipe.landing_step(opt) == "as gradients land"
        state = pipe.state_dict()
    assert "reaches the parameter 'emb.weight'" in caplog.text
    for name, q in eager.state_dict().items():
        _close(state[name], q, name)


def test_step_opt_with_an_input_from_outside_still_steps_as_gradients_land(caplog):
    """An input computed from a parameter outside the pipe does not stop the step as
    gradients land; the outside parameter gets eager's gradient."""
    model = _net()
    eager = copy.deepcopy(model)
    (x, bias, scale), (xp,) = _inputs("outside", "none", "none")
    label = torch.randn(B, 2, dtype=torch.float64)
    _eager(eager, (x, bias), {"scale": scale}, label, 3)
    want = xp.grad.clone()
    xp.grad = None
    with _pipe(model, 2, 3, optim_dtype=torch.float64) as pipe, \
            caplog.at_level(logging.WARNING, logger="roundpipe"):
        opt = roundpipe.optim.SGD(pipe.optim_parameters(), lr=0.1)
        pipe.forward_backward((x, bias), {"scale": scale}, label=label, loss_fn=_loss,
                              step=opt)
    assert "steps after the call" not in caplog.text
    _close(xp.grad, want, "outside parameter")


def test_grad_scaler_scales_the_input_gradient_as_torch_amp_does():
    """The input's gradient is of the scaled loss (torch.amp.GradScaler's
    ``scale(loss).backward()``); unscaling touches the optimizer's parameters only."""
    model = _net()
    eager = copy.deepcopy(model)
    (x, bias, scale), (xp,) = _inputs("outside", "none", "none")
    label = torch.randn(B, 2, dtype=torch.float64)
    amp = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _eager(eager, (x, bias), {"scale": scale}, label, 2,
           loss_fn=lambda o, t: amp.scale(_loss(o, t)))
    want = xp.grad.clone()
    xp.grad = None
    with _pipe(model, 2, 2, optim_dtype=torch.float64) as pipe:
        scaler = roundpipe.GradScaler(pipe, init_scale=1024.0)
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.0)
        pipe.forward_backward((x, bias), {"scale": scale}, label=label,
                              loss_fn=lambda o, t: scaler.scale(_loss(o, t)))
        _close(xp.grad, want, "outside parameter (scaled)")
        unscaled = []

        def step_fn():
            scaler.unscale_(opt)
            unscaled.extend(p.grad.clone() for p in pipe.optim_parameters())
            scaler.step(opt)
        pipe.step(step_fn)
        for g, (name, q) in zip(unscaled, eager.named_parameters()):
            _close(g, q.grad / 1024.0, name)  # unscaled; the input's stays scaled
    _close(xp.grad, want, "outside parameter after the step")


# --- refused ---------------------------------------------------------------------------

class _FakeReplicas:
    """A stand-in for the replica group: the refusal comes before any collective."""

    def __init__(self):
        self.failed = []

    def begin(self):
        return self

    def fail(self, e):
        self.failed.append(e)


def test_data_parallel_refuses_an_input_reaching_the_pipes_parameter():
    model = _tied()
    with _pipe(model, 2, 3) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe._dp = _FakeReplicas()
        try:
            with pytest.raises(InputGradientError,
                               match=r"input_args\[0\] reaches the parameter 'emb.weight'"
                                     r".*data parallelism.*Nothing was run"):
                pipe.forward_backward((model.emb(_ids()),), label=_ids(), loss_fn=_lm_loss)
            assert len(pipe._dp.failed) == 1  # the other replicas are told
        finally:
            pipe._dp = None
        assert all(p.grad is None for p in pipe.optim_parameters())
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())


@pytest.mark.parametrize("optim_dtype", [None, torch.float64])
def test_hooks_on_a_parameter_the_input_reaches_are_refused(optim_dtype):
    model = _tied()
    calls = []
    model.emb.weight.register_hook(lambda g: calls.append(g))
    with _pipe(model, 2, 3, optim_dtype=optim_dtype) as pipe:
        with pytest.raises(InputGradientError, match="'emb.weight', which has hooks"):
            pipe.forward_backward((model.emb(_ids()),), label=_ids(), loss_fn=_lm_loss)
        assert all(p.grad is None for p in pipe.optim_parameters())
    assert calls == []


def test_pipe_x_refuses_an_input_split_otherwise_than_along_dim_0():
    """pipe(x)'s backward concatenates an input's microbatch gradients along dim 0: a
    ``split_input`` callable's own pieces or a split along another dim would get a wrong
    gradient (the callable's, silently) or a shape error at the backward; refused before
    the forward runs (forward_backward takes both, see above)."""
    order = torch.tensor([5, 0, 3, 1, 4, 2])

    def permuted(args, kwargs, n):
        return [((args[0][p], args[1]), {"scale": kwargs["scale"][p]})
                for p in order.tensor_split(n)]

    refused = r"input_args\[0\] requires grad .*otherwise than along dim 0.*Nothing was run"
    (x, bias, scale), _ = _inputs("leaf", "leaf", "none")
    with _pipe(_net(), 2, 3) as pipe:
        with pytest.raises(InputGradientError, match=refused):
            pipe(x, bias, scale=scale, run_config=RoundPipeRunConfig(split_input=permuted))
        with pytest.raises(RoundPipeError, match="no call has run yet"):
            pipe.stats()  # nothing ran
        # along dim 0 (given explicitly), or read whole: the gradient is eager's
        eager = copy.deepcopy(pipe.model)
        xe, be = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        eager(xe, be, scale=scale).sum().backward()
        pipe(x, bias, scale=scale,
             run_config=RoundPipeRunConfig(split_input=((0, None), {"scale": 0}))
             ).sum().backward()
    _close(x.grad, xe.grad, "x.grad")
    _close(bias.grad, be.grad, "bias.grad")

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, xt):
            return self.b(torch.tanh(self.a(xt.t())))

    xt = torch.randn(4, B, dtype=torch.float64, requires_grad=True)
    with _pipe(Transposed().double(), 2, 2) as pipe:
        with pytest.raises(InputGradientError, match=refused):
            pipe(xt, run_config=RoundPipeRunConfig(split_input=((1,), {})))
        with pytest.raises(RoundPipeError, match="no call has run yet"):
            pipe.stats()  # nothing ran

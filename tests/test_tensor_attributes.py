"""A plain tensor attribute of a module (in its ``__dict__``: neither a parameter nor a
buffer; ``self.gain = torch.linspace(...)`` in ``__init__``) that the forward reads is a
constant of the traced program: a constant slot, or values Python read while tracing
(``self.shift.tolist()``) baked into the graph.  Rebinding it between calls
(``model.gain = other``) kept the old tensor, silently (outputs 0.38, a loss 0.64 off in
float64); writing it in place kept the baked values (0.26 to 0.51 off).  Each is now part
of the program's key: the next call traces again, as eager runs the forward again."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb

W = 4


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Block(nn.Module):
    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.branch = branch
        self.gain = torch.linspace(0.5, 1.5, W)  # a plain tensor attribute

    def forward(self, x):
        if self.branch and x.sum() > 0:  # data-dependent Python: only torch.fx traces it
            x = x * 1.5
        return torch.tanh(self.lin(x)) * self.gain


class Net(nn.Module):
    """``branch``: the torch.fx fallback (its blocks opaque units, run at run time with
    their attributes as state slots), else export."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(branch) for _ in range(3))
        self.head = nn.Linear(W, 2)
        self.shift = torch.tensor([0.25, -0.5])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        # shift: a graph value, and a number Python reads (baked in while traced)
        return self.head(x) * self.shift.tolist()[0] + self.shift


def _change(models, how: str, step: int) -> None:
    """The same change to every model: ``blocks.1.gain`` and ``shift``."""
    for m in models:
        if how == "rebind":
            m.blocks[1].gain = torch.linspace(2.0, -1.0, W) * step
            m.shift = torch.tensor([1.5, 0.75]) / step
        else:
            with torch.no_grad():
                m.blocks[1].gain.add_(0.75)
                m.shift.mul_(-2.0)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, W, generator=g) + 0.5, torch.randn(6, 2, generator=g)


@pytest.mark.parametrize("how", ["rebind", "in_place"])
@pytest.mark.parametrize("path", ["export", "fx"])
def test_forward_backward_follows_a_changed_tensor_attribute(path, how, caplog):
    torch.manual_seed(0)
    model = Net(branch=path == "fx")
    eager = copy.deepcopy(model)
    models = [model, copy.deepcopy(model)]  # on 2 devices, then 1
    pipes = [RoundPipe(m, devices=["cpu"] * d,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3))
             for m, d in zip(models, (2, 1))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models + [eager]]
    with caplog.at_level(logging.WARNING, logger="roundpipe.api"):
        for step in range(3):
            if step:
                _change(models + [eager], how, step)
            x, y = _batch(step)
            losses = [p.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
                      for p in pipes]
            want = sum(F.mse_loss(eager(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
            want.backward()
            torch.testing.assert_close(losses[0], want.detach(), rtol=0, atol=1e-10,
                                       msg=f"step {step}")
            assert torch.equal(losses[0], losses[1]), step  # device count: bitwise
            for p, opt in zip(pipes, opts):
                p.step(opt)
                p.synchronize()
            opts[2].step()
            for opt in opts:
                opt.zero_grad()
    assert pipes[0].plan.program.trace_method == path
    for (name, a), b, c in zip(models[0].named_parameters(), models[1].parameters(),
                               eager.parameters()):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-10, msg=name)
        assert torch.equal(a, b), name
    what = "rebound to another tensor" if how == "rebind" else "a tensor, written in place"
    assert f"shift ({what}) changed since" in caplog.text
    # one program per change; those of a tensor since written in place are dropped
    assert len(pipes[0].plans) == (3 if how == "rebind" else 1)
    for p in pipes:
        p.close()


@pytest.mark.parametrize("path", ["export", "fx"])
def test_pipe_call_follows_a_changed_tensor_attribute(path):
    """``pipe(x)`` with grad and a backward, then in eval mode under ``no_grad``; the
    attributes rebound before the second step and written in place before the third."""
    torch.manual_seed(1)
    model = Net(branch=path == "fx")
    eager = copy.deepcopy(model)
    # (the fx fallback proves no merge of microbatch outputs: one microbatch)
    pipe = RoundPipe(model, devices=["cpu"] * 2, model_run_config=RoundPipeRunConfig(
        num_microbatch=2 if path == "export" else 1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for step in range(3):
        if step:
            _change([model, eager], "rebind" if step == 1 else "in_place", step)
        x, y = _batch(step)
        for m in (model, eager):
            m.train()
        out, want = pipe(x), eager(x)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10, msg=f"step {step}")
        F.mse_loss(out, y).backward()
        F.mse_loss(want, y).backward()
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for m in (model, eager):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-10,
                                       msg=f"eval, step {step}")
    assert pipe.plan.program.trace_method == path
    pipe.close()


def test_backend_follows_a_changed_tensor_attribute():
    """Through ``torch.compile(backend=roundpipe)`` Dynamo's guards see both changes
    (checked: no change to the backend was needed)."""
    torch.manual_seed(2)
    torch._dynamo.reset()
    model = Net(branch=False)
    eager = copy.deepcopy(model)
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=1)
    compiled = torch.compile(model, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    try:
        for step in range(3):
            if step:
                _change([model, eager], "rebind" if step == 1 else "in_place", step)
            x, y = _batch(step)
            out, want = compiled(x), eager(x)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-10, msg=f"step {step}")
            F.mse_loss(out, y).backward()
            F.mse_loss(want, y).backward()
            for (name, a), b in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=name)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert backend.plans  # the graphs ran through roundpipe
    finally:
        torch._dynamo.reset()


class Cached(nn.Module):
    """Builds tensor attributes in its forward: one lazily, one at every call; and reads
    an alias of a parameter, whose version every optimizer step moves."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(branch=True) for _ in range(2))  # torch.fx
        self.head = nn.Linear(W, 2)
        self.table = None
        self.alias = self.blocks[0].lin.weight.detach()  # the parameter's memory

    def forward(self, x):
        if self.table is None:
            self.table = torch.linspace(-1.0, 1.0, W)
        self.scale = torch.full((2,), 0.5)
        for block in self.blocks:
            x = block(x + self.table)
        return self.head(F.linear(x, self.alias)) * self.scale


def test_a_forward_building_its_own_tensor_attributes_traces_once(traces, caplog):
    """The program never runs the forward's Python again, so the attributes keep what
    tracing left there: no call traces again, and neither does a second program (another
    grad mode), whose tracing runs the model for real, binds them again and puts its
    tensors back (``copy_``, a new version of each): each program would otherwise trace
    again in turn.  The alias of a parameter is keyed on identity alone (it reads the
    updated weights, as eager does)."""
    torch.manual_seed(3)
    model = Cached()
    eager = copy.deepcopy(model)
    eager.alias = eager.blocks[0].lin.weight.detach()  # (deepcopy copies its memory)
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for step in range(3):
        x, y = _batch(step)
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        want = sum(F.mse_loss(eager(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=0, atol=1e-10)
        pipe.step(opts[0])
        pipe.synchronize()
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x, run_config=RoundPipeRunConfig(
                num_microbatch=1)), eager(x), rtol=0, atol=1e-10)
    assert pipe.plan.program.trace_method == "fx"
    assert isinstance(model.table, torch.Tensor) and isinstance(model.scale, torch.Tensor)
    assert traces[0] == 2 and len(pipe.plans) == 2
    assert "changed since" not in caplog.text
    pipe.close()

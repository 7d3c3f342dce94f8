"""Tensor hooks registered inside a forward (``h.register_hook(fn)``) run where and as often
as eager PyTorch runs them: in the top-level forward, a submodule, a repeated block
(shared_blocks), an opaque (leaf) module, on a value two units read; with
``forward_backward``, ``pipe(x)`` and the torch.compile backend.  Before, export recorded
no node for them (the hook was dropped: gradients upstream were eager's without it), an
opaque module's registration failed in the forward job, and the backend failed with
"cannot register a hook on a tensor that doesn't require gradient"."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb
from roundpipe.errors import ModelError

RUNS = [(1, "stage"), (3, "stage"), (3, "layer")]


def _line(func, needle: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if needle in line)


class Block(nn.Module):
    """Clamps the gradient of an intermediate (non-linear) and counts its own calls."""

    def __init__(self, hook_input: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = [0]
        self.hook_input = hook_input

    def forward(self, x):
        def count(g):
            self.calls[0] += 1

        if self.hook_input:
            x.register_hook(lambda g: g.clamp(-0.02, 0.02))
        h = torch.tanh(self.lin(x))
        h.register_hook(count)
        h.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return x + h


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        h = self.lin(x)
        h.register_hook(lambda g: torch.where(g > 0, g * 3, g))
        return h


class Net(nn.Module):
    """``where``: "top" (the model's own forward), "head" (a submodule), "blocks" (each
    repeated block), "two_readers" (a value read by two units, hooked at the top)."""

    def __init__(self, where: str, hook_input: bool = False) -> None:
        super().__init__()
        self.where = where
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(hook_input) for _ in range(3)])
        self.head = Head()
        self.calls = [0]
        for b in self.blocks:
            b.lin.weight.data.mul_(3)  # gradients large enough for the clamps to bite

    def forward(self, x):
        h = self.inp(x)
        if self.where == "top":
            def count(g):
                self.calls[0] += 1
                return g * 2
            h.register_hook(count)
        first = h
        for i, b in enumerate(self.blocks):
            h = b(h) if self.where != "top" else b.lin(h).tanh() + h
            if i == 1:
                h = h + first  # first is read by blocks.0 and here
        if self.where == "two_readers":
            first.register_hook(lambda g: g.clamp(-0.05, 0.05))
        return self.head(h)


def _counts(model: Net) -> list[int]:
    return [model.calls[0]] + [b.calls[0] for b in model.blocks]


def _compare(pipe_model: nn.Module, eager: nn.Module, pipe: RoundPipe, x, y, mb: int):
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=reference.mse_first)
    ref = reference.eager_forward_backward(eager, (x,), {}, y, reference.mse_first, mb)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
        if q.grad is None:  # a block the forward does not call
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
    assert _counts(pipe_model) == _counts(eager)


def _data():
    torch.manual_seed(1)
    return torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)


@pytest.mark.parametrize("devices,grain", RUNS)
@pytest.mark.parametrize("where", ["top", "head", "blocks", "two_readers", "leaf"])
def test_forward_backward_runs_hooks_as_eager_per_microbatch(where, devices, grain):
    """Loss, gradients and the hooks' call counts equal eager's per-microbatch loop."""
    torch.manual_seed(0)
    leaf = where == "leaf"
    model = Net("blocks" if leaf else where, hook_input=leaf).double()
    eager = copy.deepcopy(model)
    x, y = _data()
    pipe = RoundPipe(model, devices=["cpu"] * devices, leaf_modules=[Block] if leaf else None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3,
                                                         recompute_grain=grain))
    _compare(model, eager, pipe, x, y, 3)
    hooks = pipe.plan.program.tensor_hooks
    assert hooks, "the program records where the forward registers hooks"
    if where == "blocks":
        # each block's hook is its own closure: none is a copy of blocks.0's
        assert {h.split(" ")[0] for h in hooks} == {"blocks.0", "blocks.1", "blocks.2",
                                                    "head"}
        line = _line(Block.forward, "h.register_hook(count)")
        assert any(f"test_hooks_in_forward.py:{line}" in h for h in hooks)
    if leaf:
        assert pipe.plan.program.trace_method == "export-leaves"
        assert sum("opaque" in h for h in hooks) == 9  # 3 per block
        # blocks.0 hooks its input, which blocks.1's glue reads too: kept with its maker
        assert [u.name for u in pipe.plan.units][:2] == ["inp", "blocks.1"]
    pipe.close()


class BranchingBlock(Block):
    """Data-dependent Python: export fails inside it, and the torch.fx fallback keeps the
    blocks opaque (their Python, hooks included, runs at run time)."""

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1.5
        return super().forward(x)


@pytest.mark.parametrize("devices,grain", RUNS)
def test_hooks_in_opaque_units_of_the_fx_fallback(devices, grain):
    torch.manual_seed(0)
    model = Net("blocks").double()
    model.blocks = nn.ModuleList([BranchingBlock() for _ in range(3)]).double()
    model.head = nn.Linear(8, 2).double()  # fx fails on a hook in code it traces
    eager = copy.deepcopy(model)
    x, y = _data()
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3,
                                                         recompute_grain=grain))
    _compare(model, eager, pipe, x, y, 3)
    assert pipe.plan.program.trace_method == "fx"
    assert pipe.plan.program.tensor_hooks == tuple(
        f"blocks.{i} (opaque unit on the torch.fx fallback)" for i in range(3))
    pipe.close()


def test_a_hook_the_forward_removes_does_not_run():
    class Removing(Net):
        def forward(self, x):
            h = self.inp(x)
            handle = h.register_hook(lambda g: g * 100)
            handle.remove()
            return self.head(self.blocks[0](h))

    torch.manual_seed(0)
    model = Removing("none").double()
    eager = copy.deepcopy(model)
    x, y = _data()
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    _compare(model, eager, pipe, x, y, 2)
    pipe.close()


def test_pipe_call_runs_hooks_as_eager_on_the_whole_batch():
    """pipe(x) + backward with one microbatch: the hooks run once, as eager's; split into
    microbatches, each would run once per microbatch: refused before anything runs."""
    torch.manual_seed(0)
    model = Net("top").double()
    eager = copy.deepcopy(model)
    x, y = _data()
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with pytest.raises(ModelError, match=r"(?s)registers a tensor hook in the top-level "
                                         r"forward.*num_microbatch=1"):
        pipe(x)
    assert all(p.grad is None for p in model.parameters())
    assert _counts(model) == [0, 0, 0, 0]
    one = RoundPipeRunConfig(num_microbatch=1)
    for _ in range(2):
        F.mse_loss(pipe(x, run_config=one), y).backward()
        F.mse_loss(eager(x), y).backward()
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=name)
        assert _counts(model) == _counts(eager)
    with torch.no_grad(), pytest.raises(ModelError, match="if h.requires_grad"):
        pipe(x)  # eager PyTorch fails too: its hook is on a tensor without grad
    with torch.no_grad(), pytest.raises(RuntimeError, match="doesn't require gradient"):
        eager(x)
    pipe.close()


def test_a_hook_holding_a_value_of_the_forward_is_refused_with_the_way_out():
    class Masked(Block):
        def forward(self, x):
            h = self.lin(x)
            mask = (x > 0).to(x.dtype)
            h.register_hook(lambda g: g * mask)
            return h

    torch.manual_seed(0)
    model = Net("none")
    model.blocks[1] = Masked()
    pipe = RoundPipe(model, devices=["cpu"])
    line = _line(Masked.forward, "h.register_hook")
    with pytest.raises(ModelError, match=rf"(?s)blocks\.1 \(test_hooks_in_forward\.py:{line}"
                                         r".*\(mask\).*leaf_modules=\['blocks\.1'\]"):
        pipe.compile((torch.randn(4, 8),), {})
    pipe.close()
    # the way out: that block opaque, its Python (and hook) run as written
    model.blocks[1].lin.weight.data.mul_(3)
    eager = copy.deepcopy(model.double())
    x, y = _data()
    pipe = RoundPipe(model, devices=["cpu"] * 3, leaf_modules=["blocks.1"],
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    _compare(model, eager, pipe, x, y, 3)
    pipe.close()


@pytest.mark.parametrize("target", ["input", "parameter", "leaf parameter"])
def test_hooks_on_inputs_and_parameters_in_forward_are_refused(target):
    class OnInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if target == "input":
                x.register_hook(lambda g: g * 2)
            else:
                self.lin.weight.register_hook(lambda g: g * 2)
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = OnInput()
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            return self.out(self.inner(x))

    pipe = RoundPipe(Outer(), devices=["cpu"],
                     leaf_modules=["inner"] if target == "leaf parameter" else None)
    x = torch.randn(4, 8, requires_grad=target == "input")
    what = "its input 'x'" if target == "input" else "inner.lin.weight"
    with pytest.raises(ModelError, match=rf"registers a tensor hook on {what}"):
        pipe.compile((x,), {})
    assert pipe.model.inner.lin.weight._backward_hooks in (None, {})  # nothing left behind
    pipe.close()


def test_a_module_backward_hook_on_the_model_points_at_a_path_that_works():
    model = Net("none")
    model.register_full_backward_hook(lambda m, gin, gout: None)
    pipe = RoundPipe(model, devices=["cpu"])
    with pytest.raises(ModelError, match=r"register a tensor hook in the forward") as e:
        pipe.compile((torch.randn(4, 8),), {})
    assert "use tensor hooks (Tensor.register_hook) instead" not in str(e.value)
    pipe.close()


# --- torch.compile backend ---------------------------------------------------------------

class BackendNet(nn.Module):
    """A pure hook (traced into Dynamo's graph), one reading a value of the forward, and
    one with a side effect (Dynamo breaks the graph there and registers it eagerly)."""

    def __init__(self, side_effect: bool) -> None:
        super().__init__()
        self.side_effect = side_effect
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.out = nn.Linear(8, 2)
        self.calls = [0]
        for b in self.blocks:
            b.weight.data.mul_(3)

    def forward(self, x):
        h = self.inp(x)
        h.register_hook(lambda g: g.clamp(-0.01, 0.01))
        sign = (x > 0).to(x.dtype)
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        h.register_hook(lambda g: g * (sign + 1))
        if self.side_effect:
            def count(g):
                self.calls[0] += 1
            h.register_hook(count)
        return self.out(h)


@pytest.mark.parametrize("side_effect", [False, True])
def test_backend_runs_hooks_in_forward_as_eager(side_effect):
    torch._dynamo.reset()
    rb.reset()
    try:
        torch.manual_seed(0)
        model = BackendNet(side_effect).double()
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="roundpipe",
                                 options={"devices": ["cpu"] * 3, "num_microbatch": 3})
        x, y = _data()
        for _ in range(2):
            F.mse_loss(compiled(x), y).backward()
            F.mse_loss(eager(x), y).backward()
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14,
                                           msg=name)
            assert model.calls == eager.calls
        plans = roundpipe.backend.plans()
        assert plans[0].num_microbatch == 1  # the graph with the hooks: one whole batch
    finally:
        torch._dynamo.reset()

"""Review of issue 30's hooks (float64, virtual CPU devices, against eager): a hook that
removes itself while it runs, and a hook registered between ``pipe(x)`` and
``backward()``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from roundpipe import ParameterHookError, RoundPipe, RoundPipeRunConfig

MB = 3


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 6)
        self.out.weight = self.inp.weight  # read by the first and the last unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.out(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)


def _self_removing(model: nn.Module, where: str, kind: str, calls: list[int]):
    param = {"one unit": model.blocks[1].weight, "tied": model.inp.weight}[where]
    handle = []

    if kind == "tensor":
        def hook(g: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            handle[0].remove()
            return g.clamp(-0.05, 0.05)
        handle.append(param.register_hook(hook))
    else:
        def post(p: torch.Tensor) -> None:
            calls.append(1)
            handle[0].remove()
            p.grad.mul_(0.5)
        handle.append(param.register_post_accumulate_grad_hook(post))


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("where", ["one unit", "tied"])
@pytest.mark.parametrize("kind", ["tensor", "post"])
def test_hook_that_removes_itself_runs_once_under_forward_backward(devices, where, kind):
    """Eager's per-microbatch loop runs a hook that removes itself once (the first
    microbatch); roundpipe ran it for every microbatch (read once per call)."""
    torch.manual_seed(0)
    model = Tied()
    eager = copy.deepcopy(model)
    x, y = data()
    want: list[int] = []
    _self_removing(eager, where, kind, want)
    for xi, yi in zip(x.chunk(MB), y.chunk(MB)):
        loss_fn(eager(xi), yi).backward()
    got: list[int] = []
    _self_removing(model, where, kind, got)
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    pipe.forward_backward(x, label=y, loss_fn=loss_fn)
    assert len(got) == len(want) == 1
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("optim_dtype", [torch.float64])
@pytest.mark.parametrize("kind", ["tensor", "post"])
def test_hook_registered_between_call_and_backward_is_refused(optim_dtype, kind):
    """A parameter without hooks at pipe(x) is connected to the pipelined call, whose
    backward hands autograd None for it (roundpipe commits it): a tensor hook
    registered after the call was called by autograd with None, after roundpipe had
    committed every gradient (a TypeError from the user's hook, state half-written); a
    post-accumulate-grad hook ran twice (roundpipe's commit, then autograd). With masters
    it is now refused before the backward runs anything (without, autograd gets the
    gradient: test_hooked_parameter_gets_one_backward_through_pipe_calls)."""
    torch.manual_seed(0)
    model = Tied()
    x, y = data()
    pipe = RoundPipe(model, devices=["cpu"] * 3, optim_dtype=optim_dtype,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    out = pipe(x)
    calls: list[int] = []
    if kind == "tensor":
        model.blocks[1].weight.register_hook(lambda g: g * 3)
    else:
        model.blocks[1].weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    with pytest.raises(ParameterHookError, match="blocks.1.weight"):
        loss_fn(out, y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in pipe.optim_parameters())
    assert calls == []


def _clamp_counting(calls: list[int]):
    def hook(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return g.clamp(-0.05, 0.05)
    return hook


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("case", ["two calls", "inputs=", "used outside", "hook after call"])
def test_hooked_parameter_gets_one_backward_through_pipe_calls(devices, case):
    """Without masters, pipe(x) hands a hooked parameter's gradient to autograd, which
    sums every use, runs the hooks once and accumulates, as eager does. Before, the
    commit of each pipelined call ran the hooks on its own part: two pipe(x) calls in one
    loss clamped each call's gradient apart and ran the hook twice, a use of the
    parameter outside the pipe (a regularizer) ran it once more, backward(inputs=[p])
    left the hooked p without its gradient (silently), and a hook registered after the
    call was called with None."""
    torch.manual_seed(0)
    model = Tied()
    eager = copy.deepcopy(model)
    x, y = data()
    pipe = RoundPipe(model, devices=["cpu"] * devices,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    got: list[int] = []
    want: list[int] = []
    post_got: list[torch.Tensor] = []
    post_want: list[torch.Tensor] = []

    def run(f, m, calls, seen):
        hooked = m.blocks[1].weight
        if case != "hook after call":
            hooked.register_hook(_clamp_counting(calls))
            hooked.register_post_accumulate_grad_hook(
                lambda p: seen.append(p.grad.detach().clone()))
        out = f(x)
        if case == "hook after call":
            hooked.register_hook(_clamp_counting(calls))
        loss = loss_fn(out, y)
        if case == "two calls":
            loss = loss + loss_fn(f(2 * x), y)
        if case == "used outside":
            loss = loss + 10 * (hooked ** 2).sum()
        if case == "inputs=":
            loss.backward(inputs=[hooked, m.blocks[2].weight])
        else:
            loss.backward()

    run(eager, eager, want, post_want)
    run(pipe, model, got, post_got)
    assert len(got) == len(want) >= 1
    assert len(post_got) == len(post_want)
    for a, b in zip(post_got, post_want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.aux = nn.Linear(6, 6)  # read only by the second output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h, self.aux(x)


def test_hooked_parameter_the_backward_does_not_reach_is_refused_not_called_with_none():
    """Without masters a hooked parameter is connected to the pipelined call and its
    gradient handed to autograd; where this backward computes none for it (it only
    feeds an output the loss ignores), autograd would call its hooks with None after
    the other gradients were committed, where eager does not call them. Refused, with
    nothing committed."""
    torch.manual_seed(0)
    model = TwoHeads()
    x, y = data()
    calls: list[object] = []
    model.aux.weight.register_hook(lambda g: calls.append(g))
    model.blocks[0].weight.register_hook(lambda g: calls.append(g))
    pipe = RoundPipe(model, devices=["cpu"] * 3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    out, _ = pipe(x)
    with pytest.raises(ParameterHookError, match="aux.weight"):
        loss_fn(out, y).backward()
    assert calls == []
    assert all(p.grad is None for p in model.parameters())

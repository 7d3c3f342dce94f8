"""Hooks on a parameter that ``loss_fn`` reads (a regularizer, a learned temperature)
under ``forward_backward``, against eager's per-microbatch loop in float64.

Eager runs a parameter's tensor hooks once per microbatch backward, on the total
gradient (the model's use plus ``loss_fn``'s), and its post-accumulate-grad hooks once,
after that total is added.  Before, autograd ran the hooks on ``loss_fn``'s part while
``loss_fn``'s backward ran, and roundpipe ran them again on the model's part: a
nonlinear hook gave another gradient (about 3e-3 off) and a post hook ran twice.

The class: every hook kind on parameters (tensor hook run on the device, tensor hook of
a parameter read by several units, post-accumulate hook, both, a module full backward
hook) x the parameter read by ``loss_fn`` only / by the model and ``loss_fn`` x
``optim_dtype`` masters or none; 1 and 3 devices bitwise equal; ``step=opt``; and a read
roundpipe cannot keep off autograd's hook path is refused with nothing changed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import roundpipe.optim
from roundpipe import ParameterHookError, RoundPipe, RoundPipeRunConfig

TOL = dict(rtol=1e-10, atol=1e-12)
MB = 3


class Net(nn.Module):
    """Three blocks and a head; ``temp`` is read by no layer (only by loss_fn).
    ``tied``: the head's weight is the first block's (read by two units)."""

    def __init__(self, d: int = 6, tied: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, d, bias=False)
        if tied:
            self.head.weight = self.blocks[0].weight
        self.temp = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def make(tied: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = Net(tied=tied)
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    return model, x, y


def target(model: Net, where: str) -> tuple[str, nn.Parameter]:
    """The parameter loss_fn reads (and that gets the hooks)."""
    if where == "loss_only":
        return "temp", model.temp
    if where == "tied":
        return "blocks.0.weight", model.blocks[0].weight
    return "blocks.1.weight", model.blocks[1].weight


def loss_for(model: Net, where: str):
    """loss_fn reading ``target(model, where)`` (and temp, always: a learned
    temperature)."""
    _, p = target(model, where)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((out * model.temp - y) ** 2).sum()
        if p is not model.temp:
            loss = loss + 1e-2 * p.pow(2).sum()
        return loss
    return loss_fn


class Log:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def post(self, p: torch.Tensor) -> None:
        self.seen.append(p.grad.detach().clone())


def nonlinear(g: torch.Tensor) -> torch.Tensor:
    return g * g.abs() * 10


def install(model: Net, kind: str, where: str, log: Log) -> None:
    _, p = target(model, where)
    if kind in ("tensor", "tensor+post"):
        p.register_hook(nonlinear)
    if kind in ("post", "tensor+post"):
        p.register_post_accumulate_grad_hook(log.post)
    if kind == "module":
        owner = model.blocks[1]
        owner.register_full_backward_hook(
            lambda m, gi, go: tuple(None if g is None else nonlinear(g) for g in gi))


def eager(model: Net, x, y, where: str, calls: int = 2) -> None:
    loss_fn = loss_for(model, where)
    for _ in range(calls):
        for xs, ys in zip(x.chunk(MB), y.chunk(MB)):
            loss_fn(model(xs), ys).backward()


def grads(named) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in named}


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n in got:
        assert (got[n] is None) == (want[n] is None), n
        if got[n] is not None:
            torch.testing.assert_close(got[n], want[n], msg=n, **TOL)


def run_pipe(model: Net, x, y, where: str, devices: int, masters: bool, calls: int = 2,
             **kw) -> dict:
    pipe = RoundPipe(model, devices=["cpu"] * devices, seed=1,
                     optim_dtype=torch.float64 if masters else None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB, **kw))
    loss_fn = loss_for(model, where)
    for _ in range(calls):
        pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
    pipe.synchronize()
    # with masters a gradient left on the model's parameter is added to its master at
    # the step: eager's optimizer sees the sum, so compare the sum
    pipe._state.fold_outside_grads(pipe._state.outside_grads())
    got = grads(pipe.optim_named_parameters())
    pipe.close()
    return got


CASES = [(kind, where, masters)
         for kind in ("none", "tensor", "post", "tensor+post", "module")
         for where in ("loss_only", "model_and_loss", "tied")
         for masters in (False, True)
         if not (masters and "post" in kind)  # refused with masters (test_param_hooks)
         and not (kind == "module" and where != "model_and_loss")]


@pytest.mark.parametrize("kind,where,masters", CASES)
def test_hooks_on_a_parameter_loss_fn_reads_match_eager(kind, where, masters):
    model, x, y = make(tied=where == "tied")
    ref = copy.deepcopy(model)
    want_log = Log()
    install(ref, kind, where, want_log)
    eager(ref, x, y, where)
    want = grads(ref.named_parameters())
    if kind in ("tensor", "tensor+post") and where != "loss_only":
        # The hook binds: on each part alone it gives another gradient.
        split = copy.deepcopy(model)
        name, p = target(split, where)
        parts = []
        for xs, ys in zip(x.chunk(MB), y.chunk(MB)):
            g_model = torch.autograd.grad(loss_for(split, "loss_only")(split(xs), ys), p)[0]
            g_loss = 1e-2 * 2 * p.detach()
            parts.append(nonlinear(g_model) + nonlinear(g_loss))
        assert (sum(parts) * 2 - want[name]).abs().max() > 1e-4

    results = {}
    for devices in ((1, 3) if kind in ("tensor", "post") else (3,)):
        m = copy.deepcopy(model)
        log = Log()
        install(m, kind, where, log)
        got = run_pipe(m, x, y, where, devices, masters)
        assert_close(got, want)
        assert len(log.seen) == len(want_log.seen)
        for a, b in zip(log.seen, want_log.seen):
            torch.testing.assert_close(a, b, **TOL)
        if masters:
            assert all(p.grad is None for p in m.parameters())
        results[devices] = got
    if 1 in results:
        for n, g in results[1].items():
            assert (g is None and results[3][n] is None) or torch.equal(g, results[3][n]), n


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_grains(grain):
    model, x, y = make()
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    for net in (ref, m):
        install(net, "tensor", "model_and_loss", Log())
        net.blocks[2].bias.register_hook(nonlinear)  # a hooked parameter loss_fn does not read
    eager(ref, x, y, "model_and_loss")
    assert_close(run_pipe(m, x, y, "model_and_loss", 2, False, recompute_grain=grain),
                 grads(ref.named_parameters()))


class Detached(Net):
    """blocks[1]'s output is detached: its unit reads the weight but gives it no
    gradient, so loss_fn's part is the whole gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.blocks[0](x))
        h = h + torch.tanh(self.blocks[1](h)).detach()
        return self.head(h + torch.tanh(self.blocks[2](h)))


@pytest.mark.parametrize("kind", ["tensor", "post"])
def test_parameter_whose_unit_gives_no_gradient(kind):
    torch.manual_seed(0)
    model, (x, y) = Detached(), (torch.randn(6, 6), torch.randn(6, 6))
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    want_log, log = Log(), Log()
    install(ref, kind, "model_and_loss", want_log)
    install(m, kind, "model_and_loss", log)
    eager(ref, x, y, "model_and_loss")
    assert_close(run_pipe(m, x, y, "model_and_loss", 3, False), grads(ref.named_parameters()))
    assert len(log.seen) == len(want_log.seen) == 2 * MB * (kind == "post")


def test_step_as_gradients_land():
    """forward_backward(step=opt) with a hooked parameter loss_fn reads: the step sees the
    hooked total, as eager's per-microbatch loop then SGD."""
    model, x, y = make()
    ref = copy.deepcopy(model)
    install(ref, "tensor", "model_and_loss", Log())
    eager(ref, x, y, "model_and_loss", calls=1)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    m = copy.deepcopy(model)
    install(m, "tensor", "model_and_loss", Log())
    with RoundPipe(m, devices=["cpu"] * 3, optim_dtype=torch.float64,
                   model_run_config=RoundPipeRunConfig(num_microbatch=MB)) as pipe:
        opt = roundpipe.optim.SGD(pipe.optim_parameters(), lr=0.1)
        pipe.forward_backward((x,), label=y, loss_fn=loss_for(m, "model_and_loss"), step=opt)
        assert pipe.landing_step(opt) == "as gradients land"
        pipe.synchronize()
        got = {n: p.detach().clone() for n, p in pipe.optim_named_parameters()}
    want = {n: p.detach() for n, p in ref.named_parameters()}
    assert got.keys() == want.keys()
    for n in got:
        torch.testing.assert_close(got[n], want[n], msg=n, **TOL)


class _Square(torch.autograd.Function):
    """A read of the parameter that no torch function sees (a custom Function: apply
    is not one)."""

    @staticmethod
    def forward(ctx, p):
        ctx.save_for_backward(p)
        return (p * p).sum()

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return 2 * g * p


def _square_unseen(p: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():  # no torch function mode sees these ops
        return (p * p).sum()


@pytest.mark.parametrize("masters,read", [(False, "function"), (True, "function"),
                                          (False, "disabled")])
def test_unseen_read_is_refused_with_nothing_changed(masters, read):
    model, x, y = make()
    p = model.blocks[1].weight
    p.register_hook(nonlinear)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64 if masters else None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    plain = loss_for(model, "loss_only")
    pipe.forward_backward((x,), label=y, loss_fn=plain)
    pipe.synchronize()
    before = {n: (t.detach().clone(), None if t.grad is None else t.grad.clone())
              for n, t in list(pipe.optim_named_parameters()) + list(model.named_parameters())}
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    def sneaky(out, lab):
        square = _Square.apply if read == "function" else _square_unseen
        return plain(out, lab) + 1e-2 * square(p)

    with pytest.raises(ParameterHookError, match="blocks.1.weight") as info:
        pipe.forward_backward((x,), label=y, loss_fn=sneaky)
    assert "inside the model's forward" in str(info.value)
    after = {n: (t.detach().clone(), None if t.grad is None else t.grad.clone())
             for n, t in list(pipe.optim_named_parameters()) + list(model.named_parameters())}
    assert before.keys() == after.keys()
    for n, (w, g) in before.items():
        assert torch.equal(w, after[n][0]), n
        assert (g is None) == (after[n][1] is None), n
        assert g is None or torch.equal(g, after[n][1]), n
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in buffers.items())
    # the next call works and adds as before
    pipe.forward_backward((x,), label=y, loss_fn=plain)
    pipe.close()


def test_a_master_read_by_loss_fn_joins_before_the_hooks():
    """loss_fn reading the master of a hooked parameter a unit reads (float64 masters:
    the parameter's values) counts as reading the parameter: its part joins the unit's
    gradient before the tensor hook runs once on the total, as eager's loop reading the
    parameter (not refused as a read the mode cannot see)."""
    model, x, y = make()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.blocks[1].weight.register_hook(nonlinear)
    eager(ref, x, y, "model_and_loss")
    pipe = RoundPipe(model, devices=["cpu"] * 3, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    try:
        masters = dict(pipe.optim_named_parameters())

        def loss_fn(out, t):
            return (((out * masters["temp"] - t) ** 2).sum()
                    + 1e-2 * masters["blocks.1.weight"].pow(2).sum())
        for _ in range(2):
            pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
        pipe.synchronize()
        assert_close(grads(pipe.optim_named_parameters()), grads(ref.named_parameters()))
    finally:
        pipe.close()

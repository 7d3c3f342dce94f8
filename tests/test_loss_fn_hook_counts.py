"""Hooks inside ``loss_fn`` under ``forward_backward`` run as often as in eager's
per-microbatch loop, on the same gradients (float64, 2 SGD steps).

Before, a ``loss_fn`` that read both a parameter of the pipe's model (a learned
temperature, a regularizer) and a tensor of its own that requires grad (a criterion's
weight, a leaf made outside) was differentiated in two passes over its graph:
``torch.autograd.grad`` for the pipe's leaves, then ``backward(inputs=...)`` for its own.
Every hook on a path to both ran twice per microbatch (a tensor hook, a Node pre/post hook,
a multi-grad hook) and a retained ``.grad`` held twice eager's; the gradients were right
only because each pass applied the hooks to its own part.  And ``out.retain_grad()``
gave None whenever ``loss_fn`` read a pipe parameter.  Now one pass takes every gradient,
the leaves of ``loss_fn``'s own get theirs added as autograd adds them, and the output
keeps its gradient as ``loss.backward()`` leaves it.

The class: tensor hooks that count or return a new gradient, ``retain_grad`` (on an
intermediate, on the output), Node pre and post hooks, ``register_multi_grad_hook``
("all" and "any"), hooks on the model output ``loss_fn`` gets, tensor and post-accumulate-grad hooks on ``loss_fn``'s own leaf, hooked
parameters of the pipe, x ``loss_fn`` reading the output only / a pipe parameter (also
through a custom autograd Function) / its own leaf / both, x 1 and 3 microbatches, x ``optim_dtype`` masters or none; 1 and 3 devices
bitwise equal.  A multi-grad hook over a leaf of ``loss_fn``'s graph, which torch cannot
run under ``torch.autograd.grad``, is refused before the backward with nothing changed."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from roundpipe import LossError, RoundPipe, RoundPipeRunConfig

TOL = dict(rtol=1e-10, atol=1e-12)
STEPS = 2


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Net(nn.Module):
    """Three blocks; ``temp`` is read by no layer, only by loss_fn."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.temp = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return h


def make():
    torch.manual_seed(0)
    model = Net()
    # a leaf of loss_fn's own (a criterion's weight), not contiguous: its .grad's layout
    own = torch.randn(6, 6).t().requires_grad_()
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    return model, own, x, y


def _grads(gs) -> tuple:
    return tuple(None if g is None else g.detach().clone() for g in gs)


def make_loss(model: Net, own: torch.Tensor, reads: str, kinds: tuple[str, ...], log: list):
    """loss_fn reading the output and ``reads`` (a pipe parameter, its own leaf), with
    hooks of ``kinds`` inside; each hook call appends (what, gradient) to ``log``."""
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if "out" in kinds:
            out.register_hook(lambda g: log.append(("out", g.clone())) or g * 1.5)
        if "retain_out" in kinds:  # after the hook above: .grad is what it returned
            out.retain_grad()
            log.append(("retain_out", out))
        z = out
        if "param" in reads:  # a learned temperature and a regularizer on a unit's weight
            z = z * model.temp + 0.1 * model.blocks[2].weight.pow(2).sum()
        if "own" in reads:
            z = z @ own
        h = torch.sin(z)
        if "tensor" in kinds:
            h.register_hook(lambda g: log.append(("tensor", g.clone())))
        if "tensor_mod" in kinds:  # returns a new gradient, not linear in it
            h.register_hook(lambda g: log.append(("tensor_mod", g.clone())) or g.clamp(-.2, .2))
        if "retain" in kinds:
            h.retain_grad()
            log.append(("retain", h))  # its .grad is read after the call
        if "node" in kinds:
            h.grad_fn.register_prehook(lambda go: log.append(("pre", go[0].clone())))
            h.grad_fn.register_hook(lambda gi, go: log.append(("post", _grads(gi))))
        if "multi_all" in kinds:
            h2 = h * 3
            torch.autograd.graph.register_multi_grad_hook(
                (h, h2), lambda gs: log.append(("multi_all", _grads(gs))))
            h = h2
        if "multi_any" in kinds:
            h2 = h * 2
            torch.autograd.graph.register_multi_grad_hook(
                (h, h2), lambda g: log.append(("multi_any", g.clone())), mode="any")
            h = h2
        return ((h - y) ** 2).sum()
    return loss_fn


def install(model: Net, own: torch.Tensor, kinds: tuple[str, ...], log: list,
            masters: bool) -> None:
    """Hooks registered once, outside loss_fn: on loss_fn's own leaf, on pipe parameters
    loss_fn reads (a loss-only one and one a unit reads)."""
    if "own_hooks" in kinds:
        own.register_hook(lambda g: log.append(("own", g.clone())) or g * 0.5)
        own.register_post_accumulate_grad_hook(lambda p: log.append(("own_post",
                                                                     p.grad.clone())))
    if "own_node" in kinds:  # on its AccumulateGrad node (kept alive with the leaf)
        own.node = torch.autograd.graph.get_gradient_edge(own).node
        own.node.register_prehook(lambda go: log.append(("acc_pre", _grads(go))))
        own.node.register_hook(lambda gi, go: log.append(("acc_post", _grads(go))))
        own.register_post_accumulate_grad_hook(lambda p: log.append(("own_post",
                                                                     p.grad.clone())))
    if "param_hooks" in kinds:
        model.temp.register_hook(lambda g: log.append(("temp", g.clone())) or g * g.abs())
        model.blocks[2].weight.register_hook(
            lambda g: log.append(("w2", g.clone())) or g.clamp(-0.05, 0.05))
        if not masters:  # refused with masters (test_param_hooks)
            model.temp.register_post_accumulate_grad_hook(
                lambda p: log.append(("temp_post", p.grad.clone())))


def by_kind(log: list) -> dict[str, list]:
    """The hook calls per kind, in order (roundpipe runs a parameter's post-accumulate
    hooks at the commit, after the others: only the order within a kind is eager's)."""
    out: dict[str, list] = {}
    for what, value in log:
        if what in ("retain", "retain_out"):
            value = None if value.grad is None else value.grad.clone()
        out.setdefault(what, []).append(value if isinstance(value, tuple) else (value,))
    return out


def run_eager(reads, kinds, mb, masters):
    model, own, x, y = make()
    log: list = []
    install(model, own, kinds, log, masters)
    loss_fn = make_loss(model, own, reads, kinds, log)
    opt = torch.optim.SGD([*model.parameters(), own], lr=0.1)
    steps = []
    for _ in range(STEPS):
        for xs, ys in zip(x.tensor_split(mb), y.tensor_split(mb)):
            loss_fn(model(xs), ys).backward()
        steps.append({**{n: p.grad for n, p in model.named_parameters()}, "own": own.grad})
        steps[-1] = {n: None if g is None else g.clone() for n, g in steps[-1].items()}
        steps[-1]["own stride"] = None if own.grad is None else own.grad.stride()
        opt.step()
        opt.zero_grad()
    return steps, by_kind(log)


def run_pipe(reads, kinds, mb, masters, devices=3):
    model, own, x, y = make()
    log: list = []
    install(model, own, kinds, log, masters)
    loss_fn = make_loss(model, own, reads, kinds, log)
    steps = []
    with RoundPipe(model, devices=["cpu"] * devices,
                   optim_dtype=torch.float64 if masters else None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=mb)) as pipe:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        own_opt = torch.optim.SGD([own], lr=0.1)
        for _ in range(STEPS):
            pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
            pipe.synchronize()
            steps.append({**{n: None if p.grad is None else p.grad.clone()
                             for n, p in pipe.optim_named_parameters()},
                          "own": None if own.grad is None else own.grad.clone(),
                          "own stride": None if own.grad is None else own.grad.stride()})
            pipe.step(opt)
            own_opt.step()
            own_opt.zero_grad()
            pipe.synchronize()
    return steps, by_kind(log)


def assert_like_eager(got, want) -> None:
    (got_steps, got_log), (want_steps, want_log) = got, want
    for step, (g, w) in enumerate(zip(got_steps, want_steps)):
        assert g.keys() == w.keys()
        for name in g:
            assert (g[name] is None) == (w[name] is None), (step, name)
            if isinstance(g[name], torch.Tensor):
                torch.testing.assert_close(g[name], w[name], msg=f"{step} {name}", **TOL)
            else:
                assert g[name] == w[name], (step, name)
    assert {k: len(v) for k, v in got_log.items()} == {k: len(v) for k, v in want_log.items()}
    for kind, calls in want_log.items():
        for i, (a, b) in enumerate(zip(got_log[kind], calls)):
            assert len(a) == len(b), (kind, i)
            for p, q in zip(a, b):
                assert (p is None) == (q is None), (kind, i)
                if p is not None:
                    torch.testing.assert_close(p, q, msg=f"{kind} call {i}", **TOL)


@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "tensor_mod", "retain", "retain_out", "node",
                                  "multi_all", "multi_any"])
def test_hook_on_loss_fn_intermediate_runs_once(kind, masters):
    """loss_fn reads a pipe parameter and a leaf of its own: the hook ran twice per
    microbatch (a retained .grad was twice eager's; the output's retained .grad was None
    whenever loss_fn read a pipe parameter)."""
    kinds = (kind,)
    assert_like_eager(run_pipe("param+own", kinds, 3, masters),
                      run_eager("param+own", kinds, 3, masters))


@pytest.mark.parametrize("mb", [1, 3])
def test_hooks_on_the_accumulate_grad_node_of_loss_fn_own_leaf(mb):
    """Hooks on the AccumulateGrad node of loss_fn's own leaf (no tensor hooks on it):
    the leaf's gradient is added by that node, run by autograd, so they run as in eager
    (a first version of the single pass added the gradient itself and skipped them)."""
    kinds = ("own_node", "tensor")
    assert_like_eager(run_pipe("param+own", kinds, mb, False),
                      run_eager("param+own", kinds, mb, False))


ALL = ("out", "retain_out", "tensor", "tensor_mod", "retain", "node", "multi_all", "multi_any",
       "own_hooks", "param_hooks")


@pytest.mark.parametrize("mb", [1, 3])
@pytest.mark.parametrize("reads", ["out", "param", "own", "param+own"])
def test_every_hook_kind_at_once(reads, mb):
    masters = mb == 1  # both ways, without doubling the runs
    assert_like_eager(run_pipe(reads, ALL, mb, masters), run_eager(reads, ALL, mb, masters))


def test_one_and_three_devices_bitwise():
    want = run_eager("param+own", ALL, 3, False)
    one = run_pipe("param+own", ALL, 3, False, devices=1)
    three = run_pipe("param+own", ALL, 3, False, devices=3)
    assert_like_eager(three, want)
    for a, b in zip(one[0], three[0]):
        assert a.keys() == b.keys()
        for name in a:
            assert (a[name] is None and b[name] is None) or (
                torch.equal(a[name], b[name]) if isinstance(a[name], torch.Tensor)
                else a[name] == b[name]), name
    assert one[1].keys() == three[1].keys()
    for kind in one[1]:
        for a, b in zip(one[1][kind], three[1][kind]):
            assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("over", ["output", "own leaf"])
def test_multi_grad_hook_over_a_leaf_is_refused_with_nothing_changed(over):
    """loss_fn reading a pipe parameter is differentiated with torch.autograd.grad, under
    which torch cannot run a multi-grad hook ("all") over a leaf (the output loss_fn gets
    is one there). Before, torch's RuntimeError came out of the fused stage after the
    hooks before it ran. Refused before loss_fn's backward: no hook ran, no gradient or
    weight changed, and the next call works."""
    model, own, x, y = make()
    calls: list = []
    plain = make_loss(model, own, "param+own", (), calls)

    def loss_fn(out, t):
        h = torch.sin(out * model.temp) @ own
        h.register_hook(lambda g: calls.append("tensor"))
        leaf = out if over == "output" else own
        handle = torch.autograd.graph.register_multi_grad_hook(
            (leaf, h), lambda gs: calls.append("multi"))
        handles.append(handle)
        return ((h - t) ** 2).sum()
    handles: list = []
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=plain)
        pipe.synchronize()
        before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
        own_before = own.grad.clone()
        with pytest.raises(LossError, match="register_multi_grad_hook") as info:
            pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
        assert "loss_fn.<locals>.<lambda>" in str(info.value)
        assert ("the model output" if over == "output" else "loss_fn's own") in str(info.value)
        assert calls == []
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
        assert torch.equal(own.grad, own_before)
        for handle in handles:
            handle.remove()
        pipe.forward_backward((x,), label=y, loss_fn=plain)  # the next call works
        pipe.synchronize()

    ref, ref_own = make()[:2]
    ref_loss = make_loss(ref, ref_own, "param+own", (), [])
    for _ in range(2):
        for xs, ys in zip(x.tensor_split(3), y.tensor_split(3)):
            ref_loss(ref(xs), ys).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n, **TOL)
    torch.testing.assert_close(own.grad, ref_own.grad, **TOL)


class _Square(torch.autograd.Function):
    """A read of a parameter no torch function mode sees (apply is not a torch function)."""

    @staticmethod
    def forward(ctx, p):
        ctx.save_for_backward(p)
        return (p * p).sum()

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return 2 * g * p


@pytest.mark.parametrize("masters", [False, True])
def test_parameter_read_through_a_custom_function(masters):
    """The pipe parameter reached through a custom autograd Function (found as a leaf of
    loss_fn's graph, no alias), with a leaf of loss_fn's own: one pass too."""
    def run(pipe_it: bool):
        model, own, x, y = make()
        log: list = []

        def loss_fn(out, t):
            h = torch.sin(out @ own) + 1e-2 * _Square.apply(model.blocks[1].weight)
            h.register_hook(lambda g: log.append(("tensor", g.clone())))
            return ((h - t) ** 2).sum()
        if not pipe_it:
            for xs, ys in zip(x.tensor_split(3), y.tensor_split(3)):
                loss_fn(model(xs), ys).backward()
            return {**{n: p.grad for n, p in model.named_parameters()}, "own": own.grad}, log
        with RoundPipe(model, devices=["cpu"] * 3,
                       optim_dtype=torch.float64 if masters else None,
                       model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
            pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
            pipe.synchronize()
            return {**{n: None if p.grad is None else p.grad.clone()
                       for n, p in pipe.optim_named_parameters()}, "own": own.grad}, log
    (got, got_log), (want, want_log) = run(True), run(False)
    assert got.keys() == want.keys()
    for n in got:
        assert (got[n] is None) == (want[n] is None), n
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], msg=n, **TOL)
    assert want["temp"] is None and want["own"] is not None
    assert len(got_log) == len(want_log) == 3
    for (_, a), (_, b) in zip(got_log, want_log):
        torch.testing.assert_close(a, b, **TOL)

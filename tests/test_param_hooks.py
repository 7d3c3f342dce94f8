"""Hooks registered on parameters (``p.register_hook``, ``p.register_post_accumulate_grad_hook``)
run as eager PyTorch runs them, in every front end, in float64:

* ``forward_backward`` against eager's per-microbatch loop: tensor hooks on each
  microbatch's gradient (a tied parameter's uses summed first), post-accumulate hooks once
  per microbatch with ``.grad`` holding the running sum;
* ``pipe(x)`` + ``backward()`` and ``torch.compile(backend="roundpipe")`` against one eager
  backward of the whole batch: every hook once;

on 1 and 3 virtual devices (bitwise equal to each other), both recompute grains, hooks
registered and removed between calls; and the refusals (``ParameterHookError``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe import ParameterHookError, RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb

TOL = dict(rtol=1e-10, atol=1e-12)
MB = 3
BOUND = 0.02  # the clamps' bound: some entries of each gradient exceed it, not all


class TiedNet(nn.Module):
    """Embedding tied to the head: its weight is read by the first and the last layer
    unit (which fall in different stages on 1 and on 3 devices)."""

    def __init__(self, vocab: int = 16, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


@pytest.fixture(autouse=True)
def _float64_and_fresh_dynamo():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()
    rb.reset()
    yield
    torch._dynamo.reset()
    torch.set_default_dtype(previous)


def make(seed: int = 0) -> tuple[TiedNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = TiedNet()
    idx = torch.randint(0, 16, (6, 4))
    y = torch.randint(0, 16, (6, 4))
    return model, idx, y


class Log:
    """What the post-accumulate hooks saw: (parameter, .grad) per call of a hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.Tensor]] = []

    def post(self, name: str):
        def hook(p: torch.Tensor) -> None:
            self.seen.append((name, p.grad.detach().clone()))
        return hook


def install(model: TiedNet, log: Log) -> list:
    """A non-linear hook (clamp) on a parameter read by one unit and on the tied one, a
    linear hook, a value-dependent mask, and post-accumulate hooks on a plain and on the
    tied parameter, each also with a tensor hook (which must run once, before)."""
    return [
        model.blocks[1].weight.register_hook(lambda g: g.clamp(-BOUND, BOUND)),
        model.blocks[0].bias.register_hook(lambda g: g * 3),
        model.blocks[2].bias.register_hook(lambda g: g * (g > 0)),
        model.emb.weight.register_hook(lambda g: g.clamp(-BOUND, BOUND)),
        model.blocks[2].weight.register_hook(lambda g: g.clamp(-BOUND, BOUND) * 0.5),
        model.blocks[2].weight.register_post_accumulate_grad_hook(log.post("blocks.2.weight")),
        model.emb.weight.register_post_accumulate_grad_hook(log.post("emb.weight")),
    ]


def eager_per_microbatch(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> None:
    for i, t in zip(idx.chunk(MB), y.chunk(MB)):
        loss_fn(model(i), t).backward()


def grads(named) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in named}


def assert_close_grads(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in got:
        assert (got[name] is None) == (want[name] is None), name
        if got[name] is not None:
            torch.testing.assert_close(got[name], want[name], msg=name, **(tol or TOL))


def assert_same_log(got: Log, want: Log, **tol) -> None:
    """Each parameter's hook saw the same .grad values in the same order (the order
    between parameters is autograd's, which eager does not define)."""
    def by_name(log: Log) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for name, g in log.seen:
            out.setdefault(name, []).append(g)
        return out
    got_seen, want_seen = by_name(got), by_name(want)
    assert {n: len(v) for n, v in got_seen.items()} == \
        {n: len(v) for n, v in want_seen.items()}
    for name, values in got_seen.items():
        for g, w in zip(values, want_seen[name]):
            torch.testing.assert_close(g, w, msg=name, **(tol or TOL))


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] is None) == (b[name] is None), name
        if a[name] is not None:
            assert torch.equal(a[name], b[name]), name


def pipe_for(model: nn.Module, devices: int, **kw) -> RoundPipe:
    return RoundPipe(model, devices=["cpu"] * devices, seed=1,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB, **kw))


# --- forward_backward: one backward per microbatch --------------------------------------

@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_forward_backward_hooks_per_microbatch(grain):
    model, idx, y = make()
    ref = copy.deepcopy(model)
    want_log = Log()
    install(ref, want_log)
    for _ in range(2):  # the second call adds to the first's .grad
        eager_per_microbatch(ref, idx, y)
    want = grads(ref.named_parameters())
    # The clamps bind: applied to the sum over microbatches they would give another result.
    summed = copy.deepcopy(model)
    for _ in range(2):
        loss_fn(summed(idx), y).backward()
    assert (summed.emb.weight.grad - want["emb.weight"]).abs().max() > 1e-3
    assert (summed.blocks[1].weight.grad - want["blocks.1.weight"]).abs().max() > 1e-3

    results = {}
    for devices in (1, 3):
        m = copy.deepcopy(model)
        log = Log()
        install(m, log)
        pipe = pipe_for(m, devices, recompute_grain=grain)
        for _ in range(2):
            pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
        got = grads(pipe.optim_named_parameters())
        assert_close_grads(got, want)
        assert len(log.seen) == 2 * 2 * MB  # two hooked parameters, once per microbatch
        assert_same_log(log, want_log)
        results[devices] = (got, log)
        pipe.close()
    assert_bitwise(results[1][0], results[3][0])
    for (_, a), (_, b) in zip(results[1][1].seen, results[3][1].seen):
        assert torch.equal(a, b)


def test_forward_backward_tensor_hooks_with_masters():
    """With optim_dtype masters the hooks see gradients in the model's dtype and the
    result accumulates on the masters."""
    model, idx, y = make(1)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    for net in (ref, m):  # tensor hooks only: post hooks need optim_dtype=None
        for handle in install(net, Log())[-2:]:
            handle.remove()
    eager_per_microbatch(ref, idx, y)
    pipe = RoundPipe(m, devices=["cpu"] * 3, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
    assert_close_grads(grads(pipe.optim_named_parameters()), grads(ref.named_parameters()))
    assert all(p.grad is None for p in m.parameters())


# --- whole-batch backward: pipe(x) + backward() and the backend -------------------------

def _whole_batch(front: str, model: nn.Module, devices: int, grain: str):
    if front == "api":
        pipe = pipe_for(model, devices, recompute_grain=grain)
        return pipe, (lambda: pipe.optim_named_parameters()), pipe
    compiled = torch.compile(model, backend=rb.RoundPipeBackend(
        devices=["cpu"] * devices, num_microbatch=MB, recompute_grain=grain, seed=1))
    return compiled, (lambda: list(model.named_parameters())), None


@pytest.mark.parametrize("front", ["api", "backend"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_whole_batch_backward_runs_hooks_once(front, grain):
    model, idx, y = make(2)
    ref = copy.deepcopy(model)
    want_log = Log()
    install(ref, want_log)
    for _ in range(2):
        loss_fn(ref(idx), y).backward()
    want = grads(ref.named_parameters())
    results = {}
    for devices in (1, 3):
        m = copy.deepcopy(model)
        log = Log()
        install(m, log)
        fn, named, pipe = _whole_batch(front, m, devices, grain)
        for _ in range(2):
            loss_fn(fn(idx), y).backward()
        got = grads(named())
        assert_close_grads(got, want)
        assert len(log.seen) == 2 * 2  # two hooked parameters, once per backward
        assert_same_log(log, want_log)
        results[devices] = got
        if pipe is not None:
            pipe.close()
        torch._dynamo.reset()
    assert_bitwise(results[1], results[3])


# --- hooks registered and removed between calls -----------------------------------------

@pytest.mark.parametrize("front", ["forward_backward", "api", "backend"])
def test_hooks_registered_and_removed_between_calls(front):
    model, idx, y = make(3)
    ref, m = copy.deepcopy(model), copy.deepcopy(model)
    if front == "forward_backward":
        pipe = pipe_for(m, 3)
        run = lambda: pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)  # noqa: E731
        eager = lambda: eager_per_microbatch(ref, idx, y)  # noqa: E731
        named = pipe.optim_named_parameters
    else:
        fn, named, pipe = _whole_batch(front, m, 3, "stage")
        run = lambda: loss_fn(fn(idx), y).backward()  # noqa: E731
        eager = lambda: loss_fn(ref(idx), y).backward()  # noqa: E731
    want_log, log = Log(), Log()
    for step in range(3):
        if step == 1:
            want_handles, handles = install(ref, want_log), install(m, log)
        if step == 2:
            for h in want_handles + handles:
                h.remove()
        eager()
        run()
        assert_close_grads(grads(named()), grads(ref.named_parameters()))
        assert_same_log(log, want_log)
        for p in list(ref.parameters()) + [p for _, p in named()]:
            p.grad = None
    assert log.seen  # the hooks ran in the middle call only
    if pipe is not None:
        pipe.close()


# --- a class of hooks: random kinds on random parameters, one pipe, hooks changed per call

HOOKS = {
    "clamp": lambda c: (lambda g: g.clamp(-c, c)),
    "scale": lambda c: (lambda g: g * (1 + 10 * c)),
    "mask": lambda c: (lambda g: torch.where(g.abs() > c, g, torch.zeros_like(g))),
    "none": lambda c: (lambda g: None),
}
PARAMS = ["emb.weight", "blocks.0.weight", "blocks.1.bias", "blocks.2.weight"]


@pytest.fixture(scope="module")
def shared_pipes():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    model, idx, y = make(4)
    pipes = {d: pipe_for(copy.deepcopy(model), d) for d in (1, 3)}
    try:
        yield model, idx, y, pipes
    finally:
        # the files that run after this one in the same process expect float32
        torch.set_default_dtype(previous)
        for pipe in pipes.values():
            pipe.close()


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PARAMS), st.sampled_from(sorted(HOOKS)),
                          st.floats(0.001, 0.05)), min_size=1, max_size=4))
def test_any_tensor_hooks_match_eager_per_microbatch(shared_pipes, hooks):
    model, idx, y, pipes = shared_pipes
    ref = copy.deepcopy(model)
    for name, kind, c in hooks:
        ref.get_parameter(name).register_hook(HOOKS[kind](c))
    eager_per_microbatch(ref, idx, y)
    want = grads(ref.named_parameters())
    got = {}
    for devices, pipe in pipes.items():
        handles = [pipe.model.get_parameter(name).register_hook(HOOKS[kind](c))
                   for name, kind, c in hooks]
        try:
            pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
            got[devices] = grads(pipe.optim_named_parameters())
        finally:
            for h in handles:
                h.remove()
            for p in pipe.optim_parameters():
                p.grad = None
        assert_close_grads(got[devices], want)
    assert_bitwise(got[1], got[3])


# --- refused before anything runs ---------------------------------------------------------

def _untouched(pipe: RoundPipe, before: dict) -> None:
    assert pipe.call_number == 0
    assert all(p.grad is None for p in pipe.optim_parameters())
    assert_bitwise({n: p.detach() for n, p in pipe.model.named_parameters()}, before)


def test_post_accumulate_hook_with_masters_is_refused():
    model, idx, y = make()
    model.blocks[2].weight.register_post_accumulate_grad_hook(lambda p: None)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    with pytest.raises(ParameterHookError, match=r"blocks\.2\.weight.*pipe\.step"):
        pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
    with pytest.raises(ParameterHookError, match=r"blocks\.2\.weight"):
        pipe(idx)
    _untouched(pipe, before)


def test_hook_on_a_master_is_refused():
    model, idx, y = make()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float64,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    dict(pipe.optim_named_parameters())["blocks.0.bias"].register_hook(lambda g: g * 2)
    with pytest.raises(ParameterHookError, match=r"master of 'blocks\.0\.bias'"):
        pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
    _untouched(pipe, before)


def test_error_in_a_commit_hook_commits_nothing():
    model, idx, y = make()
    model.emb.weight.register_hook(lambda g: g[0])  # the wrong shape
    pipe = pipe_for(model, 2)
    with pytest.raises(ParameterHookError, match=r"emb\.weight.*shape"):
        pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
    assert all(p.grad is None for p in pipe.optim_parameters())


def test_post_hook_writing_its_parameter_between_microbatches_is_refused():
    model, idx, y = make()

    def step_in_backward(p: torch.Tensor) -> None:  # an optimizer step per parameter
        with torch.no_grad():
            p.sub_(0.1 * p.grad)
        p.grad = None
    model.blocks[0].weight.register_post_accumulate_grad_hook(step_in_backward)
    pipe = pipe_for(model, 2)
    with pytest.raises(ParameterHookError, match=r"blocks\.0\.weight.*after microbatch 0"):
        pipe.forward_backward((idx,), label=y, loss_fn=loss_fn)
    # one microbatch: the write is eager's, exact
    ref, _, _ = make()
    model2, _, _ = make()
    for net in (ref, model2):
        net.blocks[0].weight.register_post_accumulate_grad_hook(step_in_backward)
    loss_fn(ref(idx), y).backward()
    assert not torch.equal(ref.blocks[0].weight, model2.blocks[0].weight)
    pipe = pipe_for(model2, 2)
    pipe.forward_backward((idx,), label=y, loss_fn=loss_fn,
                          run_config=RoundPipeRunConfig(num_microbatch=1))
    torch.testing.assert_close(model2.blocks[0].weight, ref.blocks[0].weight, **TOL)
    assert model2.blocks[0].weight.grad is None


def test_commit_hooks_are_refused_under_data_parallelism():
    """Under data parallelism the commit follows the all-reduce; eager DDP runs hooks
    before it.  Hooks run on the device (a parameter read by one unit) are allowed."""
    from roundpipe.runtime.param_hooks import plan_hooks

    model, idx, y = make()
    pipe = pipe_for(model, 2)
    pipe.compile((idx,))
    entry = pipe._current
    model.blocks[1].weight.register_hook(lambda g: g * 2)
    plan = plan_hooks(entry.host, entry.plan.program, per_microbatch=True, data_parallel=True)
    assert {entry.host.specs[s].fqn for s in plan.on_device} == {"blocks.1.weight"}
    assert not plan.at_commit
    model.emb.weight.register_hook(lambda g: g * 2)  # tied: summed on the host first
    with pytest.raises(ParameterHookError, match=r"emb\.weight.*data parallelism"):
        plan_hooks(entry.host, entry.plan.program, per_microbatch=True, data_parallel=True)

"""The optimizer a user builds trains the pipe, or the first ``pipe.step`` says why not.

With ``optim_dtype`` the gradients land on masters (``pipe.optim_parameters()``); an
optimizer over ``model.parameters()`` used to step nothing, silently (exit code 0, weights
unchanged)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import roundpipe.optim
from roundpipe import OptimizerError, RoundPipe, RoundPipeRunConfig, StepError


def _setup(optim_dtype=torch.float32, dtype=torch.float32, frozen=()):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).to(dtype)
    for i in frozen:
        model[i].requires_grad_(False)
    x = torch.randn(4, 6, dtype=dtype)
    pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=optim_dtype,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    return pipe, model, x


def _call(pipe, x):
    return pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).sum())


def _snapshot(pipe, model):
    return ([p.detach().clone() for p in model.parameters()],
            [m.detach().clone() for m in pipe.optim_parameters()])


def _unchanged(pipe, model, before):
    weights, masters = before
    return (all(torch.equal(a, b) for a, b in zip(model.parameters(), weights))
            and all(torch.equal(a, b) for a, b in zip(pipe.optim_parameters(), masters)))


OPTIMIZERS = [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
              lambda ps: roundpipe.optim.AdamW(ps, lr=1e-2)]


@pytest.mark.parametrize("make", OPTIMIZERS, ids=["torch.AdamW", "torch.SGD", "rp.AdamW"])
@pytest.mark.parametrize("is_async", [True, False])
def test_an_optimizer_over_the_models_parameters_fails_the_first_step(make, is_async):
    pipe, model, x = _setup()
    opt = make(model.parameters())
    _call(pipe, x)
    before = _snapshot(pipe, model)
    with pytest.raises(OptimizerError) as error:
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
    message = str(error.value)
    assert not isinstance(error.value, StepError)
    for part in ("holds 8 of the model's own parameters", "'0.weight'",
                 "pipe.optim_parameters()", "optim_dtype=torch.float32",
                 "The model weights are unchanged"):
        assert part in message, (part, message)
    pipe.synchronize()  # nothing left to report
    assert _unchanged(pipe, model, before)
    # Built over the masters, the same loop trains.
    good = make(pipe.optim_parameters())
    pipe.step(lambda: (good.step(), good.zero_grad()), is_async=is_async)
    pipe.synchronize()
    assert not torch.equal(model[0].weight, before[0][0])
    pipe.close()


def test_partial_and_grouped_optimizers_name_what_they_hold():
    pipe, model, x = _setup()
    masters = dict(pipe.optim_named_parameters())
    params = dict(model.named_parameters())
    # Groups as Hugging Face builds them, half from the masters, half from the model.
    opt = torch.optim.AdamW([
        {"params": [masters[n] for n in masters if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [params[n] for n in params if n.endswith("bias")], "weight_decay": 0.0}])
    _call(pipe, x)
    before = _snapshot(pipe, model)
    with pytest.raises(OptimizerError) as error:
        pipe.step(lambda: (opt.step(), opt.zero_grad()))
    message = str(error.value)
    assert "holds 4 of the model's own parameters ('0.bias'" in message
    assert "and 4 of the pipe's float32 masters" in message
    assert "group 1: 4 model parameter(s), 0 master(s)" in message
    assert "pipe.optim_named_parameters()" in message
    assert _unchanged(pipe, model, before)
    pipe.close()


def test_a_second_optimizer_that_is_wrong_undoes_the_first():
    pipe, model, x = _setup()
    right = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    _call(pipe, x)
    before = _snapshot(pipe, model)
    with pytest.raises(OptimizerError, match="torch.optim.SGD, stepped inside pipe.step"):
        pipe.step(lambda: (right.step(), wrong.step()), is_async=False)
    assert _unchanged(pipe, model, before)  # no half-applied step
    pipe.close()


@pytest.mark.parametrize("optim_dtype", [torch.float32, None])
def test_an_optimizer_that_steps_nothing_is_refused(optim_dtype):
    pipe, model, x = _setup(optim_dtype)
    stray = torch.optim.AdamW(copy.deepcopy(model).parameters())  # no gradient ever
    _call(pipe, x)
    with pytest.raises(OptimizerError, match="none of them the pipe's and none with a "
                                             "gradient, so its step changes nothing"):
        pipe.step(lambda: stray.step())
    pipe.close()


@pytest.mark.parametrize("order", ["pipe_first", "other_first"])
@pytest.mark.parametrize("is_async", [True, False])
def test_an_idle_second_optimizer_beside_the_pipes_steps_as_in_eager(order, is_async):
    # A head outside the pipe that got no gradient this step: its optimizer's step is a
    # no-op in eager PyTorch, and must not undo the pipe's step.
    pipe, model, x = _setup()
    head = nn.Linear(6, 1)
    opts = [torch.optim.SGD(pipe.optim_parameters(), lr=0.1),
            torch.optim.AdamW(head.parameters(), lr=0.1)]
    if order == "other_first":
        opts.reverse()
    _call(pipe, x)
    before = _snapshot(pipe, model)
    head_before = head.weight.detach().clone()
    pipe.step(lambda: [o.step() for o in opts], is_async=is_async)
    pipe.synchronize()
    assert not torch.equal(model[0].weight, before[0][0])
    assert torch.equal(head.weight, head_before)
    pipe.close()


def test_another_modules_optimizer_may_step_beside_the_pipes():
    pipe, model, x = _setup()
    other = nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    opts = [torch.optim.SGD(other.parameters(), lr=0.1),
            torch.optim.SGD(pipe.optim_parameters(), lr=0.1)]
    _call(pipe, x)
    before = other.weight.detach().clone()
    pipe.step(lambda: [o.step() for o in opts], is_async=False)
    assert not torch.equal(other.weight, before)
    pipe.close()


def test_a_wrong_optimizer_after_good_steps_fails_the_next_call():
    pipe, model, x = _setup()
    good = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    _call(pipe, x)
    pipe.step(lambda: (good.step(), good.zero_grad()))
    _call(pipe, x)
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe.step(lambda: wrong.step(), is_async=True)  # asynchronous: a step has passed
    with pytest.raises(OptimizerError, match="holds 8 of the model's own parameters"):
        _call(pipe, x)
    pipe.close()


@settings(max_examples=4, deadline=None)
@given(frozen=st.sets(st.integers(0, 3), max_size=2), is_async=st.booleans())
def test_without_masters_the_models_parameters_are_the_optimized_ones(frozen, is_async):
    """optim_dtype=None: model.parameters() is what the pipe optimizes (frozen ones
    included, as torch skips them): the same update as over pipe.optim_parameters(), and
    as eager's per-microbatch loop."""
    results = []
    for which in ("model", "pipe", "eager"):
        pipe, model, x = _setup(None, torch.float64, frozen)
        params = list(model.parameters()) if which != "pipe" else pipe.optim_parameters()
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(2):
            if which == "eager":
                for xb in x.chunk(2):
                    model(xb).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            else:
                _call(pipe, x)
                pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)
        pipe.synchronize()
        results.append([p.detach().clone() for p in model.parameters()])
        pipe.close()
    for a, b, c in zip(*results):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)


def test_a_step_fn_waiting_inside_its_first_step_does_not_block_the_caller_forever():
    """The first pipe.step waits for its optimizer's verdict, not for the whole step:
    a step_fn that waits for the caller's next call after stepping still overlaps it."""
    import threading
    pipe, model, x = _setup()
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    resumed = threading.Event()
    _call(pipe, x)

    def step():
        opt.step()
        assert resumed.wait(30)
        opt.zero_grad()

    pipe.step(step, is_async=True)
    resumed.set()  # reached only if pipe.step returned before the step ended
    pipe.synchronize()
    pipe.close()


# --- a plain PyTorch loop: opt.step() outside pipe.step -------------------------------------

def _plain_loop_pipe():
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))
    return RoundPipe(model, devices=["cpu"] * 2, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))


@pytest.mark.parametrize("over", ["masters", "model_parameters"])
def test_an_optimizer_stepped_outside_pipe_step_is_refused(over: str) -> None:
    """forward_backward then opt.step() with no pipe.step: the masters would move and the
    weights the next call uploads would not, so the loss stayed the same step after step
    (exit 0). Refused before the optimizer writes anything."""
    import torch.nn.functional as F

    x = torch.randn(6, 4)
    with _plain_loop_pipe() as pipe:
        params = pipe.optim_parameters() if over == "masters" else pipe.model.parameters()
        opt = torch.optim.SGD(params, lr=0.5)
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=F.mse_loss)
        masters = [m.detach().clone() for m in pipe.optim_parameters()]
        weights = [p.detach().clone() for p in pipe.model.parameters()]
        with pytest.raises(OptimizerError, match=r"outside pipe.step.*pipe.step\(lambda"):
            opt.step()
        for a, b in zip(pipe.optim_parameters(), masters):
            assert torch.equal(a, b)
        for a, b in zip(pipe.model.parameters(), weights):
            assert torch.equal(a, b)
        # the same optimizer inside pipe.step trains
        if over == "masters":
            pipe.step(lambda: (opt.step(), opt.zero_grad()))
            assert any(not torch.equal(a, b) for a, b in zip(pipe.model.parameters(), weights))
    # once the pipe is closed, its tensors are the user's again
    opt.step()


def test_unrelated_optimizers_outside_pipe_step_are_not_refused() -> None:
    import torch.nn as nn

    with _plain_loop_pipe():
        other = nn.Linear(3, 3)
        other(torch.randn(2, 3)).sum().backward()
        before = other.weight.detach().clone()
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        opt.step()
        assert not torch.equal(other.weight, before)


@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
def test_a_parameter_unfrozen_after_the_first_step_is_refused_until_added(optimizer):
    """Progressive unfreezing with masters: the unfrozen parameter got its master at that
    point, so the optimizer built over pipe.optim_parameters() before did not hold it; its
    gradients landed and were never applied (eager's optimizer over model.parameters()
    steps it: 0.01 off after three Adam steps), silently.  Refused before the step; once
    added with add_param_group, training equals eager's (float64)."""
    pipe, model, x = _setup(optim_dtype=torch.float64, dtype=torch.float64, frozen=(0,))
    eager = copy.deepcopy(model)
    make = torch.optim.Adam if optimizer == "torch" else roundpipe.optim.AdamW
    kw = {} if optimizer == "torch" else {"weight_decay": 0.0}
    opt = make(pipe.optim_parameters(), lr=0.01, **kw)
    ref = torch.optim.Adam(eager.parameters(), lr=0.01) if optimizer == "torch" else \
        torch.optim.AdamW(eager.parameters(), lr=0.01, weight_decay=0.0)

    def eager_call():
        for a in x.chunk(2):
            eager(a).pow(2).sum().backward()

    _call(pipe, x)
    pipe.step(opt)
    eager_call()
    ref.step()
    ref.zero_grad()
    for m in (model, eager):
        m[0].requires_grad_(True)
    _call(pipe, x)
    with pytest.raises(OptimizerError, match=r"0\.weight and 1 more became trainable"):
        pipe.step(opt)
    named = dict(pipe.optim_named_parameters())
    opt.add_param_group({"params": [named["0.weight"], named["0.bias"]]})
    pipe.step(opt)  # the refused call's gradients are still there
    eager_call()
    ref.step()
    ref.zero_grad()
    pipe.synchronize()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=n)
    pipe.close()


def test_a_parameter_unfrozen_after_the_first_step_is_refused_by_forward_backward_step():
    """forward_backward(step=opt) steps as gradients land (LandingStep), never through
    pipe.step, so the unfrozen parameter's master, in no optimizer, went unstepped
    silently (3e-2 off eager's AdamW after four steps, float64).  Refused before the call
    runs; once added with add_param_group, training equals eager's."""
    pipe, model, x = _setup(optim_dtype=torch.float64, dtype=torch.float64, frozen=(0,))
    eager = copy.deepcopy(model)
    opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=0.01, weight_decay=0.0)
    ref = torch.optim.AdamW(eager.parameters(), lr=0.01, weight_decay=0.0)
    loss_fn = lambda out, _: out.pow(2).sum()  # noqa: E731

    def both_steps():
        pipe.forward_backward(input_args=(x,), loss_fn=loss_fn, step=opt)
        for a in x.chunk(2):
            eager(a).pow(2).sum().backward()
        ref.step()
        ref.zero_grad()

    both_steps()
    assert pipe.step_overlap(opt) == "per unit"  # (the landing step, not pipe.step)
    for m in (model, eager):
        m[0].requires_grad_(True)
    before = _snapshot(pipe, model)
    with pytest.raises(OptimizerError, match=r"0\.weight and 1 more became trainable"):
        pipe.forward_backward(input_args=(x,), loss_fn=loss_fn, step=opt)
    pipe.synchronize()
    assert _unchanged(pipe, model, before)
    assert all(m.grad is None for m in pipe.optim_parameters())
    named = dict(pipe.optim_named_parameters())
    opt.add_param_group({"params": [named["0.weight"], named["0.bias"]]})
    both_steps()
    both_steps()
    pipe.synchronize()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=n)
    pipe.close()

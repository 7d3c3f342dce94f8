"""Bad input and faults get a clear RoundPipeError, never a hang, and leave the pipe usable
with weights and gradients untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import (ConfigError, InputError, LossError, ModelError, RoundPipe,
                       RoundPipeError, RoundPipeRunConfig, StageError, StepError,
                       UnknownConfigFieldError)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _snapshot(pipe):
    return ([p.detach().clone() for p in pipe.model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in pipe.optim_parameters()])


def _assert_unchanged(pipe, snap):
    weights, grads = snap
    for a, b in zip(pipe.model.parameters(), weights):
        assert torch.equal(a, b)
    for p, g in zip(pipe.optim_parameters(), grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)


@pytest.fixture
def pipe():
    p = RoundPipe(_model(), devices=["cpu"] * 4, optim_dtype=torch.float32,
                  model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x = torch.randn(6, 4)
    p.forward_backward(input_args=(x,), label=torch.randn(6, 2), loss_fn=F.mse_loss)
    yield p
    p.close()


def _ok_call(pipe):
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    ref = copy.deepcopy(pipe.model)
    loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    expected = sum(F.mse_loss(ref(a), b) for a, b in zip(x.tensor_split(3), y.tensor_split(3)))
    torch.testing.assert_close(loss, expected.detach())


# --- bad input ----------------------------------------------------------------------------

def test_inputs_not_on_the_cpu(pipe):
    x = torch.empty(6, 4, device="meta")
    with pytest.raises(InputError, match="is on meta.*CPU"):
        pipe.forward_backward(input_args=(x,), label=torch.randn(6, 2), loss_fn=F.mse_loss)
    _ok_call(pipe)


def test_batch_smaller_than_num_microbatch(pipe):
    snap = _snapshot(pipe)
    with pytest.raises(InputError, match=r"2 samples but num_microbatch=3"):
        pipe.forward_backward(input_args=(torch.randn(2, 4),), label=torch.randn(2, 2),
                              loss_fn=F.mse_loss)
    _assert_unchanged(pipe, snap)
    _ok_call(pipe)


def test_label_batch_differs_from_inputs(pipe):
    with pytest.raises(InputError, match="label has batch size 5 but the inputs have 6"):
        pipe.forward_backward(input_args=(torch.randn(6, 4),), label=torch.randn(5, 2),
                              loss_fn=F.mse_loss)
    _ok_call(pipe)


def test_non_scalar_loss(pipe):
    snap = _snapshot(pipe)
    with pytest.raises(LossError, match=r"shape \(2, 2\).*scalar"):
        pipe.forward_backward(input_args=(torch.randn(6, 4),), label=torch.randn(6, 2),
                              loss_fn=lambda out, y: (out - y) ** 2)
    _assert_unchanged(pipe, snap)
    _ok_call(pipe)


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(num_microbatch=0), ConfigError, "num_microbatch must be >= 1, got 0"),
    (dict(num_microbatch=-2), ConfigError, "got -2"),
    (dict(num_microbatch=2.5), ConfigError, "positive int"),
    (dict(recompute_grain="block"), ConfigError, "'stage' or 'layer', got 'block'"),
    (dict(microbatches=4), UnknownConfigFieldError, "no field.*microbatches"),
])
def test_bad_run_config(kwargs, error, text):
    with pytest.raises(error, match=text):
        RoundPipeRunConfig(**kwargs)


def test_model_not_on_cpu_and_not_a_module():
    with pytest.raises(ModelError, match="not on the CPU"):
        RoundPipe(nn.Linear(2, 2, device="meta"), devices=["cpu"])
    with pytest.raises(ModelError, match="nn.Module"):
        RoundPipe(lambda x: x, devices=["cpu"])  # type: ignore[arg-type]


def test_errors_are_roundpipe_errors_and_builtin_types():
    assert issubclass(InputError, RoundPipeError) and issubclass(InputError, ValueError)
    assert issubclass(StageError, RuntimeError) and issubclass(StepError, RuntimeError)


# --- exceptions inside stages, loss_fn and step_fn -----------------------------------------

class _Boom(Exception):
    pass


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("where", ["forward", "recompute", "loss"])
@pytest.mark.parametrize("microbatch", [0, 1, 2])
def test_exception_in_a_stage_names_stage_device_and_microbatch(devices, where, microbatch):
    pipe = RoundPipe(_model(), devices=["cpu"] * devices, optim_dtype=torch.float32,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    snap = _snapshot(pipe)
    plan = pipe.plan
    calls = {"n": 0}
    loss_fn = F.mse_loss
    if where == "loss":
        def loss_fn(out, label):
            if calls["n"] == microbatch:
                raise _Boom("in loss_fn")
            calls["n"] += 1
            return F.mse_loss(out, label)
        stage = plan.fused_stage
    else:
        stage = plan.forward_stages[0] if where == "forward" else plan.backward_stages[-1]
        unit = plan.program.units[stage.units[0]]
        original = unit.module.forward

        def failing(*args):
            # The same unit program serves the forward stage and the recompute; count
            # only the calls of the phase under test (recompute records for autograd).
            if torch.is_grad_enabled() == (where == "recompute"):
                if calls["n"] == microbatch:
                    raise _Boom(f"in {where}")
                calls["n"] += 1
            return original(*args)

        unit.module.forward = failing
    with pytest.raises(StageError) as info:
        pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    e = info.value
    assert isinstance(e.__cause__, _Boom)
    assert e.stage == stage.index and e.microbatch == microbatch
    assert e.device == f"cpu:{stage.index % devices}"
    assert f"stage {stage.index}" in str(e) and f"microbatch {microbatch}" in str(e)
    _assert_unchanged(pipe, snap)
    if where != "loss":
        del unit.module.forward
    _ok_call(pipe)
    pipe.close()


@pytest.mark.parametrize("is_async", [False, True])
def test_exception_in_step_fn(pipe, is_async):
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    snap = _snapshot(pipe)

    def bad_step():
        opt.step()  # half the work done ...
        raise _Boom("in step_fn")

    if is_async:
        pipe.step(bad_step)
        with pytest.raises(StepError, match="step_fn raised _Boom"):
            pipe.synchronize()
    else:
        with pytest.raises(StepError, match="step_fn raised _Boom"):
            pipe.step(bad_step, is_async=False)
    # ... but the weights the pipe computes with are the ones from before the step, and
    # the masters were reset to them.
    weights, _ = snap
    for a, b in zip(pipe.model.parameters(), weights):
        assert torch.equal(a, b)
    for m, w in zip(pipe.optim_parameters(), weights):
        assert torch.equal(m, w)
    opt.zero_grad()
    _ok_call(pipe)
    pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)

"""What ``forward_backward`` returns and says: ``reduction``, a ``loss.backward()`` after
it, and errors raised inside ``loss_fn``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from roundpipe import (ConfigError, RoundPipe, RoundPipeError,
                       RoundPipeRunConfig, StageError)
from roundpipe.errors import BackwardAlreadyRunError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(5, 5) for _ in range(3)]).double()


def _loss(out, y):
    return (out - y).pow(2).sum()


@settings(max_examples=4, deadline=None)
@given(num_microbatch=st.sampled_from([1, 2, 3, 6]), devices=st.sampled_from([1, 2]),
       reduction=st.sampled_from(["sum", "mean"]))
def test_reduction_is_eagers_per_microbatch_loop(num_microbatch, devices, reduction):
    """"sum" (the default) and "mean": the returned loss and the gradients of eager's
    per-microbatch loop over loss_fn (divided by num_microbatch for the mean)."""
    model = _model()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    eager = copy.deepcopy(model)
    total = 0.0
    for xb, yb in zip(x.chunk(num_microbatch), y.chunk(num_microbatch)):
        loss = _loss(eager(xb), yb) / (num_microbatch if reduction == "mean" else 1)
        loss.backward()
        total += loss.item()
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch)) as pipe:
        kwargs = {} if reduction == "sum" else {"reduction": "mean"}
        got = pipe.forward_backward(input_args=(x,), label=y, loss_fn=_loss, **kwargs)
        assert pipe.plan.num_microbatch == num_microbatch
        assert abs(got.item() - total) <= 1e-10 * max(1.0, abs(total))
        for (name, p), q in zip(pipe.optim_named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_reduction_is_checked_and_plan_num_microbatch_follows_the_call():
    model, x = _model(), torch.randn(6, 5, dtype=torch.float64)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        with pytest.raises(ConfigError, match="reduction must be 'sum' or 'mean', got 'avg'"):
            pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss, reduction="avg")
        sums = pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss,
                                     run_config=RoundPipeRunConfig(num_microbatch=3))
        assert pipe.plan.num_microbatch == 3
        mean = pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss,
                                     run_config=RoundPipeRunConfig(num_microbatch=3),
                                     reduction="mean")
        assert abs(mean.item() - sums.item() / 3) <= 1e-12 * abs(sums.item())


def test_loss_backward_after_forward_backward_says_the_backward_ran():
    model, x = _model(), torch.randn(6, 5, dtype=torch.float64)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        loss, out = pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss,
                                          return_outputs=True)
        grads = [p.grad.clone() for p in pipe.optim_parameters()]
        with pytest.raises(BackwardAlreadyRunError) as error:
            loss.backward()
        assert isinstance(error.value, RoundPipeError)
        assert "forward_backward() already ran the backward" in str(error.value)
        assert "pipe.step" in str(error.value) and "pipe(x)" in str(error.value)
        for p, g in zip(pipe.optim_parameters(), grads):  # nothing happened
            assert torch.equal(p.grad, g)
        # Otherwise a plain tensor: prints, computes, copies and saves as one.
        assert repr(loss).startswith("tensor(") and str(loss) == str(loss.detach())
        for derived in (loss + 1, loss.detach(), loss.clone(), copy.deepcopy(loss)):
            assert type(derived) is torch.Tensor
        buffer = io.BytesIO()
        torch.save({"loss": loss}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)["loss"]
        assert type(loaded) is torch.Tensor and torch.equal(loaded, loss)
        assert loss.item() == float(loss) and not loss.requires_grad


@pytest.mark.parametrize("spec", ["", ".3f", ".4e", ">12.2f", "g"])
def test_the_returned_loss_formats_as_a_plain_tensor(spec):
    """f"{loss:.3f}", the usual way to log a loss, formats it as a plain 0-dim tensor
    does (its float's format): a subclass fell to object.__format__ (TypeError)."""
    model, x = _model(), torch.randn(6, 5, dtype=torch.float64)
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        loss = pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss)
        assert format(loss, spec) == format(loss.detach(), spec)
        assert f"{loss:{spec}}" == format(loss.item(), spec) or spec == ""


@pytest.mark.parametrize("label", [True, False])
def test_an_error_inside_loss_fn_names_loss_fn_not_a_stage(label):
    model, x = _model(), torch.randn(6, 5, dtype=torch.float64)

    def loss_fn(out, y):
        return (out - y).pow(2).sum() + undefined_name  # noqa: F821

    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        with pytest.raises(StageError) as error:  # with .stage, .device, .microbatch
            pipe.forward_backward(input_args=(x,), label=x if label else None, loss_fn=loss_fn)
        message = str(error.value)
        assert message.startswith("in loss_fn(output, label) (microbatch 0, on cpu:1, after "
                                  "stage 1, the model's last): ")
        if label:
            assert "NameError: name 'undefined_name' is not defined" in message
            assert "label=None" not in message
        else:  # (out - None) fails first: the missing label is named
            assert "TypeError" in message
            assert "forward_backward was called without label=" in message
        assert "raised" not in message.split(":")[0]  # not "stage 1 (fused, ...) raised"
        assert error.value.microbatch == 0 and error.value.device == "cpu:1"
        assert isinstance(error.value.__cause__, (NameError, TypeError))  # user's traceback
        # The pipe is usable afterwards.
        pipe.forward_backward(input_args=(x,), label=x, loss_fn=_loss)

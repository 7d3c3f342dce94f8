"""A non-finite loss of any one microbatch stops the call with a LossError that names that
microbatch, and nothing is committed (issue 33: a check that skipped a microbatch passed
the suite, whose non-finite losses were non-finite in every microbatch)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import LossError, RoundPipe, RoundPipeRunConfig

MICROBATCHES = 3


@pytest.mark.parametrize("bad", range(MICROBATCHES))
def test_a_non_finite_loss_in_one_microbatch_is_refused(bad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    calls = []

    def loss_fn(out, label):
        calls.append(None)
        loss = F.mse_loss(out, label)
        return loss * math.nan if len(calls) - 1 == bad else loss

    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES)) as pipe:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(LossError, match="nan") as info:
            pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        assert f"microbatch {bad}" in str(info.value)
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

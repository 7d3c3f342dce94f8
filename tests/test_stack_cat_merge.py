"""Outputs that stack or concatenate per-sample values along, before and after the batch
dimension: ``pipe(x)`` (several microbatches) and ``torch.compile(backend="roundpipe")``
merge them into eager's shape and values, and gradients flow back exactly (float64).

Issue 33: with the stack rule moved by one dimension, ``torch.stack([h, f(h)])`` came out
(6, 2, 4) instead of eager's (2, 6, 4) with no error, and no test noticed: none stacked
along or before the batch dimension.  A join along the batch dimension itself is not per
sample; it must be refused or come out as eager's, never reordered silently.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from roundpipe import RoundPipe, RoundPipeError, RoundPipeRunConfig
from roundpipe import backend as rb

BATCH, WIDTH, MICROBATCHES = 6, 4, 3

# name -> the output made of h and g (both (BATCH, WIDTH), batch dimension 0)
JOINS = {
    "stack_before": lambda h, g: torch.stack([h, g]),  # (2, 6, 4): batch moves to 1
    "stack_before_1": lambda h, g: torch.stack([h[None], g[None]], dim=1),  # (1, 2, 6, 4)
    "stack_after": lambda h, g: torch.stack([h, g], dim=1),  # (6, 2, 4)
    "stack_last": lambda h, g: torch.stack([h, g], dim=-1),  # (6, 4, 2)
    "cat_before": lambda h, g: torch.cat([h.unsqueeze(0), g.unsqueeze(0)]),  # (2, 6, 4)
    "cat_after": lambda h, g: torch.cat([h, g], dim=1),  # (6, 8)
    "cat_after_3d": lambda h, g: torch.cat([h.unsqueeze(1), g.unsqueeze(1)], dim=-2),
}
ALONG_BATCH = {"cat_at": lambda h, g: torch.cat([h, g])}  # (12, 4): not per sample


class Joined(nn.Module):
    def __init__(self, join):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.join = join

    def forward(self, x):
        h = self.inp(x)
        return self.join(h, self.body(h))


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _case(join):
    torch.manual_seed(0)
    model = Joined(join)
    x = torch.randn(BATCH, WIDTH)
    eager = copy.deepcopy(model)
    want = eager(x)
    weight = torch.randn(want.shape)  # a loss that weighs every element differently
    (want * weight).sum().backward()
    return model, x, want, weight, [p.grad for p in eager.parameters()]


def _check(out, model, want, weight, grads):
    assert out.shape == want.shape, f"shape {tuple(out.shape)}, eager {tuple(want.shape)}"
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    (out * weight).sum().backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def _split(stats):
    """The forward ran in MICROBATCHES microbatches (the join did not stop the split)."""
    assert max(j.microbatches for j in stats.timeline if j.kind == "fwd") == MICROBATCHES


def _pipe(model):
    return RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES))


@pytest.mark.parametrize("name", sorted(JOINS))
def test_pipe_call_merges_joins_like_eager(name):
    model, x, want, weight, grads = _case(JOINS[name])
    with _pipe(model) as pipe:
        out = pipe(x)
        _split(pipe.stats())
        _check(out, model, want, weight, grads)


@pytest.mark.parametrize("name", sorted(JOINS))
def test_backend_merges_joins_like_eager(name):
    model, x, want, weight, grads = _case(JOINS[name])
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=MICROBATCHES)
    out = torch.compile(model, backend=backend)(x)
    _split(backend.stats())
    _check(out, model, want, weight, grads)


def test_pipe_call_joining_along_the_batch_is_refused_or_exact():
    model, x, want, weight, grads = _case(ALONG_BATCH["cat_at"])
    with _pipe(model) as pipe:
        try:
            out = pipe(x)
        except RoundPipeError as e:
            assert "batch" in str(e)
            return
        _check(out, model, want, weight, grads)


def test_backend_joining_along_the_batch_is_split_never_or_exact():
    model, x, want, weight, grads = _case(ALONG_BATCH["cat_at"])
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=MICROBATCHES)
    out = torch.compile(model, backend=backend)(x)
    _check(out, model, want, weight, grads)

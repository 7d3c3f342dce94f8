"""RoundPipeRunConfig's split/merge specs and callables, and preserve_rng_state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from roundpipe import ConfigError, RoundPipe, RoundPipeRunConfig


class TwoInputs(nn.Module):
    """Reads a batched tensor and a shared (unbatched) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, shared):
        return self.b(torch.tanh(self.a(x) + shared))


def test_unbatched_inputs_are_replicated_and_outputs_concatenated():
    torch.manual_seed(0)
    model = TwoInputs().double()
    x, shared = torch.randn(7, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with torch.no_grad():
        out = pipe(x, shared)
        torch.testing.assert_close(out, model(x, shared), rtol=1e-12, atol=1e-12)
    pipe.close()


def test_split_spec_and_merge_spec():
    torch.manual_seed(0)
    model = TwoInputs().double()
    x = torch.randn(4, 6, dtype=torch.float64)  # batch along dim 1
    shared = torch.randn(4, dtype=torch.float64)

    class Transposed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, xt, shared):
            return self.inner(xt.t(), shared).t()

    wrapped = RoundPipe(Transposed(copy.deepcopy(model)), devices=["cpu"] * 2)
    cfg = RoundPipeRunConfig(num_microbatch=3, split_input=((1, None), {}), merge_output=1)
    with torch.no_grad():
        out = wrapped(x, shared, run_config=cfg)
        torch.testing.assert_close(out, model(x.t(), shared).t(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="split spec for input has 1 leaves but input has 2"):
        wrapped(x, shared, run_config=RoundPipeRunConfig(split_input=((1,), {})))
    wrapped.close()


def test_callable_split_and_merge():
    torch.manual_seed(0)
    model = TwoInputs().double()
    x, shared = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    seen = []

    def split(args, kwargs, n):
        seen.append(n)
        return [((chunk, args[1]), kwargs) for chunk in args[0].chunk(n)]

    cfg = RoundPipeRunConfig(num_microbatch=2, split_input=split,
                             merge_output=lambda outs: torch.stack(outs))
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2)
    with torch.no_grad():
        out = pipe(x, shared, run_config=cfg)
    assert seen and seen[-1] == 2
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out.reshape(6, 4), model(x, shared), rtol=1e-12, atol=1e-12)
    pipe.close()


def test_label_split_spec_for_a_dict_label():
    torch.manual_seed(0)
    model = TwoInputs().double()
    x, shared = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    label = {"target": torch.randn(6, 4, dtype=torch.float64), "weight": torch.tensor(2.0)}
    pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))

    def loss_fn(out, y):
        return y["weight"] * F.mse_loss(out, y["target"])

    loss = pipe.forward_backward(input_args=(x, shared), label=label, loss_fn=loss_fn)
    expected = sum(loss_fn(model(a, shared), {"target": t, "weight": label["weight"]})
                   for a, t in zip(x.chunk(2), label["target"].chunk(2)))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    pipe.close()


def test_preserve_rng_state_false_draws_fresh_masks():
    """With keyed streams (the default) two forward calls with the same call number draw
    the same dropout masks; with preserve_rng_state=False they come from the default
    generator and differ."""
    model, (idx,), kw = models.gpt(dropout=0.5, layers=2)
    pipe = RoundPipe(model, devices=["cpu"], seed=3,
                     model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with torch.no_grad():
        a = pipe(idx, **kw)["logits"]
        pipe.call_number -= 1
        b = pipe(idx, **kw)["logits"]
        assert torch.equal(a, b)
        off = RoundPipeRunConfig(preserve_rng_state=False)
        c = pipe(idx, **kw, run_config=off)["logits"]
        pipe.call_number -= 1
        d = pipe(idx, **kw, run_config=off)["logits"]
        assert not torch.equal(c, d)
    pipe.close()

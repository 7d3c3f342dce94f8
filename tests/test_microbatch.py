"""The merge rules both front ends share (``runtime/microbatch.py``): merging microbatch
outputs, splitting the merged gradient back (its adjoint), joining input gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import ConfigError
from roundpipe.runtime.microbatch import join_input_grad, merge_column, split_grad

import models

RULES = ["first", "sum", "mean", "stack", 0, 1]


@settings(max_examples=60, deadline=None)
@given(rule=st.sampled_from(RULES), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       width=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_split_grad_is_the_adjoint_of_merge_column(rule, sizes, width, seed):
    """<merge(x), g> == sum_i <x_i, split(g)_i> for every rule: the gradient routed back
    to each microbatch is exactly what autograd would give through the merge."""
    gen = torch.Generator().manual_seed(seed)
    if rule in ("sum", "mean", "stack", "first"):
        pieces = [torch.randn(3, width, generator=gen, dtype=torch.float64) for _ in sizes]
    elif rule == 0:
        pieces = [torch.randn(n, width, generator=gen, dtype=torch.float64) for n in sizes]
    else:
        pieces = [torch.randn(2, n, generator=gen, dtype=torch.float64) for n in sizes]
    leaves = [p.clone().requires_grad_(True) for p in pieces]
    merged = merge_column(leaves, rule, sizes)
    grad = torch.randn(merged.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(merged, leaves, grad, allow_unused=True)
    got = split_grad(grad, rule, pieces, sizes)
    assert len(got) == len(pieces)
    for g, e, p in zip(got, expected, pieces):
        g = torch.zeros_like(p) if g is None else g
        e = torch.zeros_like(p) if e is None else e
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_join_input_grad_fills_a_missing_piece_with_zeros_and_never_aliases():
    x = torch.arange(10.0).reshape(5, 2)
    pieces = list(torch.split(x, [3, 2]))
    g0 = torch.ones(3, 2)
    joined = join_input_grad([g0, None], pieces)
    assert joined.shape == x.shape
    assert torch.equal(joined, torch.cat([g0, torch.zeros(2, 2)]))
    # A replicated input: gradients summed into a fresh tensor.
    only = torch.ones(5, 2)
    total = join_input_grad([only, None, None], None)
    assert torch.equal(total, only) and total.data_ptr() != only.data_ptr()
    assert join_input_grad([None, None], None) is None


def test_call_number_replays_a_calls_dropout_masks():
    model, (idx,), kw = models.gpt(dropout=0.5, layers=2)
    with RoundPipe(model, devices=["cpu"] * 2, seed=3,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        assert pipe.call_number == 0
        with torch.no_grad():
            a = pipe(idx, **kw)["logits"]
            assert pipe.call_number == 1
            b = pipe(idx, **kw)["logits"]
            assert not torch.equal(a, b)  # call 1 draws other masks than call 0
            pipe.call_number = 0
            c = pipe(idx, **kw)["logits"]
        assert torch.equal(a, c)
        for bad in (-1, 1.5, True, "0"):
            with pytest.raises(ConfigError, match="call_number must be an int >= 0"):
                pipe.call_number = bad

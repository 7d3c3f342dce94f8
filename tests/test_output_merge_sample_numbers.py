"""The merge pass claimed per-sample values that were not: ``pipe(x)`` concatenated
microbatch pieces that differ from eager's whole-batch value.  Each case is followed by a
trainable scale (so the value cannot be recomputed after the pipeline): the call must
equal eager or raise MergeError, never return another number.

* the sample numbers (``arange(B)``, used to index each sample's rows) were carried
  through ops that change their values (``one_hot``, ``diff``, ``index_fill``,
  ``bucketize``, ``pad``, ``zero_``), then indexed rows as if they were sample numbers;
* the batch size as the first, scalar, argument (``pow(B, x)``, ``xlogy(B, x)``,
  ``remainder(B, x)``) or as ``full_like``'s fill value was not seen;
* a ``repeat``/``tile``/``expand`` to the batch size in a new dimension made a
  batch-long dimension the merge does not concatenate ((2, 6, 4) for eager's (6, 6, 4));
* ``bucketize`` with batch boundaries places every value among all of the batch's.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.errors import MergeError


def _rows(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[0]).unsqueeze(1).expand(-1, 3)


CASES: dict[str, Callable[[torch.Tensor], Any]] = {
    "one_hot_of_sample_numbers": lambda h: h[F.one_hot(torch.arange(h.shape[0]), 16)[:, 0]],
    "diff_of_sample_numbers": lambda h: h[torch.diff(_rows(h), dim=1)[:, 0]],
    "index_fill_of_sample_numbers": lambda h: h[_rows(h).index_fill(
        1, torch.tensor([0]), 0)[:, 0]],
    "bucketize_of_sample_numbers": lambda h: h[torch.bucketize(torch.arange(h.shape[0]),
                                                               torch.tensor([2, 4]))],
    "pad_of_sample_numbers": lambda h: h[F.pad(torch.arange(h.shape[0]).unsqueeze(1),
                                               (1, 0))[:, 0]],
    "zeroed_sample_numbers": lambda h: h[torch.arange(h.shape[0]).zero_()],
    "pow_batch_size_base": lambda h: torch.pow(h.shape[0], h),
    "xlogy_batch_size": lambda h: torch.xlogy(h.shape[0], h.abs()),
    "remainder_batch_size": lambda h: torch.remainder(h.shape[0], h),
    "full_like_batch_size": lambda h: torch.full_like(h, h.shape[0]) * h,
    "repeat_to_batch_size": lambda h: h.unsqueeze(0).repeat(h.shape[0], 1, 1),
    "tile_to_batch_size": lambda h: torch.tile(h.unsqueeze(0), (h.shape[0], 1, 1)),
    "expand_to_batch_size": lambda h: h.unsqueeze(0).expand(h.shape[0], -1, -1),
    "bucketize_batch_boundaries": lambda h: torch.bucketize(h[:, 1].contiguous(),
                                                            h[:, 0].contiguous()).to(h.dtype),
}

# still merged (the sample numbers only moved, or the boundaries are replicated)
MERGEABLE = {
    "moved_sample_numbers": lambda h: h[_rows(h).permute(1, 0)[0]],
    "bucketize_replicated_boundaries": lambda h: torch.bucketize(
        h, torch.tensor([-0.5, 0.0, 0.5], dtype=h.dtype)).to(h.dtype),
    "expand_batch_dim_by_size": lambda h: h[:, :1].expand(h.shape[0], 4) * h,
}


class _Model(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.op = op
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(torch.tanh(self.lin(x))) * self.scale


def _run(op: Callable[[torch.Tensor], Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    torch.manual_seed(0)
    model = _Model(op).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.double)  # 3 microbatches of 2: same-sized pieces
    with RoundPipe(model, devices=["cpu"],
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        try:
            with torch.no_grad():
                out = pipe(x)
        except MergeError:
            return None
    with torch.no_grad():
        return out, eager(x)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_value_that_is_not_per_sample_is_refused_or_equal(name: str) -> None:
    result = _run(CASES[name])
    if result is not None:
        out, ref = result
        assert out.shape == ref.shape, name
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("name", sorted(MERGEABLE))
def test_per_sample_values_still_merge(name: str) -> None:
    result = _run(MERGEABLE[name])
    assert result is not None, name
    out, ref = result
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

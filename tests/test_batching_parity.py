"""One batching proof, both front ends: ``pipe(x)`` and ``torch.compile(backend="roundpipe")``
hand the same analysis (``passes/output_merge.propagate``) the same kind of graph (ATen ops:
export's, or Dynamo's lowered by ``passes/batching.py``), so they split or refuse alike.

Every op of the behaviour suites (``TRICKY`` in test_output_merge.py, the sample-number
cases, ``nn.MultiheadAttention`` with and without ``key_padding_mask``, top-k routing)
runs between a linear layer and a trainable scale, through both front ends with
``num_microbatch=3`` on a batch of 7: both split (3 microbatches) or neither does
(``pipe(x)`` raises MergeError, the backend runs one microbatch), and what runs equals
eager in float64 (1e-10), outputs and gradients.  The einsum property runs random
equations through both."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings

import test_output_merge as tom
import test_output_merge_sample_numbers as tsn
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb
from roundpipe.errors import MergeError, TraceError

TOL = dict(rtol=1e-10, atol=1e-10)


class _Op(nn.Module):
    """A linear layer, the op under test, a trainable scale (so a value that mixes samples
    cannot be recomputed after the pipeline: it must be proven per sample, or refused)."""

    def __init__(self, op: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.op = op
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(torch.tanh(self.lin(x))) * self.scale


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        a, _ = self.att(h, h, h, key_padding_mask=mask)
        return self.out(torch.tanh(a))


class _TopKRouting(nn.Module):
    """Mixture of experts: each token's top-2 experts by a softmax gate, weights scattered
    into a dense (tokens, experts) table, experts mixed by it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        top = probs.topk(2, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        outs = torch.stack([e(x) for e in self.experts], -1)
        return (outs * weights.unsqueeze(-2)).sum(-1)


def _run(kind: str, model: nn.Module, args: tuple, grad: bool
         ) -> tuple[bool, Any, dict] | None:
    """Output, gradients and whether the call was split, for one front end; None where
    ``pipe(x)`` refuses."""
    if kind == "api":
        pipe = RoundPipe(model, devices=["cpu"] * 2, optim_dtype=None,
                         model_run_config=RoundPipeRunConfig(num_microbatch=3))
        try:
            with torch.set_grad_enabled(grad):
                out = pipe(*args)
        except (MergeError, TraceError):
            pipe.close()
            return None
        if grad:
            _backward(out)
        grads = {n: p.grad for n, p in pipe.optim_named_parameters()}
        pipe.close()
        return True, out, grads
    fn = torch.compile(model, dynamic=True, backend=rb.RoundPipeBackend(
        devices=["cpu"] * 2, num_microbatch=3))
    with torch.set_grad_enabled(grad):
        out = fn(*args)
    if grad:
        _backward(out)
    splits = {p.num_microbatch for p in rb.plans()}  # a graph break gives several graphs
    assert splits <= {1, 3}, splits
    return splits == {3}, out, {n: p.grad for n, p in model.named_parameters()}


def _backward(out: torch.Tensor) -> None:
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()


def _parity(make: Callable[[], nn.Module], args: tuple, what: str,
            differ: bool = False) -> bool:
    """Both front ends split alike (``differ``: the backend splits where ``pipe(x)``
    refuses) and equal eager; whether ``pipe(x)`` splits."""
    torch._dynamo.reset()
    rb.reset()
    torch.manual_seed(0)
    model = make().double()
    eager = copy.deepcopy(model)
    want = eager(*args)
    try:
        _backward(want)
        grad = True
    except RuntimeError as e:  # eager has no derivative either (remainder): values only
        assert "not implemented" in str(e), (what, e)
        grad = False
    want_grads = {n: p.grad for n, p in eager.named_parameters()}
    verdicts = {}
    for kind in ("api", "backend"):
        result = _run(kind, copy.deepcopy(model), args, grad)
        verdicts[kind] = result is not None and result[0]
        if result is None:
            continue
        _, out, grads = result
        assert out.shape == want.shape, (what, kind)
        torch.testing.assert_close(out, want, **TOL, msg=f"{what} {kind}")
        assert grads.keys() == want_grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, want_grads[n], **TOL, msg=f"{what} {kind} {n}")
    assert verdicts == {"api": not differ, "backend": True} if differ else \
        verdicts["api"] == verdicts["backend"], (what, verdicts)
    torch._dynamo.reset()
    return verdicts["api"]


OPS = {**tom.TRICKY, **tsn.CASES, **tsn.MERGEABLE}
MERGEABLE = tom.MERGEABLE | set(tsn.MERGEABLE)  # the others may split or not, alike
# Dynamo cannot trace an output whose size depends on values (one_hot's class count
# taken from the batch's largest label): it breaks the graph there and runs the op
# eagerly on the whole batch, so the backend splits the graphs around it (exact, the
# values are checked), where pipe(x), which traces the whole model, refuses.
GRAPH_BREAKS = {"one_hot_by_batch_max"}


@pytest.mark.parametrize("name", sorted(OPS))
def test_both_front_ends_split_each_op_alike(name: str) -> None:
    x = torch.randn(7, 4, dtype=torch.double)
    try:
        split = _parity(lambda: _Op(OPS[name]), (x,), name, differ=name in GRAPH_BREAKS)
    except RuntimeError as e:  # the op cannot run on 7 samples (glu over the batch)
        assert name not in MERGEABLE and "glu" in name, (name, e)
        return
    if name in MERGEABLE:
        assert split, name


@pytest.mark.parametrize("masked", [False, True])
def test_multihead_attention_splits_through_both_front_ends(masked: bool) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 5, 4, dtype=torch.double)
    mask = None
    if masked:  # every sample keeps its first key
        mask = torch.rand(7, 5) < 0.4
        mask[:, 0] = False
    assert _parity(_Attention, (x, mask) if masked else (x,), f"mha masked={masked}")


def test_top_k_routing_splits_through_both_front_ends() -> None:
    torch.manual_seed(1)
    assert _parity(_TopKRouting, (torch.randn(7, 4, dtype=torch.double),), "top-k")


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(**tom.EQUATIONS)
def test_einsum_splits_alike_when_each_sample_keeps_its_own_letter(perm, rep, rep_len, out,
                                                                   out_len):
    """test_output_merge's einsum property through both front ends."""
    equation, out_term = tom.einsum_equation(perm, rep, rep_len, out, out_len)
    x = torch.randn(7, 4, dtype=torch.double)
    split = _parity(lambda: tom._Einsum(list(perm), equation), (x,), equation)
    assert split == ("b" in out_term), equation

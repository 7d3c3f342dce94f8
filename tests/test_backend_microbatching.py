"""``torch.compile(backend="roundpipe")`` splits calls into the microbatches asked for where
the batching proof (``passes/output_merge.py``, on the Dynamo graph lowered to ATen ops
by ``passes/batching.py``) proves it exact (``nn.MultiheadAttention`` included), and says so in
one warning line, naming the op, where it cannot."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from roundpipe import backend as rb
from roundpipe.passes.batching import BatchSplit, analyze_batching
from roundpipe.passes.dynamo import from_dynamo


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    rb.reset()
    yield
    torch._dynamo.reset()


class Attention(nn.Module):
    """Linear -> nn.MultiheadAttention (batch_first, optional key padding mask) -> Linear."""

    def __init__(self, need_weights: bool = False, batch_first: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.out = nn.Linear(8, 8)
        self.need_weights = need_weights

    def forward(self, x, mask=None):
        h = self.inp(x)
        a, w = self.att(h, h, h, key_padding_mask=mask, need_weights=self.need_weights)
        y = self.out(torch.tanh(a))
        return (y, w) if self.need_weights else y


def _batch(masked: bool):
    torch.manual_seed(1)
    x = torch.randn(6, 5, 8, dtype=torch.float64)
    mask = None
    if masked:  # every sample keeps at least its first key
        mask = torch.rand(6, 5) < 0.4
        mask[:, 0] = False
    return x, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_is_split_into_the_microbatches_asked_for(masked, need_weights,
                                                                      caplog):
    """nn.MultiheadAttention ran as 1 microbatch of the 3 asked for ('does not know whether
    it keeps samples apart'); it now splits, outputs and gradients equal eager on the
    whole batch (float64)."""
    torch.manual_seed(0)
    model = Attention(need_weights).double()
    eager = Attention(need_weights).double()
    eager.load_state_dict(model.state_dict())
    x, mask = _batch(masked)
    cmodel = torch.compile(model, backend="roundpipe",
                           options={"devices": ["cpu"] * 3, "num_microbatch": 3})
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        got = cmodel(x, mask)
    want = eager(x, mask)
    plans = rb.plans()
    assert any("microbatches: 3" in n for p in plans for n in p.notes), \
        [p.notes for p in plans]
    assert not [r for r in caplog.records if "microbatch" in r.getMessage()]
    got, want = (got if need_weights else (got,)), (want if need_weights else (want,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    (sum((g * torch.arange(g.numel(), dtype=g.dtype).view_as(g).cos()).sum() for g in got)
     ).backward()
    (sum((w * torch.arange(w.numel(), dtype=w.dtype).view_as(w).cos()).sum() for w in want)
     ).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=name)


def _capture(model: nn.Module, *args, dynamic: bool | None = None) -> object:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(from_dynamo(gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=backend, dynamic=dynamic)(*args)
    return graphs[0]


def test_multihead_attention_proof_refuses_what_mixes_samples():
    """The rule is sound, not permissive: a sequence-first input split along its leading
    (sequence) dimension, or a key padding mask that is not split with the query (a
    module-held mask, replicated), keep the call whole."""
    torch.manual_seed(0)
    x, mask = _batch(True)
    seq_first = Attention(batch_first=False).double()
    reason = analyze_batching(_capture(seq_first, x.transpose(0, 1).contiguous()))
    assert isinstance(reason, str) and "attends across the batch" in reason \
        and " in att " in reason, reason

    class HeldMask(Attention):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", mask.clone())

        def forward(self, x):
            return super().forward(x, self.mask)

    reason = analyze_batching(_capture(HeldMask().double(), x))
    assert isinstance(reason, str) and "in module 'att'" in reason, reason
    # The same model with the mask passed along with the batch is proven.
    split = analyze_batching(_capture(Attention().double(), x, mask))
    assert isinstance(split, BatchSplit) and split.outputs == (0,), split


class Gathers(nn.Module):
    """torch.take reads elements by flat index: across samples, so no split is proven."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return self.fc2(torch.take(h, torch.tensor([0, 5, 7])).expand(x.shape[0], 3)
                        .repeat(1, 2)[:, :4])


def test_a_call_not_split_as_asked_is_one_warning_naming_the_op(caplog):
    """Before, the reason was only in plan.notes and the call silently ran as 1
    microbatch; now one warning line names the op and the microbatches used."""
    model = Gathers()
    x = torch.randn(6, 4)
    cmodel = torch.compile(model, backend="roundpipe",
                           options={"devices": ["cpu"] * 2, "num_microbatch": 3})
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        torch.testing.assert_close(cmodel(x), model(x))
    lines = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.WARNING and r.name.startswith("roundpipe")]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]
    assert "1 microbatch, not the 3 asked for" in lines[0] and "take" in lines[0], lines[0]


class DropoutAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.5)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.att(h, h, h, need_weights=False)
        return self.out(a)


@pytest.mark.parametrize("front_end", ["backend", "pipe"])
def test_multihead_attention_dropout_is_replayed_in_recompute(front_end):
    """The backend's recompute of nn.MultiheadAttention(dropout=0.5) drew a new mask
    (F.multi_head_attention_forward was not marked random), so out_proj's gradient did
    not belong to the forward's output: 2.7 off.  The gradient is checked against the
    forward's own values, recovered from the output through the invertible linears."""
    torch.manual_seed(0)
    model = DropoutAttention().double()
    x = torch.randn(6, 5, 8, dtype=torch.float64)
    if front_end == "backend":
        run = torch.compile(model, backend="roundpipe",
                            options={"devices": ["cpu"] * 3, "num_microbatch": 1})
        y = run(x)
        stages = rb.plans()[-1].stages
    else:
        from roundpipe import RoundPipe, RoundPipeRunConfig
        pipe = RoundPipe(model, devices=["cpu"] * 3, optim_dtype=None,
                         model_run_config=RoundPipeRunConfig(num_microbatch=1))
        y = pipe(x)
        stages = pipe.plan.stages
    assert any(s.kind == "bwd" and s.units[0] <= 1 < s.units[1] for s in stages)  # recomputed
    c = torch.randn_like(y)
    (y * c).sum().backward()
    grad = model.att.out_proj.weight.grad
    if front_end == "pipe":
        grad = dict(pipe.optim_named_parameters())["att.out_proj.weight"].grad
        pipe.close()
    W, b = model.out.weight.detach(), model.out.bias.detach()
    Wo, bo = model.att.out_proj.weight.detach(), model.att.out_proj.bias.detach()
    att = torch.linalg.solve(W, (y.detach() - b).reshape(-1, 8).T).T
    before_out_proj = torch.linalg.solve(Wo, (att - bo).T).T
    want = (c.reshape(-1, 8) @ W).T @ before_out_proj
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-9)


class _Scalar(nn.Module):
    """A linear layer, then a scalar made from sums and means over the batch."""

    def __init__(self, reduce) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(torch.tanh(self.fc(x)), x.shape[0])


SCALARS = {  # name -> (reduce(h, batch size), merge rule or None: one microbatch)
    "sum": (lambda h, b: h.sum(), "sum"),
    "mean_times_half": (lambda h, b: h.mean() * 0.5, "mean"),
    "sum_over_batch_size": (lambda h, b: h.sum() / b, "mean"),
    "mean_times_batch_size": (lambda h, b: h.mean() * (2 * b), "sum"),
    "mean_minus_mean": (lambda h, b: h.mean() - h.pow(2).mean(), "mean"),
    "mse_mean": (lambda h, b: F.mse_loss(h, torch.zeros_like(h)), "mean"),
    "sum_plus_mean": (lambda h, b: h.sum() + h.mean(), None),
    "one_over_sum": (lambda h, b: 1.0 / h.sum(), None),
    "sum_over_batch_size_plus_one": (lambda h, b: h.sum() / (b + 1), None),
    "squared_mean": (lambda h, b: h.mean() ** 2, None),
    "sum_as_int": (lambda h, b: (h.sum() * 100).long(), None),
}


@pytest.mark.parametrize("name", sorted(SCALARS))
def test_scalars_merge_only_when_adding_or_averaging_is_exact(name):
    """Sums and means over the batch, through arithmetic that keeps them sums or means
    (a replicated factor, a batch-size divisor), merge by adding or averaging; any other
    arithmetic (a square, a reciprocal, a sum of a sum and a mean, an integer cast)
    keeps the call whole.  Checked against eager when split."""
    reduce, rule = SCALARS[name]
    torch.manual_seed(0)
    x = torch.randn(7, 4, dtype=torch.float64)
    model = _Scalar(reduce).double()
    split = analyze_batching(_capture(model, x, dynamic=True))
    if rule is None:
        assert isinstance(split, str), (name, split)
        return
    assert isinstance(split, BatchSplit) and split.outputs == (rule,), (name, split)
    torch._dynamo.reset()
    got = torch.compile(model, backend="roundpipe", dynamic=True,
                        options={"devices": ["cpu"] * 2, "num_microbatch": 3})(x)
    assert rb.plans()[-1].num_microbatch == 3
    torch.testing.assert_close(got, model(x), rtol=1e-10, atol=1e-10)

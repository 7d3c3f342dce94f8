"""Tests for roundpipe.passes.cost: FLOPs, bytes and cut sizes checked against hand
computations (from the layer shapes) or eager PyTorch, and measured times replacing the
estimates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compiled import compile_capturing, compiled
from roundpipe.compiler import PlanOptions, make_plan
from roundpipe.passes.cost import DeviceModel, estimate_costs, with_measured_times

CPU_MODEL = DeviceModel.for_device("cpu")


def _report(c, device_model=CPU_MODEL, scale=1.0):
    """Costs of the whole example (scale 1), not per microbatch."""
    return estimate_costs(c.traced, c.layers, c.program, device_model, scale=scale)


def _linear_of(model, unit_name):
    return model[int(unit_name)]


def test_linear_flops_are_2_batch_in_out():
    """Each MLP unit is one nn.Linear (plus a free activation): 2 * B * in * out FLOPs."""
    c = compiled("mlp")
    (x,) = c.args
    batch = x.shape[0]
    report = _report(c)
    for unit, cost in zip(c.plan.units, report.units):
        lin = _linear_of(c.model, unit.name)
        assert isinstance(lin, nn.Linear)
        assert cost.fwd_flops == 2 * batch * lin.in_features * lin.out_features


def test_costs_are_per_microbatch_when_the_example_is_a_batch():
    """compile_model divides activation-sized costs by num_microbatch (B = 8, 4 microbatches
    of 2)."""
    base = compiled("mlp")
    c = compile_capturing(base.model, base.args, base.kwargs, num_devices=1,
                          num_microbatch=4)
    batch = base.args[0].shape[0]
    micro = batch // 4
    for unit, cost in zip(c.plan.units, c.plan.costs):
        lin = _linear_of(c.model, unit.name)
        assert cost.fwd_flops == 2 * micro * lin.in_features * lin.out_features
        assert cost.output_bytes == micro * lin.out_features * 4  # float32 activation
    # With example_is_microbatch the example itself is one microbatch: no scaling.
    c1 = compile_capturing(base.model, base.args, base.kwargs, num_devices=1,
                           num_microbatch=4, example_is_microbatch=True)
    lin = base.model[0]
    assert c1.plan.costs[0].fwd_flops == 2 * batch * lin.in_features * lin.out_features


def test_attention_flops_are_counted():
    """scaled_dot_product_attention on CPU tensors (the fake tensors of the cost pass) must
    count its two batched matmuls, 4 * B * H * T * T * head_dim, on top of the qkv Linear."""

    class Attn(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d, bias=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(
                2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a.transpose(1, 2).reshape(B, T, C)

    B, T, d, heads = 2, 8, 16, 2
    torch.manual_seed(0)
    model = nn.Sequential(Attn(d, heads), nn.Linear(d, 2))
    c = compile_capturing(model, (torch.randn(B, T, d),), {}, num_devices=1)
    assert c.traced.method == "export" and c.plan.units[0].name == "0"
    report = _report(c)
    qkv_flops = 2 * B * T * d * 3 * d
    attention_flops = 4 * B * heads * T * T * (d // heads)
    assert report.units[0].fwd_flops == qkv_flops + attention_flops


def test_embedding_only_unit_has_no_flops_but_moves_bytes():
    """FlopCounterMode counts 0 for embedding lookups; the unit's cost comes from bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4))
    idx = torch.randint(0, 100, (8, 5))
    c = compile_capturing(model, (idx,), {}, num_devices=1)
    assert [u.name for u in c.plan.units] == ["0", "1"]
    cost = _report(c).units[0]
    assert cost.fwd_flops == 0
    looked_up = 8 * 5 * 16 * 4  # the gathered rows, float32
    assert cost.fwd_bytes >= looked_up
    assert cost.fwd_time_s > 0
    assert cost.param_bytes == 100 * 16 * 4
    # The same holds for the GPT's token embedding.
    gpt = compiled("gpt")
    wte = _report(gpt).units[0]
    assert gpt.plan.units[0].name == "wte"
    assert wte.fwd_flops == 0 and wte.fwd_bytes > 0


def test_time_is_the_larger_of_compute_and_memory_time():
    """With no launch overhead, a unit's forward time is max(flops / peak, bytes / bw) and
    backward is twice forward."""
    c = compiled("mlp")
    compute_bound = DeviceModel("flops", flops_per_s=1.0, bytes_per_s=1e30,
                                link_bytes_per_s=1.0, launch_s=0.0)
    memory_bound = DeviceModel("bytes", flops_per_s=1e30, bytes_per_s=1.0,
                               link_bytes_per_s=1.0, launch_s=0.0)
    for cost in _report(c, compute_bound).units:
        assert cost.fwd_time_s == pytest.approx(cost.fwd_flops)
        assert cost.bwd_time_s == pytest.approx(2 * cost.fwd_time_s)
    for cost in _report(c, memory_bound).units:
        assert cost.fwd_time_s == pytest.approx(cost.fwd_bytes)


def test_mlp_cut_bytes_equal_the_activation_crossing_each_cut():
    """Cut c (before unit c) carries exactly the activation eager PyTorch produces there:
    the input before unit 0, each block's (B, 32) output in between, the (B, 4) output at
    the end."""
    c = compiled("mlp")
    (x,) = c.args
    report = _report(c)
    # Eager reference: the tensor that flows from model[: 2 * i] into unit i.
    with torch.no_grad():
        crossing = [c.model[: 2 * i](x) for i in range(len(c.plan.units))] + [c.model(x)]
    expected = [t.numel() * t.element_size() for t in crossing]
    batch = x.shape[0]
    assert expected == [batch * 16 * 4, batch * 32 * 4, batch * 32 * 4, batch * 32 * 4,
                        batch * 4 * 4]  # the same by hand: shapes times 4 bytes (float32)
    assert list(report.cut_bytes) == expected
    assert [u.output_bytes for u in report.units] == expected[1:]
    assert report.crossing(1, 3) == (expected[1], expected[3])
    assert report.crossing(0, 4) == (expected[0], expected[4])


def test_values_used_by_later_units_count_at_every_cut_they_cross():
    """GPT's attention mask is built in the prologue and read by every block: it is live
    across every cut between them."""
    c = compiled("gpt")
    report = _report(c)
    # Values read by every block: the mask (built after wpe) and the batch/sequence sizes
    # (Python ints, 0 bytes).
    shared = [v for v in report.values.values() if v.use_units[:4] == (2, 3, 4, 5)]
    tensors = [v for v in shared if v.nbytes > 0]
    assert len(tensors) == 1
    mask = tensors[0]
    assert mask.def_unit == 1 and mask.use_units == (2, 3, 4, 5)
    # bool (T, T) after broadcasting with (B, 1, 1, T): B * T * T bytes
    B, T = c.args[0].shape
    assert mask.nbytes == B * T * T
    hidden = B * T * 32 * 4
    for cut in (3, 4, 5):  # between blocks: the hidden state and the mask
        assert report.cut_bytes[cut] == hidden + mask.nbytes


class _Pair(nn.Module):
    """Embedding and output projection sharing one weight, in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 10, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, idx):
        return self.proj(self.emb(idx))


def test_tied_weight_bytes_count_once_per_unit():
    torch.manual_seed(0)
    model = nn.Sequential(_Pair(), nn.Linear(10, 2))
    c = compile_capturing(model, (torch.randint(0, 10, (4, 3)),), {}, num_devices=1)
    pair = c.plan.units[0]
    assert pair.name == "0"
    weight_bytes = 10 * 6 * 4
    program_unit = c.plan.program.units[0]
    assert len(program_unit.state) == 1  # read twice, passed once
    assert c.plan.costs[0].param_bytes == weight_bytes
    assert c.plan.costs[0].trainable_bytes == weight_bytes


def test_gpt_tied_weight_counts_in_each_unit_and_once_per_stage():
    """wte and head each read the tied weight (so each unit counts it), but a stage holding
    both uploads it once."""
    c = compiled("gpt")
    names = [u.name for u in c.plan.units]
    tied_bytes = c.model.wte.weight.numel() * c.model.wte.weight.element_size()
    assert c.plan.costs[names.index("wte")].param_bytes == tied_bytes
    assert c.plan.costs[names.index("head")].param_bytes == tied_bytes
    one_stage = make_plan(c.program, c.plan.units, c.report,
                          PlanOptions(num_devices=1, num_microbatch=2, device_model=CPU_MODEL,
                                      num_stages=1))
    assert len(one_stage.stages) == 1
    all_params = sum(p.numel() * p.element_size() for p in c.model.parameters())
    assert one_stage.stages[0].param_bytes == all_params


def test_with_measured_times_replaces_estimates():
    c = compiled("mlp")
    costs = c.plan.costs
    measured = with_measured_times(costs, {0: 0.5, 2: 0.25}, {2: 1.0})
    assert measured[0].fwd_s == 0.5 and measured[0].bwd_s == costs[0].bwd_time_s
    assert measured[1].fwd_s == costs[1].fwd_time_s and measured[1].measured_fwd_s is None
    assert measured[2].fwd_s == 0.25 and measured[2].bwd_s == 1.0
    # Estimates are kept alongside (only the effective times change).
    assert [m.fwd_time_s for m in measured] == [e.fwd_time_s for e in costs]
    # The partitioner then balances measured times: stage times are their sums.
    report = dataclasses.replace(c.report, units=measured)
    plan = make_plan(c.program, c.plan.units, report,
                     PlanOptions(num_devices=2, num_microbatch=3, device_model=CPU_MODEL))
    for stage in plan.stages:
        units = measured[stage.units[0]:stage.units[1]]
        if stage.kind == "fwd":
            expected = sum(u.fwd_s for u in units)
        else:
            expected = sum(u.fwd_s + u.bwd_s for u in units)
        assert stage.est_time_s == pytest.approx(expected)
    # Unit 2 now costs 1.25 s forward + backward wherever it runs (the fused or a
    # backward stage), which bounds the step from below; the plan reaches that bound, and
    # only the stage holding unit 2 is labelled the bottleneck.
    assert max(s.est_time_s for s in plan.stages) == pytest.approx(1.25, rel=1e-3)
    for stage in plan.stages:
        holds_unit_2 = stage.units[0] <= 2 < stage.units[1] and stage.kind != "fwd"
        assert (stage.reason == "bottleneck") == holds_unit_2, stage

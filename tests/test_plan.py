"""Tests for the stage plan (roundpipe.compiler.make_plan / compile_model and
roundpipe.plan): structural invariants for every model and device count, the memory cap,
rendering, and the public compile entry point."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
import torch
import torch.nn as nn

import models
import roundpipe
from compiled import compiled
from roundpipe import RoundPipe
from roundpipe.compiler import PlanOptions, analyze, compile_model, make_plan
from roundpipe.errors import ConfigError, PartitionError
from roundpipe.passes.cost import DeviceModel
from roundpipe.plan import StagePlan, compact_unit_names, fit_unit_names, short_unit_names

CPU_MODEL = DeviceModel.for_device("cpu")
ALL_MODELS = list(models.ALL) + ["const_net", "grouped_net"]
HEADERS = ["stage", "kind", "units", "params (MiB)", "est. time", "act in/out (MiB)",
           "recompute"]


def _plan(name: str, devices: int, **options) -> StagePlan:
    """Re-partition a cached compile for another device count (no retrace)."""
    c = compiled(name)
    return make_plan(c.program, c.plan.units, c.report,
                     PlanOptions(num_devices=devices, num_microbatch=devices + 1,
                                 device_model=CPU_MODEL, **options))


def _bwd_memory(cost) -> int:
    """What one unit needs in a backward stage: weights, gradients, activations."""
    return cost.param_bytes + cost.trainable_bytes + cost.activation_bytes


def _largest_unit(report, devices: int, microbatches: int) -> int:
    """The most any unit needs on a device in a stage of its own, by the lifetime
    estimate, with the largest unit's weights prefetched meanwhile: the tightest cap."""
    return (max(report.memory.unit_bytes(i, num_microbatch=microbatches, num_devices=devices)
                for i in range(len(report.units)))
            + max(c.param_bytes for c in report.units))


def check_invariants(plan: StagePlan, report=None) -> None:
    n = len(plan.units)
    kinds = [s.kind for s in plan.stages]
    assert kinds.count("fused") == 1
    fused_at = kinds.index("fused")
    assert set(kinds[:fused_at]) <= {"fwd"} and set(kinds[fused_at + 1:]) <= {"bwd"}
    assert [s.index for s in plan.stages] == list(range(len(plan.stages)))
    assert len(plan.stage_modules) == len(plan.stages)
    for s in plan.stages:
        assert 0 <= s.units[0] < s.units[1] <= n, s  # non-empty ranges
    # Forward stages then the fused stage: every unit exactly once, contiguous, in order.
    forward_side = [s.units for s in plan.stages if s.kind != "bwd"]
    assert forward_side[0][0] == 0 and forward_side[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(forward_side, forward_side[1:]))
    # Backward stages: exactly the units before the fused stage, last units first.
    tail_start = plan.fused_stage.units[0]
    backward = [s.units for s in plan.backward_stages]
    if tail_start == 0:
        assert backward == [] and plan.forward_stages == ()
    else:
        assert backward[0][1] == tail_start and backward[-1][0] == 0
        assert all(later[0] == earlier[1] for later, earlier in zip(backward, backward[1:]))
    # Per-stage numbers follow from the units.
    by_name = plan.program.state_by_name()
    for s in plan.stages:
        a, b = s.units
        state = {name for u in plan.program.units[a:b] for name in u.state}
        assert s.param_bytes == sum(by_name[name].nbytes for name in state)
        costs = plan.costs[a:b]
        expected = sum(c.fwd_s if s.kind == "fwd" else c.fwd_s + c.bwd_s for c in costs)
        assert s.est_time_s == pytest.approx(expected)
        assert s.memory_bytes >= s.param_bytes
        assert s.recompute == ("none" if s.kind != "bwd" else "stage")
        if report is not None:
            assert (s.act_in_bytes, s.act_out_bytes) == report.crossing(a, b)
        # What a backward stage stashes: the values it reads that earlier units made.
        stash = plan.stash["stage"][s.index]
        if s.kind == "bwd":
            produced, read = set(), []
            for u in plan.program.units[a:b]:
                read += [v for v in u.inputs if v not in produced and v not in read]
                produced |= set(u.outputs)
            assert stash == tuple(read)
            assert set(stash) <= set(plan.stash["layer"][s.index])
            earlier = {v for u in plan.program.units[:a] for v in u.outputs}
            inputs = {v for v in plan.program.inputs.names if v is not None}
            assert set(stash) <= earlier | inputs
        else:
            assert stash == () and plan.stash["layer"][s.index] == ()


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_plan_invariants(name, devices):
    plan = _plan(name, devices)
    check_invariants(plan, compiled(name).report)
    n = len(plan.units)
    assert plan.num_devices == devices and plan.num_microbatch == devices + 1
    assert len(plan.stages) >= min(devices + 1, 2 * n - 1)
    assert len(plan.stages) != 2  # forward, fused and backward stages, or one fused stage


def test_compile_model_defaults():
    """compile_model itself: devices + 1 microbatches and (at least) devices + 1 stages."""
    c = compiled("gpt")
    check_invariants(c.plan, c.report)
    assert c.plan.num_devices == 2 and c.plan.num_microbatch == 3
    assert len(c.plan.stages) == 3


def test_single_unit_model_is_one_fused_stage():
    torch.manual_seed(0)
    plan = compile_model(nn.Linear(4, 4), (torch.randn(3, 4),), num_devices=4)
    assert [(s.kind, s.units) for s in plan.stages] == [("fused", (0, 1))]
    check_invariants(plan)


def test_exact_stage_count():
    plan = _plan("gpt", 2, num_stages=7)
    assert len(plan.stages) == 7
    check_invariants(plan)
    with pytest.raises(PartitionError, match="num_stages = 2 is impossible"):
        _plan("gpt", 2, num_stages=2)


def test_memory_cap_bounds_every_stage():
    """The tightest feasible cap (the largest unit) forces more stages than devices + 1,
    and no stage exceeds it."""
    c = compiled("gpt")
    cap = _largest_unit(c.report, 2, 3)
    plan = _plan("gpt", 2, memory_cap=cap)
    check_invariants(plan, c.report)
    assert len(plan.stages) > 3  # the uncapped plan has 3
    assert plan.device_memory_bytes <= cap
    assert plan.memory_cap == cap
    assert f"(cap {cap / 2**20:.1f} MiB)" in plan.summary()


def test_memory_cap_through_compile_model():
    base = compiled("mlp")
    cap = _largest_unit(base.report, 2, 3)
    plan = compile_model(base.model, base.args, base.kwargs, num_devices=2, memory_cap=cap)
    check_invariants(plan)
    assert plan.device_memory_bytes <= cap
    assert len(plan.stages) > 3


def test_cap_below_the_largest_unit_is_a_partition_error():
    """Two 512 x 512 Linear layers: each unit needs 1 MiB of weights + 1 MiB of gradients
    (+ activations); a 1.5 MiB cap cannot hold one.  The message gives both numbers and the
    ways out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    args = (torch.randn(6, 512),)
    uncapped = compile_model(model, args, num_devices=2)
    memory = analyze(model, args, cost_scale=1 / 3).report.memory
    alone = [memory.unit_bytes(i, num_microbatch=3, num_devices=2)
             for i in range(len(uncapped.units))]
    worst = max(range(len(alone)), key=lambda i: alone[i])
    need = alone[worst] + (512 * 512 + 512) * 4  # the next unit's weights, prefetched
    assert need > 3 * 512 * 512 * 4
    cap = 3 * 2**19  # 1.5 MiB
    with pytest.raises(PartitionError) as info:
        compile_model(model, args, num_devices=2, memory_cap=cap)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    name = uncapped.units[worst].name
    assert f"unit {name} alone needs an estimated {need} bytes ({need / 2**20:.1f} MiB)" \
        in message
    assert f"device memory cap is {cap} bytes (1.5 MiB)" in message
    assert "raise num_microbatch" in message and "recompute_grain='layer'" in message


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_invalid_num_microbatch_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="num_microbatch"):
        roundpipe.RoundPipeRunConfig(num_microbatch=bad)


def test_str_is_a_table_with_one_summary_line():
    plan = compiled("gpt").plan
    text = str(plan)
    lines = text.splitlines()
    header = lines[0]
    positions = [header.index(h) for h in HEADERS]
    assert positions == sorted(positions)  # every column, in this order
    assert set(lines[1]) <= {"-", " "}
    summary = plan.summary().splitlines()
    rows = lines[2:-len(summary)]
    assert len(rows) == len(plan.stages)
    for row, stage in zip(rows, plan.stages):
        assert row.split()[:2] == [str(stage.index), stage.kind]
        assert stage.unit_names in row
        assert f"{stage.param_bytes / 2**20:.2f}" in row
    assert lines[-len(summary):] == summary
    assert summary[0].startswith(f"{len(plan.stages)} stages (1 fwd, 1 fused, 1 bwd) over "
                                 f"{len(plan.units)} units on 2 device(s)")
    assert max(len(line) for line in lines) <= 120
    assert plan.stages[0].unit_names == "wte, wpe, h.0-1"


def test_to_dict_round_trips_through_json():
    plan = compiled("gpt").plan
    d = plan.to_dict()
    text = json.dumps(d, allow_nan=False)  # strict JSON: no NaN or Infinity
    assert json.loads(text) == d
    assert len(d["stages"]) == len(plan.stages) and len(d["units"]) == len(plan.units)
    assert d["stages"][1]["kind"] == "fused"
    assert d["stages"][0]["units"] == list(plan.stages[0].units)
    assert d["trace_method"] == "export" and d["num_devices"] == 2
    assert d["passes"][0] == "trace" and d["passes"][-1] == "codegen(stages)"


def test_stage_reasons():
    """Exactly the stages at the partition's bottleneck say so; the others say why not."""
    plan = _plan("gpt", 4)
    bottleneck = max(s.est_time_s for s in plan.stages)
    reasons = {s.reason for s in plan.stages}
    assert reasons <= {"bottleneck", "balanced", "largest tail within the bottleneck"}
    for s in plan.stages:
        if s.reason == "bottleneck":
            assert s.est_time_s == pytest.approx(bottleneck, rel=1e-6)
        else:
            assert s.est_time_s < bottleneck


def test_roundpipe_compile_returns_a_pipe_with_a_plan():
    model, args, kwargs = models.mlp()
    pipe = roundpipe.compile(model, example_args=args, devices=["cpu"] * 2)
    try:
        assert isinstance(pipe.plan, StagePlan)
        assert pipe.plan.num_devices == 2
        check_invariants(pipe.plan)
        assert [u.name for u in pipe.plan.units] == ["0", "2", "4", "6"]
    finally:
        pipe.close()


@pytest.mark.parametrize("names, expected", [
    (["wte", "wpe", "h.0", "h.1", "h.2", "ln_f"], "wte, wpe, h.0-2, ln_f"),
    (["h.9", "h.10", "h.11"], "h.9-11"),
    (["0", "2", "4", "5"], "0, 2, 4-5"),
    (["h.0", "h.1", "h.3"], "h.0-1, h.3"),
    # Names that merely end in a digit are not numbered path components.
    (["stem", "conv1", "conv2", "fc"], "stem, conv1, conv2, fc"),
    (["block", "h.0", "block#2"], "block, h.0, block#2"),
    (["a.0.b.0", "a.0.b.1", "a.1.b.0"], "a.0.b.0-1, a.1.b.0"),
])
def test_compact_unit_names(names, expected):
    assert compact_unit_names(names) == expected


def test_host_step_estimate_counts_the_bytes_of_each_configuration():
    """Host bytes per parameter per step: landing (bf16 -> fp32 .grad: 2 + 4), update
    (gradient 4 or 2 where it landed, master 4 + 4, each state 4 + 4 or 2 + 2), publish
    (fp32 -> bf16: 4 + 2); without masters no publish, and the .grad is the model's."""
    import roundpipe.optim
    from roundpipe.host_step import bytes_per_param
    p = [torch.nn.Parameter(torch.zeros(4))]
    cases = [
        (torch.optim.AdamW(p), 2, 4, 6 + 4 + 8 + 16 + 6),
        (torch.optim.AdamW(p, amsgrad=True), 2, 4, 6 + 4 + 8 + 24 + 6),
        (torch.optim.SGD(p, lr=1, momentum=0.9), 2, 4, 6 + 4 + 8 + 8 + 6),
        (torch.optim.SGD(p, lr=1), 2, 4, 6 + 4 + 8 + 6),
        (roundpipe.optim.AdamW(p), 2, 4, 2 + 8 + 16 + 6),
        (roundpipe.optim.AdamW(p, state_dtype=torch.bfloat16), 2, 4, 2 + 8 + 8 + 6),
        (roundpipe.optim.SGD(p, lr=1, momentum=0.9), 2, 4, 2 + 8 + 8 + 6),
        (torch.optim.AdamW(p), 4, None, 8 + 4 + 8 + 16),
        (None, 2, 4, 40),  # torch's AdamW assumed
    ]
    for opt, model_bytes, master_bytes, expected in cases:
        assert bytes_per_param(opt, model_bytes, master_bytes) == expected, opt
        # The weight prediction reads the kept masters and refreshes them.
        assert bytes_per_param(opt, model_bytes, master_bytes, predict=True) == \
            expected + (3 * master_bytes if master_bytes else 0), opt


def test_plan_summary_gives_the_host_step_beside_the_device_time():
    import roundpipe.optim
    from roundpipe.plan import HostStepEstimate
    model, args, kwargs = models.gpt(layers=2)
    loss_fn = lambda out, _: out["logits"].float().pow(2).mean()  # noqa: E731
    with RoundPipe(model.to(torch.bfloat16), devices=["cpu"] * 2,
                   optim_dtype=torch.float32, predict_weights=False) as pipe:
        pipe.forward_backward(input_args=args, input_kwargs=kwargs, loss_fn=loss_fn)
        assumed = pipe.plan.host_step
        assert assumed.assumed and assumed.bytes_per_param == 40
        n = sum(m.numel() for m in pipe.optim_parameters())
        assert assumed.params == n
        assert assumed.seconds == pytest.approx(n * 40 / assumed.bandwidth)
        assert assumed.device_seconds == pipe.plan.est_step_time_s
        opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        bound = pipe.plan.host_step
        assert not bound.assumed and bound.optimizer == "roundpipe.optim.AdamW"
        assert bound.bytes_per_param == 32
        assert "host step" in str(pipe.plan) and str(bound) in pipe.plan.summary()
        assert pipe.plan.to_dict()["host_step"]["bytes_per_param"] == 32
        assert pipe.plan is pipe.plan  # one object until the plan or optimizer changes
        pipe.predict_weights = True  # the weight prediction's 3 fp32 passes on top
        assert pipe.host_step_estimate().bytes_per_param == 32 + 12
        del opt
    slow = HostStepEstimate("AdamW", False, 10**9, 40, 20e9, 2.0, 1.0)
    fast = HostStepEstimate("AdamW", False, 10**9, 40, 20e9, 2.0, 3.0)
    assert slow.host_bound and "bottleneck" in str(slow)
    assert not fast.host_bound and "hidden" in str(fast)


class _HFStyle(nn.Module):
    """Unit names as Hugging Face's decoders have them (model.embed_tokens,
    model.layers.N, model.norm, lm_head)."""

    def __init__(self, layers: int = 8) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, 8)
        self.model.rotary_emb = nn.Embedding(16, 8)
        self.model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.model.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16)

    def forward(self, ids):
        h = self.model.embed_tokens(ids) + self.model.rotary_emb(ids)
        for layer in self.model.layers:
            h = h + torch.tanh(layer(h))
        return self.lm_head(self.model.norm(h))


def test_hugging_face_unit_names_stay_readable_in_the_table():
    """A stage's units used to be cut mid-name ('model.embed_tokens, ... (1 more),
    model.l...'); now single modules go by their short names before a layer range is
    touched, and nothing is cut mid-name while whole items can be left out."""
    torch.manual_seed(0)
    pipe = roundpipe.compile(_HFStyle(), example_args=(torch.randint(0, 16, (6, 4)),),
                             devices=["cpu"] * 2, num_stages=3)
    rows = pipe.plan.table_rows()
    first = rows[0][2]
    assert first.startswith("embed_tokens, rotary_emb, ") and "layers.0-" in first, rows
    assert all(len(r[2]) <= 41 for r in rows)
    assert all(not r[2].endswith("...") for r in rows), rows
    assert max(len(line) for line in str(pipe.plan).splitlines()) <= 120
    pipe.close()


@pytest.mark.parametrize("names, width, expected", [
    (["model.embed_tokens", "model.rotary_emb"] + [f"model.layers.{i}" for i in range(4)],
     44, "embed_tokens, rotary_emb, model.layers.0-3"),
    (["model.embed_tokens", "model.rotary_emb"] + [f"model.layers.{i}" for i in range(4)],
     36, "embed_tokens, rotary_emb, layers.0-3"),
    (["encoder.block.4", "encoder.block.5", "encoder.final_layer_norm", "decoder.block.0"],
     60, "encoder.block.4-5, encoder.final_layer_norm, decoder.block.0"),
    (["encoder.block.4", "encoder.block.5", "encoder.final_layer_norm", "decoder.block.0"],
     52, "encoder.block.4-5, final_layer_norm, decoder.block.0"),
    ([f"x.{n}" for n in ("alpha", "beta", "gamma", "delta", "epsilon")], 28,
     "alpha, ... (3 more), epsilon"),
])
def test_fit_unit_names(names, width, expected):
    short = short_unit_names(names + ["decoder.final_layer_norm_2"])
    got = fit_unit_names(names, short, width)
    assert got == expected and len(got) <= width


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["model", "encoder", "decoder", "layers", "h", "block",
                                 "0", "1", "2", "norm", "embed"]),
                min_size=1, max_size=4).map(".".join).filter(
                    lambda n: not n.split(".")[-1].isdigit() or len(n.split(".")) > 1),
       st.integers(12, 60))
def test_short_unit_names_are_distinct_ends(name, width):
    names = sorted({name, "model." + name, name + ".x", "lm_head"})
    short = short_unit_names(names)
    assert len(set(short.values())) == len(names)
    for full, s in short.items():
        assert full == s or full.endswith("." + s)
        assert full == s or not all(p.isdigit() for p in s.split("."))

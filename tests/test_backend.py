"""``torch.compile(model, backend="roundpipe")``: training with the user's own loop equals
eager PyTorch (tied weights, graph breaks, dynamic shapes, microbatching), registration,
options, the microbatching proof, keyed random ops in recompute, and placement."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
import roundpipe
from roundpipe import backend as rb
from roundpipe.errors import ConfigError, InputError, RoundPipeError, UnknownConfigFieldError
from roundpipe.passes.batching import BatchSplit, analyze_batching
from roundpipe.passes.dynamo import from_dynamo
from roundpipe.passes.layers import find_unit_roots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = {"devices": ["cpu"] * 3}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    rb.reset()
    yield
    torch._dynamo.reset()


# --- models ----------------------------------------------------------------------------------

class BreakInBlock(models.Block):
    """A graph break inside the block: Dynamo compiles Block.forward once, per block."""

    def forward(self, x, mask):
        x = x * 1.0
        torch._dynamo.graph_break()
        return super().forward(x, mask)


def gpt_break_in_loop(layers: int = 4) -> models.GPT:
    torch.manual_seed(0)
    model = models.GPT(layers=layers)
    model.h = nn.ModuleList([BreakInBlock(32, 2, 0.0) for _ in range(layers)])
    return model


class GPTBreakBetween(models.GPT):
    """A graph break between blocks 1 and 2 (outside any loop): two graphs."""

    def forward(self, idx, attention_mask=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        for block in self.h[:2]:
            x = block(x, mask)
        torch._dynamo.graph_break()
        for block in self.h[2:]:
            x = block(x, mask)
        return {"logits": self.head(self.ln_f(x)), "hidden": x}


def gpt_break_between() -> models.GPT:
    torch.manual_seed(0)
    return GPTBreakBetween(layers=4)


def gpt_plain() -> models.GPT:
    return models.gpt()[0]


def gpt_small() -> models.GPT:
    """Two blocks: where the number of blocks is not what a test checks (each one is a unit
    that every compile traces and plans)."""
    return models.gpt(layers=2)[0]


def mlp() -> nn.Module:
    return models.mlp()[0]


def _gpt_batch(step: int, batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(step)
    return ((torch.randint(0, 64, (batch, seq), generator=g),),
            torch.randint(0, 64, (batch, seq), generator=g))


def _mlp_batch(step: int, batch: int = 8):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch, 16, generator=g),), torch.randn(batch, 4, generator=g)


def _train(make, batches, loss_fn, *, options=None, dynamic=None, steps=3):
    """3 SGD steps with torch.compile(backend="roundpipe") and eagerly, side by side."""
    model = make()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="roundpipe", options=options or DEVICES,
                             dynamic=dynamic)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(steps):
        args, label = batches(step)
        loss = loss_fn(compiled(*args), label)
        loss.backward()
        eager_loss = loss_fn(eager(*args), label)
        eager_loss.backward()
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None, f"{name} got no gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        opt.step()
        opt.zero_grad()
        eager_opt.step()
        eager_opt.zero_grad()
    for (name, p), q in zip(model.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    return model


def _mse(out, y):
    return F.mse_loss(out, y)


# --- training equals eager -------------------------------------------------------------------

def test_a_layer_applied_several_times_is_a_unit_per_application():
    """Dynamo numbers repeated calls of a module like export does (``path@N``)."""
    from test_layers import _SharedLayer
    _train(_SharedLayer, lambda step: ((torch.randn(12, 8),), torch.randn(12, 3)), _mse)
    (plan,) = rb.plans()
    assert [u.name for u in plan.units] == [
        "embed", "groups.0", "groups.0#2", "groups.0#3", "groups.0#4", "mid", "other",
        "other#2", "head"]


def test_gpt_with_tied_embeddings_trains_like_eager():
    model = _train(gpt_plain, _gpt_batch, models.lm_loss)
    assert model.head.weight is model.wte.weight
    (plan,) = rb.plans()
    assert [u.name for u in plan.units] == ["wte", "wpe", "h.0", "h.1", "h.2", "h.3", "ln_f",
                                           "head"]
    assert plan.num_devices == 3 and len(plan.stages) >= 4
    # The tied weight is one state slot read by two units (both gradients reach it).
    tied = [s for s in plan.program.state if s.fqn == "wte.weight"]
    assert len(tied) == 1 and len(tied[0].units) == 2


def test_mlp_trains_like_eager_with_microbatches():
    _train(mlp, _mlp_batch, _mse)
    (plan,) = rb.plans()
    assert plan.num_microbatch == 4  # devices + 1: the MLP splits exactly
    assert "split inputs" in plan.notes[-1]


def test_weights_are_streamed_to_every_device():
    model = mlp()
    opts = {"devices": ["cpu"] * 2, "num_microbatch": 2}
    compiled = torch.compile(model, backend="roundpipe", options=opts)
    compiled(torch.randn(4, 16)).sum().backward()
    backend = rb.backend_for(opts)
    stats = backend.stats()  # of the backward call
    (plan,) = [p for p in backend.plans if p.stages]
    for d in stats.devices:  # each job uploads its stage's weights once, on its device
        assert d.uploaded["weights"] == sum(plan.stages[r.stage].param_bytes
                                            for r in stats.timeline if r.device == d.name) > 0
    assert {r.kind for r in stats.timeline} == {"bwd"}
    assert {r.device for r in stats.timeline} == {"cpu:0", "cpu:1"}


def test_recompute_grain_layer_trains_like_eager():
    _train(gpt_small, _gpt_batch, models.lm_loss,
           options={"devices": ["cpu"] * 2, "recompute_grain": "layer"}, steps=2)


# --- graph breaks ------------------------------------------------------------------------------

def test_graph_break_inside_the_block_loop_trains_like_eager():
    _train(gpt_break_in_loop, _gpt_batch, models.lm_loss)
    # Only Block.forward (after the break) is compiled, once, and reused for all blocks.
    assert len(rb.plans()) == 1
    placement = rb.backend_for(DEVICES).placement()
    # Each block's weights are a separate entry, and consecutive blocks continue the
    # round robin instead of all starting on device 0.
    assert {"ln1", "ln1#2", "ln1#3", "ln1#4"} <= set(placement)
    starts = [placement[k] for k in ("ln1", "ln1#2", "ln1#3", "ln1#4")]
    assert len(set(starts)) == 3


def test_graph_break_between_blocks_trains_like_eager_and_keeps_placement():
    model = _train(gpt_break_between, _gpt_batch, models.lm_loss)
    first, second = rb.plans()
    assert [u.name for u in first.units] == ["wte", "wpe", "h.0", "h.1"]
    assert [u.name for u in second.units] == ["h.2", "h.3", "ln_f", "head"]
    backend = rb.backend_for(DEVICES)
    before = backend.placement()
    # The second graph starts on the device after the first graph's last forward job.
    first_fwd = len(first.forward_stages) + 1
    assert before["h.2"] == (before["wte"] + first_fwd) % 3
    # A new sequence length recompiles both graphs; every layer stays where it was.
    compiled = torch.compile(model, backend="roundpipe", options=DEVICES)
    (idx,), labels = _gpt_batch(5, seq=6)
    models.lm_loss(compiled(idx), labels).backward()
    assert len(rb.plans()) == 4
    assert backend.placement() == before


# --- dynamic shapes ----------------------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [None, True])
def test_new_sequence_length_recompiles_or_reuses_correctly(dynamic):
    lengths = (8, 6, 5)

    def batches(step):
        return _gpt_batch(step, seq=lengths[step])
    _train(gpt_small, batches, models.lm_loss, dynamic=dynamic)
    plans = rb.plans()
    if dynamic:  # one dynamic graph, reused for every length, split into microbatches
        assert len(plans) == 1 and plans[0].num_microbatch == 4
    else:  # static, then one recompile with a dynamic sequence length
        assert len(plans) == 2


# --- options and registration --------------------------------------------------------------

def test_unknown_option_is_a_clear_config_error():
    compiled = torch.compile(mlp(), backend="roundpipe", options={"num_microbatches": 2})
    with pytest.raises(UnknownConfigFieldError) as info:
        compiled(torch.randn(4, 16))
    message = str(info.value)
    assert "'num_microbatches' (did you mean 'num_microbatch'?)" in message
    for option in ("num_microbatch", "devices", "recompute_grain", "memory_fraction"):
        assert option in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, RoundPipeError)


def test_invalid_option_values_are_config_errors():
    with pytest.raises(ConfigError, match="num_microbatch"):
        rb.RoundPipeBackend(num_microbatch=0)
    with pytest.raises(ConfigError, match="recompute_grain"):
        rb.RoundPipeBackend(recompute_grain="block")
    with pytest.raises(UnknownConfigFieldError, match="valid options"):
        rb.RoundPipeBackend(microbatches=2)


def test_backend_instance_can_be_passed_directly():
    backend = rb.RoundPipeBackend(devices=["cpu"] * 2, num_microbatch=2)
    model = mlp()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 16)
    torch.compile(model, backend=backend)(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert len(backend.plans) == 1 and backend.plans[0].num_microbatch == 2


def test_registered_with_dynamo():
    assert "roundpipe" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("roundpipe") is rb.roundpipe_backend


# What a fresh interpreter does, in three scenarios: one real interpreter (nothing of this
# process is inherited) imports torch alone, then forks a child per scenario, so that each
# scenario starts from torch without roundpipe, as a new interpreter does, and torch is
# imported once instead of three times (a launch costs ~3 s of CPU).  Each child prints
# its scenario's result or its traceback, and exits.
_FRESH_SCENARIOS = {
    # torch.compile(backend="roundpipe") finds the backend by its entry point
    "entry_point": """
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2))
        x = torch.randn(6, 4)
        imported_before = "roundpipe" in sys.modules
        compiled = torch.compile(model, backend="roundpipe",
                                 options={"devices": ["cpu"] * 2})
        out = compiled(x)
        out.sum().backward()
        grad = model[0].weight.grad.clone()
        model.zero_grad()
        model(x).sum().backward()
        import roundpipe.backend
        result = {"imported_before": imported_before,
                  "same_output": torch.allclose(out, model(x)),
                  "same_grad": torch.allclose(grad, model[0].weight.grad),
                  "plans": len(roundpipe.backend.plans())}
    """,
    # installed: import roundpipe leaves Dynamo unimported; hidden: it registers by hand
    "installed": """
        import roundpipe
        dynamo_imported = "torch._dynamo" in sys.modules
        from torch._dynamo.backends import registry
        result = {"dynamo_imported": dynamo_imported,
                  "registered": "roundpipe" in registry._COMPILER_FNS}
    """,
    "hide": """
        real = importlib.metadata.entry_points
        importlib.metadata.entry_points = lambda **kw: (  # a source tree never pip-installed
            [] if kw.get("group") == "torch_dynamo_backends" else real(**kw))
        import roundpipe
        dynamo_imported = "torch._dynamo" in sys.modules
        from torch._dynamo.backends import registry
        result = {"dynamo_imported": dynamo_imported,
                  "registered": "roundpipe" in registry._COMPILER_FNS}
    """,
}

_FRESH_MAIN = """
import importlib.metadata, json, os, sys, traceback
import torch
assert "roundpipe" not in sys.modules and "torch._dynamo" not in sys.modules
for name, code in json.loads(sys.argv[1]).items():
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            scope = {"importlib": importlib, "json": json, "sys": sys, "torch": torch}
            exec(code, scope)
            line = {"scenario": name, "result": scope["result"]}
        except BaseException:
            line = {"scenario": name, "error": traceback.format_exc()}
        print(json.dumps(line), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        print(json.dumps({"scenario": name, "error": f"child exit status {status}"}),
              flush=True)
"""


@functools.cache
def _fresh_interpreter() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)  # this checkout's code, whatever is installed
    scenarios = {k: textwrap.dedent(v) for k, v in _FRESH_SCENARIOS.items()}
    proc = subprocess.run([sys.executable, "-c", _FRESH_MAIN, json.dumps(scenarios)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()
             if line.startswith('{"scenario"')]
    return {line["scenario"]: line for line in lines}


def _scenario(name: str) -> dict:
    line = _fresh_interpreter().get(name)
    assert line is not None, f"scenario {name} reported nothing"
    assert "error" not in line, line["error"][-3000:]
    return line["result"]


def test_subprocess_finds_the_backend_without_importing_roundpipe():
    installed = [ep for ep in entry_points(group="torch_dynamo_backends")
                 if ep.name == "roundpipe"]
    assert installed, ("the 'roundpipe' entry point of group torch_dynamo_backends is not "
                       "installed; run `pip install -e .` in the repository")
    assert _scenario("entry_point") == {"imported_before": False, "same_output": True,
                                        "same_grad": True, "plans": 1}


def test_plans_are_inspectable():
    compiled = torch.compile(gpt_plain(), backend="roundpipe", options=DEVICES)
    (idx,), _ = _gpt_batch(0)
    compiled(idx)
    (plan,) = roundpipe.backend.plans()
    assert isinstance(plan, roundpipe.StagePlan)
    table = str(plan)
    assert "fused" in table and "h.0" in table
    assert plan.to_dict()["trace_method"] == "dynamo"
    assert "class Stage0" in plan.stage_code(0)


# --- microbatching -----------------------------------------------------------------------------

def _capture(model, *args, dynamic=None):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(from_dynamo(gm, list(example_inputs)))
        return gm.forward
    torch.compile(model, backend=capture, dynamic=dynamic)(*args)
    return graphs


class WithLoss(nn.Module):
    """A model that computes its loss in forward (reduction chosen per instance)."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss = loss
        self.blocks = nn.ModuleList([models.ResBlock(8) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        if self.loss == "mse_mean":
            return F.mse_loss(logits, F.one_hot(y, 3).float())
        if self.loss == "ce_sum":
            return F.cross_entropy(logits, y, reduction="sum")
        if self.loss == "ce_mean":
            return F.cross_entropy(logits, y)
        if self.loss == "sum_over_batch":
            return logits.sum(0)
        raise AssertionError(self.loss)


def test_batching_proof_accepts_separable_graphs():
    split = analyze_batching(_capture(mlp(), torch.randn(8, 16))[0])
    assert isinstance(split, BatchSplit) and split.outputs == (0,) and split.batch == 8
    (dg,) = _capture(gpt_small(), *_gpt_batch(0)[0], dynamic=True)
    split = analyze_batching(dg)
    assert isinstance(split, BatchSplit), split
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    for loss, rule in (("mse_mean", "mean"), ("ce_sum", "sum")):
        split = analyze_batching(_capture(WithLoss(loss), x, y)[0])
        assert isinstance(split, BatchSplit) and split.outputs == (rule,), (loss, split)


def test_batching_proof_refuses_what_it_cannot_prove():
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    reason = analyze_batching(_capture(WithLoss("ce_mean"), x, y)[0])
    assert isinstance(reason, str) and "reduction='mean'" in reason
    reason = analyze_batching(_capture(WithLoss("sum_over_batch"), x, y)[0])
    assert isinstance(reason, str) and "reduces over the batch" in reason
    # Static shapes bake the batch size into view(4, 8, ...).
    reason = analyze_batching(_capture(gpt_small(), *_gpt_batch(0)[0])[0])
    assert isinstance(reason, str) and "view" in reason and "constant" in reason, reason
    # BatchNorm in training updates its running statistics per call.
    model, args, _ = models.bnnet()
    reason = analyze_batching(_capture(model, *args)[0])
    assert isinstance(reason, str) and "buffers" in reason

    # A tensor made inside the graph with the batch's size, broadcast against the batch.
    class PerSampleWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) * torch.arange(x.shape[0], dtype=x.dtype)[:, None]
    reason = analyze_batching(_capture(PerSampleWeight(), x)[0])
    assert isinstance(reason, str) and "broadcasts" in reason and "mul" in reason, reason


class RowOp(nn.Module):
    """An indexing op between two trainable layers."""

    def __init__(self, op) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.op = op

    def forward(self, x):
        return self.b(self.op(torch.tanh(self.a(x))))


ROW_OPS = {  # name -> (op, whether it keeps samples apart)
    "topk_scatter": (lambda h: torch.zeros_like(h).scatter(
        -1, h.topk(2, dim=-1).indices, h.topk(2, dim=-1).values), True),
    "gather_own_index": (lambda h: torch.gather(h, 1, h.argsort(1)), True),
    "sort_values": (lambda h: h.sort(1)[0] * h, True),
    "scatter_add_own": (lambda h: h.scatter_add(1, h.argsort(1), h * 2), True),
    "scatter_reduce_own": (lambda h: h.scatter_reduce(1, h.argsort(1), h, "amax"), True),
    "topk_batch": (lambda h: h.topk(2, dim=0).values.sum(0) * h, False),
    "gather_batch": (lambda h: torch.gather(h, 0, h.argsort(0)), False),
    "scatter_batch": (lambda h: torch.zeros_like(h).scatter(0, h.argsort(0), h), False),
    "gather_replicated_index": (lambda h: torch.gather(
        h, 1, torch.zeros(1, 4, dtype=torch.long)).sum() * h, False),
    "scatter_replicated_index": (lambda h: h + torch.zeros_like(h).scatter_add(
        1, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)), False),
}


@pytest.mark.parametrize("name", sorted(ROW_OPS))
def test_indexing_ops_split_only_when_rows_stay_apart(name):
    """gather / scatter / topk / sort along a feature dimension with per-sample indices
    split into microbatches and equal eager; along the batch, or with an index that is
    not per sample, the proof refuses (one microbatch, still exact)."""
    op, separable = ROW_OPS[name]
    torch.manual_seed(0)
    model = RowOp(op)
    eager = copy.deepcopy(model)
    x = torch.randn(6, 4)
    split = analyze_batching(_capture(copy.deepcopy(model), x)[0])
    assert isinstance(split, BatchSplit) == separable, split
    torch._dynamo.reset()
    out = torch.compile(model, backend="roundpipe", options=DEVICES)(x)
    out.pow(2).sum().backward()
    ref = eager(x)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert rb.plans()[-1].num_microbatch == (4 if separable else 1)


@pytest.mark.parametrize("loss", ["mse_mean", "ce_sum", "ce_mean"])
def test_losses_computed_in_the_model_merge_exactly(loss):
    torch.manual_seed(0)
    model = WithLoss(loss)
    eager = copy.deepcopy(model)
    x, y = torch.randn(7, 8), torch.randint(0, 3, (7,))  # 7 = 3 + 2 + 2 samples
    out = torch.compile(model, backend="roundpipe", options=DEVICES)(x, y)
    out.backward()
    ref = eager(x, y)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    (plan,) = rb.plans()
    assert plan.num_microbatch == (1 if loss == "ce_mean" else 4)


def test_input_gradients_for_split_and_replicated_inputs():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([models.ResBlock(4) for _ in range(2)])

        def forward(self, x, bias):
            for b in self.blocks:
                x = b(x + bias)
            return x

    torch.manual_seed(0)
    model = Scale()
    eager = copy.deepcopy(model)
    x, bias = torch.randn(5, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    x2, bias2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    out = torch.compile(model, backend="roundpipe", options=DEVICES)(x, bias)
    (out * torch.arange(20.0).view(5, 4)).sum().backward()
    (eager(x2, bias2) * torch.arange(20.0).view(5, 4)).sum().backward()
    assert rb.plans()[0].num_microbatch == 4
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(bias.grad, bias2.grad)


# --- buffers, inference, random ops, misuse ---------------------------------------------------

def test_batchnorm_buffers_update_like_eager():
    def make():
        return models.bnnet()[0]

    def batches(step):
        g = torch.Generator().manual_seed(step)
        return (torch.randn(8, 12, generator=g),), torch.randn(8, 2, generator=g)
    _train(make, batches, _mse)  # compares the state dict: running stats included


def test_inference_under_no_grad_matches_eager():
    model = gpt_small().eval()
    compiled = torch.compile(model, backend="roundpipe", options=DEVICES)
    (idx,), _ = _gpt_batch(0)
    with torch.no_grad():
        out = compiled(idx)
        ref = model(idx)
    torch.testing.assert_close(out["logits"], ref["logits"])
    assert not out["logits"].requires_grad


class RandomMask(nn.Module):
    """Each block multiplies by a fresh random mask and returns what it drew: recompute
    in backward must draw the same numbers, or the gradients would not match them."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        seen = []
        for fc in self.blocks:
            h = fc(x)
            if self.how == "bernoulli":
                x = h * torch.bernoulli(torch.full_like(h, 0.5))
            else:
                x = F.dropout(h, 0.5, training=True)
            seen += [h, x]
        return (x, *seen)


@pytest.mark.parametrize("how", ["bernoulli", "dropout"])
def test_random_ops_draw_the_same_numbers_in_recompute(how):
    torch.manual_seed(0)
    model = RandomMask(how)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    out, *seen = torch.compile(model, backend="roundpipe",
                               options={"devices": ["cpu"] * 2, "num_microbatch": 1})(x)
    out.sum().backward()
    # Replay eagerly with the masks the forward drew (mask = after / before).
    masks = [(after / before).detach() for before, after in zip(seen[0::2], seen[1::2])]
    keep = 1.0 if how == "bernoulli" else 2.0  # dropout scales by 1 / (1 - p)
    assert all(((m == 0) | (m == keep)).all() and (m == 0).any() for m in masks)
    h = x
    for fc, m in zip(eager.blocks, masks):
        h = fc(h) * m
    h.sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_changing_weights_between_forward_and_backward_is_refused():
    model = mlp()
    out = torch.compile(model, backend="roundpipe", options=DEVICES)(torch.randn(4, 16))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(InputError, match="0.weight was modified in place"):
        out.sum().backward()


def test_graph_writing_to_its_input_runs_eagerly():
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2.0)
            return self.fc(x)

    model = Writes()
    x = torch.randn(3, 4)
    original = x.clone()
    with torch.no_grad():
        expected = model.fc(original * 2.0)
    out = torch.compile(model, backend="roundpipe", options=DEVICES)(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x, original * 2.0)  # the input was written, as eagerly
    assert rb.plans() == ()


class ModeRegions(nn.Module):
    """torch.no_grad() and torch.autocast regions inside the model: thread-local modes
    that must start and end inside one unit (units run on different devices' threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([models.ResBlock(8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = b(x)
            x = x.float()
            with torch.no_grad():
                scale = x.abs().mean()
            x = x / scale
        return self.head(x)


def test_grad_mode_and_autocast_regions_stay_in_one_unit():
    torch.manual_seed(0)
    model = ModeRegions()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8)
    out = torch.compile(model, backend="roundpipe",
                        options={"devices": ["cpu"] * 2, "num_microbatch": 1})(x)
    out.sum().backward()
    ref = eager(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    (plan,) = rb.plans()
    assert len(plan.units) == 4  # still one unit per block (and the head)
    enter = torch.amp.autocast_mode._enter_autocast
    exit_ = torch.amp.autocast_mode._exit_autocast
    for unit in plan.program.units:
        targets = [n.target for n in unit.module.graph.nodes if n.op == "call_function"]
        assert targets.count(enter) == targets.count(exit_)
        grad_modes = [n.args[0] for n in unit.module.graph.nodes
                      if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
        assert grad_modes in ([], [False, True])


@pytest.mark.parametrize("name", ["gpt", "mlp", "convnet", "nested", "bnnet", "branchy"])
def test_unit_roots_from_the_graph_match_the_module_tree(name):
    model, args, _ = models.ALL[name]()
    (dg,) = _capture(model, *args)
    assert find_unit_roots(dg.module_tree) == find_unit_roots(model)


def test_memory_cap_too_small_is_a_partition_error_at_the_call():
    compiled = torch.compile(gpt_small(), backend="roundpipe",
                             options={"devices": ["cpu"] * 2, "memory_cap": "1KiB"})
    (idx,), _ = _gpt_batch(0)
    with pytest.raises(roundpipe.PartitionError, match="memory cap is 1024 bytes"):
        compiled(idx)


def test_import_is_cheap_and_a_source_tree_registers_by_hand():
    """Installed, ``import roundpipe`` leaves Dynamo unimported (its entry point does the
    registering); without the entry point, the import registers the backend itself."""
    assert _scenario("installed") == {"dynamo_imported": False, "registered": False}
    assert _scenario("hide") == {"dynamo_imported": True, "registered": True}

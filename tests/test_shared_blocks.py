"""Tests for roundpipe.passes.shared_blocks: repeated blocks that compute the same are
traced once and copied, blocks that differ are not, and a copied graph computes exactly
what the model does (and what a trace of every block does)."""

from __future__ import annotations

import collections
import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from roundpipe.compiler import analyze
from roundpipe.errors import ConfigError, ModelError
from roundpipe.passes.cost import _EXTRA_FLOP_FORMULAS
from roundpipe.passes.layers import assign_layers, find_unit_roots
from roundpipe.passes.trace import MODULE_PATH, MUTATES, trace
from test_trace import _run_traced_graph


class Block(nn.Module):
    def __init__(self, d: int, index: int = 0, kind: str = "gelu") -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.layer_idx = index
        self.kind = kind

    def mlp(self, x):
        h = self.fc1(x)
        return self.fc2(F.gelu(h) if self.kind == "gelu" else F.relu(h))

    def forward(self, x, scale=1.0):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C)) * scale
        return x + self.mlp(x)


class LM(nn.Module):
    def __init__(self, blocks: list[nn.Module], d: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(blocks)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def _lm(blocks, seed=0):
    torch.manual_seed(seed)
    return LM(blocks).double()


def _trace(model, idx, share=True):
    return trace(model, (idx,), leaf_modules=find_unit_roots(model), share_blocks=share)


def _idx(batch=2, seq=8):
    return torch.randint(0, 32, (batch, seq), generator=torch.Generator().manual_seed(1))


def _ops_by_path(traced):
    return collections.Counter((str(n.target), n.meta.get(MODULE_PATH))
                               for n in traced.graph_module.graph.nodes
                               if n.op == "call_function")


def test_identical_blocks_are_traced_once_and_compute_what_a_full_trace_computes(caplog):
    torch.manual_seed(0)
    model = _lm([Block(16) for _ in range(6)])
    idx = _idx()
    with caplog.at_level(logging.INFO, logger="roundpipe.passes.trace"):
        shared = _trace(model, idx)
    # One export: the copies' state stayed hidden from it, nothing was traced again.
    assert not [r for r in caplog.records if "again" in r.getMessage()]
    full = _trace(model, idx, share=False)
    assert shared.copied == tuple(f"h.{i}" for i in range(1, 6))
    assert full.copied == ()
    # The same ops, each attributed to the same module, as tracing every block gives.
    assert _ops_by_path(shared) == _ops_by_path(full)
    expected = model(idx)
    torch.testing.assert_close(_run_traced_graph(shared, model, (idx,), {}), expected,
                               rtol=0, atol=1e-12)
    # Every block is a unit of its own, as before.
    roots = find_unit_roots(model)
    assert [u.name for u in assign_layers(shared, roots).units] == \
        [u.name for u in assign_layers(full, roots).units]


def test_copies_keep_dynamic_shapes():
    model = _lm([Block(16) for _ in range(4)])
    traced = _trace(model, _idx(2, 8))
    assert traced.method == "export" and traced.copied
    for batch, seq in [(3, 5), (1, 11)]:
        idx = _idx(batch, seq)
        torch.testing.assert_close(_run_traced_graph(traced, model, (idx,), {}), model(idx),
                                   rtol=0, atol=1e-12)


def test_blocks_that_differ_in_an_attribute_are_traced_apart():
    model = _lm([Block(16, kind="gelu" if i % 2 else "relu") for i in range(6)])
    idx = _idx()
    traced = _trace(model, idx)
    assert set(traced.copied) == {"h.2", "h.3", "h.4", "h.5"}
    torch.testing.assert_close(_run_traced_graph(traced, model, (idx,), {}), model(idx),
                               rtol=0, atol=1e-12)


class DoublingBlock(Block):
    """Reads its per-layer index in forward: every third block doubles its input."""

    def forward(self, x, scale=1.0):
        if self.layer_idx % 3 == 0:
            x = x * 2
        return super().forward(x)


def test_a_per_layer_index_is_compared_by_what_the_block_computes():
    # layer_idx makes every block look different; the blocks whose index changes nothing
    # (plain Block) are still shared, those where it does are traced apart.
    plain = _lm([Block(16, index=i) for i in range(5)])
    idx = _idx()
    assert _trace(plain, idx).copied == ("h.1", "h.2", "h.3", "h.4")
    doubling = _lm([DoublingBlock(16, index=i) for i in range(6)])
    traced = _trace(doubling, idx)
    # 0 and 3 double, the others do not: two traced blocks, the rest copies.
    assert set(traced.copied) == {"h.2", "h.3", "h.4", "h.5"}
    torch.testing.assert_close(_run_traced_graph(traced, doubling, (idx,), {}),
                               doubling(idx), rtol=0, atol=1e-12)


class InPlaceBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        x.mul_(0.5)  # writes the caller's tensor
        return self.lin(x)


class SumOfBlocks(nn.Module):
    """Reads each block's input after the block ran, so an in-place write is visible."""

    def __init__(self, n: int, d: int = 8) -> None:
        super().__init__()
        self.h = nn.ModuleList([InPlaceBlock(d) for _ in range(n)])

    def forward(self, x):
        x = x.clone()
        total = 0
        for block in self.h:
            y = block(x)
            total = total + x
            x = y
        return total + x


def test_a_block_writing_its_input_is_traced_normally():
    torch.manual_seed(0)
    model = SumOfBlocks(4).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    assert traced.copied == ()
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x.clone()),
                               rtol=0, atol=1e-12)


class NormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return self.bn(self.lin(x)).relu()


def test_a_block_updating_its_buffers_is_traced_normally():
    torch.manual_seed(0)
    model = nn.Sequential(*[NormBlock(8) for _ in range(4)]).double().train()
    x = torch.randn(5, 8, dtype=torch.float64)
    shared = trace(model, (x,), leaf_modules=find_unit_roots(model))
    full = trace(model, (x,), leaf_modules=find_unit_roots(model), share_blocks=False)
    assert shared.copied == ()  # its fingerprint saw the running statistics written

    def writes(traced):
        return sorted(m for n in traced.graph_module.graph.nodes for m in n.meta.get(MUTATES, ()))

    assert len(writes(shared)) == 12 and writes(shared) == writes(full)
    assert shared.buffer_updates == full.buffer_updates
    reference = copy.deepcopy(model)
    torch.testing.assert_close(_run_traced_graph(shared, model, (x,), {}), reference(x),
                               rtol=0, atol=1e-12)


class SharedInside(nn.Module):
    """Every block holds the same projection module (weight sharing across blocks)."""

    def __init__(self, shared: nn.Linear, d: int) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(d, d)

    def forward(self, x):
        return self.own(self.shared(x)).tanh()


def test_a_module_shared_by_every_block_stays_one_state_slot():
    torch.manual_seed(0)
    common = nn.Linear(8, 8)
    model = nn.Sequential(*[SharedInside(common, 8) for _ in range(4)]).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    # Block 0's input (the user's) does not require grad, the others' do: two traces.
    assert traced.copied == ("2", "3")
    assert sum(1 for s in traced.state if s.fqn.endswith("shared.weight")) == 1
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                               rtol=0, atol=1e-12)


def test_cost_estimates_count_every_copy():
    """The cost pass reuses fake results across copies; the FLOPs must still add up to what
    FlopCounterMode counts on the eager model."""
    model = _lm([Block(16) for _ in range(5)])
    idx = _idx(2, 8)
    with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
        model(idx)
    analysis = analyze(model, (idx,))
    assert sum(u.fwd_flops for u in analysis.report.units) == counter.get_total_flops()
    per_block = [u.fwd_flops for u, unit in zip(analysis.report.units, analysis.units)
                 if unit.name.startswith("h.")]
    assert len(per_block) == 5 and len(set(per_block)) == 1 and per_block[0] > 0


def test_share_blocks_can_be_turned_off(monkeypatch):
    import roundpipe
    import roundpipe.compiler
    seen = []

    def spy(*args, **kwargs):
        traced = trace(*args, **kwargs)
        seen.append(traced.copied)
        return traced

    monkeypatch.setattr(roundpipe.compiler, "trace", spy)
    model = _lm([Block(16) for _ in range(3)])
    idx = _idx(4, 8)
    for share in (False, True):
        pipe = roundpipe.compile(model, (idx,), devices=["cpu"] * 2, share_blocks=share)
        torch.testing.assert_close(pipe(idx), model(idx), rtol=0, atol=1e-12)
        pipe.close()
    assert seen == [(), ("h.1", "h.2")]
    with pytest.raises(ConfigError, match="share_blocks"):
        roundpipe.RoundPipe(model, share_blocks="yes")


class Chain(nn.Module):
    """Four look-alike blocks; ``narrow`` feeds the last one half the features of a wider
    input (so it must be traced itself), ``peek`` reads a late block's weight directly."""

    def __init__(self, narrow: bool = False, peek: bool = False, tie: bool = False) -> None:
        super().__init__()
        self.h = nn.ModuleList([SharedInside(nn.Linear(8, 8), 8) for _ in range(5)])
        self.out = nn.Linear(8, 8)
        if tie:  # a weight of the last block is also the output layer's
            self.out.weight = self.h[4].own.weight
        self.narrow, self.peek = narrow, peek

    def forward(self, x):
        x = self.h[0](x)
        for block in self.h[1:4]:
            x = block(x)
        x = self.h[4](x[:-1] if self.narrow else x)
        y = self.out(x)
        return y + self.h[3].own.weight.sum() if self.peek else y


@pytest.mark.parametrize("case, copied", [
    ({}, ("h.2", "h.3", "h.4")),
    ({"narrow": True}, ("h.2", "h.3")),   # h.4 is traced: its state cannot stay hidden
    ({"peek": True}, ("h.2", "h.3", "h.4")),  # forward reads hidden state: traced again
    ({"tie": True}, ("h.2", "h.3", "h.4")),   # the tied weight stays visible
])
def test_hidden_state_of_copies_comes_back_as_placeholders(case, copied):
    torch.manual_seed(0)
    model = Chain(**case).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    full = trace(model, (x,), leaf_modules=find_unit_roots(model), share_blocks=False)
    assert traced.copied == copied
    # Every parameter has exactly one state slot, named as tracing everything names it.
    assert sorted(s.fqn for s in traced.state) == sorted(s.fqn for s in full.state)
    assert {s.name for s in traced.state} == {s.name for s in full.state}
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                               rtol=0, atol=1e-12)


# --- models that must not be copied wrongly (from an adversarial review) ---------------

class Small(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class Stack(nn.Module):
    """``pre`` then the blocks, called by ``run(self, x)`` (each case its own loop)."""

    def __init__(self, blocks, run=None, **extra) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.h = nn.ModuleList(blocks)
        self.run = run
        for k, v in extra.items():
            setattr(self, k, v)

    def forward(self, x, *rest):
        x = self.pre(x)
        if self.run is not None:
            return self.run(self, x, *rest)
        for b in self.h:
            x = b(x)
        return x


class Tied(Small):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.fc2 = nn.Linear(8, 8)
        if tie:
            self.fc2.weight = self.fc.weight

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc(x))) + x


class Tempered(Small):
    temp = 1.0

    def forward(self, x):
        return torch.tanh(self.fc(x) / self.temp)


def _set_temperature(self, x):
    for i, b in enumerate(self.h):
        b.temp = 1.0 + i  # the parent changes an attribute before each call
        x = b(x)
    return x


def _middle_no_grad(self, x):
    for i, b in enumerate(self.h):
        with torch.no_grad() if i == 1 else contextlib.nullcontext():
            x = b(x)
    return x


class Caching(Small):
    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:  # a lazily built table, kept on the module
            self.cache = torch.linspace(0, 1, x.shape[-1], dtype=x.dtype)
        return torch.tanh(self.fc(x)) * self.cache + x


class Counting(Small):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.fc(x)) * self.calls + x


class Context:
    mask = None


class ReadsContext(Small):
    def __init__(self, ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.ctx.mask


def _switch_context(self, x):
    for i, b in enumerate(self.h):
        self.ctx.mask = self.tables[i]  # a different tensor for every call
        x = b(x)
    return x


class ReturnsGate(Small):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x, self.gate  # a parameter no op reads


def _apply_gates(self, x):
    for b in self.h:
        x, g = b(x)
        x = x * g
    return x


class Scale:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Scaled(Small):
    def forward(self, x, p):
        return x + torch.tanh(self.fc(x)) * p.scale


def _fresh_objects(self, x):
    for i, b in enumerate(self.h):
        x = b(x, Scale(1.0 + i))  # freed after the call: its id is reused by the next
    return x


class Eps(Small):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x + torch.atan(1.0 / torch.full_like(x, self.eps)) * torch.tanh(self.fc(x))


def _weight_norm_term(self, x):
    for b in self.h:
        x = b(x)
    return x, sum(p.square().sum() for p in self.parameters())


def _add_bias_hook(module, args, out):
    bias = getattr(module.fc, "bias", None)
    return out if bias is None else out + bias


def _hooked():
    blocks = [Small() for _ in range(5)]
    for b in blocks:
        b.register_forward_hook(_add_bias_hook)
    return blocks


class Horizon(Small):
    def __init__(self, n_ctx) -> None:
        super().__init__()
        self.n_ctx = n_ctx

    def forward(self, x):
        n = x.shape[1] if self.n_ctx is None else self.n_ctx
        return x + torch.tanh(self.fc(x)) / n


def _context_stack():
    ctx = Context()
    return Stack([ReadsContext(ctx) for _ in range(4)], _switch_context, ctx=ctx,
                 tables=[torch.rand(8, dtype=torch.float64) for _ in range(4)])


def _collect_features(self, x):
    self.feats.clear()
    for b in self.h:
        x = b(x)
    return x, torch.stack(self.feats).sum(0)


class FeatureStack(Stack):
    def keep(self, module, inputs, output):
        self.feats.append(output)


def _hooks_that_collect():
    model = FeatureStack([Small() for _ in range(4)], _collect_features, feats=[])
    for b in model.h:  # feature extraction (Hugging Face's output_attentions does this)
        b.fc.register_forward_hook(model.keep)
    return model


class Scaling:
    scale = 1.0


class ReadsScale(Small):
    def __init__(self, ctx=None) -> None:
        super().__init__()
        self.ctx = ctx

    def forward(self, x, ctx=None):
        return x + torch.tanh(self.fc(x)) * (ctx or self.ctx).scale


def _mutate_held_context(self, x):
    for i, b in enumerate(self.h):
        self.ctx.scale = 1.0 + i  # one object, changed before each call
        x = b(x)
    return x


def _mutate_passed_context(self, x):
    ctx = Scaling()
    for i, b in enumerate(self.h):
        ctx.scale = 1.0 + i
        x = b(x, ctx)
    return x


def _held_context():
    ctx = Scaling()
    return Stack([ReadsScale(ctx) for _ in range(4)], _mutate_held_context, ctx=ctx)


def _one_weight_by_name(self, x):
    for b in self.h:
        x = b(x)
    return x, dict(self.named_parameters())["h.4.fc.weight"].square().sum()


def _count_parameters_first():
    model = Stack([Small() for _ in range(5)], lambda self, x: _plain(self, x) * self.n, n=0)
    model.register_forward_pre_hook(
        lambda m, a: setattr(m, "n", sum(p.numel() for p in m.parameters())))
    return model


def _plain(self, x):
    for b in self.h:
        x = b(x)
    return x


def _copies_parameter_dicts(self, x):
    return _plain(self, x) * sum(len(m._parameters.copy()) for m in self.modules())


GATES: dict = {}  # per-block tables kept outside the modules (an adapter registry, say)


class RegistryGated(Small):
    def forward(self, x):
        return self.fc(x) * GATES[self]


def _registry_gates():
    model = Stack([RegistryGated() for _ in range(4)])
    for i, b in enumerate(model.h):
        GATES[b] = torch.tensor([1.0, 2.0, 3.0, float(i), 1.0, 1.0, 1.0, 1.0],
                                dtype=torch.float64)
    return model


class AttributeGated(Small):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.ones(8, dtype=torch.float64)  # a plain attribute, not a buffer

    def forward(self, x):
        return self.fc(x) * self.gate


ADVERSARIAL = {
    "hooks collect outputs": _hooks_that_collect,
    "context object changed before each call": _held_context,
    "context object passed to each call": lambda: Stack([ReadsScale() for _ in range(4)],
                                                        _mutate_passed_context),
    "parameter looked up by name": lambda: Stack([Small() for _ in range(5)],
                                                 _one_weight_by_name),
    "root pre-hook counts parameters": _count_parameters_first,
    "parameter dicts copied": lambda: Stack([Small() for _ in range(5)],
                                            _copies_parameter_dicts),
    "tied weights in the first block": lambda: Stack([Tied(i == 0) for i in range(4)]),
    "attribute set before each call": lambda: Stack([Tempered() for _ in range(4)],
                                                    _set_temperature),
    "one block under no_grad": lambda: Stack([Small() for _ in range(4)], _middle_no_grad),
    "lazy cache attribute": lambda: Stack([Caching() for _ in range(4)]),
    "tensor read from a context": lambda: _context_stack(),
    "returns its own parameter": lambda: Stack([ReturnsGate() for _ in range(4)],
                                               _apply_gates),
    "fresh argument objects": lambda: Stack([Scaled() for _ in range(4)], _fresh_objects),
    "0.0 and -0.0": lambda: Stack([Eps(e) for e in (0.0, 0.0, -0.0, -0.0)]),
    "forward iterates parameters": lambda: Stack([Small() for _ in range(5)],
                                                 _weight_norm_term),
    "hook probes hidden state": lambda: Stack(_hooked()),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_blocks_that_differ_in_ways_attributes_hide_are_not_copied_wrongly(name):
    torch.manual_seed(0)
    make = ADVERSARIAL[name]
    model = make().double()
    x = torch.randn(3, 8, dtype=torch.float64)
    reference = copy.deepcopy(model)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    with torch.no_grad():
        got = _run_traced_graph(traced, copy.deepcopy(reference), (x,), {})
        expected = copy.deepcopy(reference)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # Tracing left the model's attributes as tracing every block leaves them (a fake run
    # sets nothing for good).
    unshared = copy.deepcopy(reference)
    trace(unshared, (x,), leaf_modules=find_unit_roots(unshared), share_blocks=False)
    for ours, theirs in zip(model.modules(), unshared.modules()):
        assert vars(ours).keys() == vars(theirs).keys()
        assert {k: v for k, v in vars(ours).items() if isinstance(v, (int, float))} == \
            {k: v for k, v in vars(theirs).items() if isinstance(v, (int, float))}


@pytest.mark.parametrize("share_blocks", [True, False])
def test_a_python_call_counter_is_refused_shared_or_not(share_blocks):
    """(An adversarial case for copied blocks until 2026-11-26; a forward that sets a
    plain attribute is now refused, since no program would make the write.)"""
    model = Stack([Counting() for _ in range(4)]).double()
    with pytest.raises(ModelError, match=r"sets the Python attribute h\.\d\.calls \(0 -> 1"):
        trace(model, (torch.randn(3, 8, dtype=torch.float64),),
              leaf_modules=find_unit_roots(model), share_blocks=share_blocks)
    assert all(b.calls == 0 for b in model.h)  # (export put them back)


def test_a_constant_equal_to_the_example_size_is_not_the_size():
    torch.manual_seed(0)
    model = Stack([Horizon(None), Horizon(8)]).double()
    traced = trace(model, (torch.randn(2, 8, 8, dtype=torch.float64),),
                   leaf_modules=find_unit_roots(model))
    assert traced.method == "export" and traced.copied == ()
    for seq in (8, 12):
        x = torch.randn(2, seq, 8, dtype=torch.float64)
        torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                                   rtol=0, atol=1e-12)


class Head(nn.Module):
    def __init__(self, index: int, width: int) -> None:
        super().__init__()
        self.index = index
        self.fc = nn.Linear(8, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([Head(i, w) for i, w in enumerate([8, 8, 12, 12])])
        self.out = nn.Linear(40, 4)

    def forward(self, x):
        return self.out(torch.cat([b(x) for b in self.h], -1))


def test_blocks_compared_by_fingerprint_keep_their_own_state_shapes():
    torch.manual_seed(0)
    model = Heads().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    assert traced.method == "export" and traced.copied == ("h.3",)
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                               rtol=0, atol=1e-12)


class Windowed(nn.Module):
    """Swin-style: the block is told the spatial size as ints derived from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, height, width):
        b = x.shape[0]
        grid = x.view(b, height, width, 8).transpose(1, 2).reshape(b, height * width, 8)
        return x + torch.tanh(self.fc(grid))


class Grid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.h = nn.ModuleList([Windowed() for _ in range(4)])

    def forward(self, x, grid):
        # x: (B, H*W, 8); grid: an (H, W) map, an integer input, so export keeps the sizes
        # symbolic (floating 4-d inputs, images, are traced with static sizes)
        height, width = grid.shape
        x = self.pre(x).reshape(x.shape[0], height * width, 8)
        for block in self.h:
            x = block(x, height, width)
        return x


def test_blocks_given_symbolic_sizes_share_and_keep_them_symbolic():
    torch.manual_seed(0)
    model = Grid().double()
    traced = trace(model, (torch.randn(2, 12, 8, dtype=torch.float64),
                           torch.zeros(3, 4, dtype=torch.int64)),
                   leaf_modules=find_unit_roots(model))
    assert traced.method == "export" and traced.copied == ("h.1", "h.2", "h.3")
    for b, h, w in [(2, 3, 4), (3, 5, 2)]:
        args = (torch.randn(b, h * w, 8, dtype=torch.float64),
                torch.zeros(h, w, dtype=torch.int64))
        torch.testing.assert_close(_run_traced_graph(traced, model, args, {}), model(*args),
                                   rtol=0, atol=1e-12)


class PicksColumn(Small):
    """Falcon-style indexing with a list: every call makes a tensor literal."""

    def __init__(self, column: int = -2) -> None:
        super().__init__()
        self.column = column

    def forward(self, x):
        picked = x[..., [self.column]]
        return torch.tanh(self.fc(x)) * picked


def test_blocks_making_equal_tensor_literals_share_them():
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    same = Stack([PicksColumn() for _ in range(4)]).double()
    traced = trace(same, (x,), leaf_modules=find_unit_roots(same))
    assert traced.copied == ("h.1", "h.2", "h.3")
    torch.testing.assert_close(_run_traced_graph(traced, same, (x,), {}), same(x),
                               rtol=0, atol=1e-12)
    # Literals that differ keep blocks apart, although the attribute is read at call time
    # only through the literal's value.
    differ = Stack([PicksColumn(c) for c in (-2, -2, -3, -3)]).double()
    traced = trace(differ, (x,), leaf_modules=find_unit_roots(differ))
    assert set(traced.copied) == {"h.1", "h.3"}
    torch.testing.assert_close(_run_traced_graph(traced, differ, (x,), {}), differ(x),
                               rtol=0, atol=1e-12)


class SizeOrConstant(Small):
    def __init__(self, k) -> None:
        super().__init__()
        self.k = k

    def forward(self, x, n):
        return self.fc(x) * (self.k if self.k is not None else n)


class PassesSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.h = nn.ModuleList([SizeOrConstant(5), SizeOrConstant(None)])

    def forward(self, x, y):
        n = y.shape[0]
        x = self.pre(x)
        for block in self.h:
            x = block(x, n)
        return x


def test_a_passed_size_is_not_mistaken_for_an_equal_constant():
    torch.manual_seed(0)
    model = PassesSize().double()
    x = torch.randn(1, 8, dtype=torch.float64)  # static: only the passed size is symbolic
    traced = trace(model, (x, torch.zeros(5)), leaf_modules=find_unit_roots(model))
    assert traced.copied == ()
    for n in (5, 7):
        y = torch.zeros(n)
        torch.testing.assert_close(_run_traced_graph(traced, model, (x, y), {}),
                                   model(x, y), rtol=0, atol=1e-12)


def test_tables_read_from_outside_the_modules_are_not_shared():
    """Look-alike blocks that read a tensor they were not passed (from a registry keyed by
    the block) must not read the first block's: such blocks are traced one by one."""
    torch.manual_seed(0)
    model = _registry_gates().double()
    x = torch.randn(3, 8, dtype=torch.float64)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    assert traced.copied == ()
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                               rtol=0, atol=1e-12)


def test_equal_plain_tensor_attributes_stay_each_blocks_own():
    """Blocks holding equal (not registered) tensors: each graph reads its own block's, so
    editing one block's tensor later changes that block only."""
    torch.manual_seed(0)
    model = Stack([AttributeGated() for _ in range(4)]).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    traced = trace(model, (x,), leaf_modules=find_unit_roots(model))
    model.h[3].gate.mul_(0.5)
    torch.testing.assert_close(_run_traced_graph(traced, model, (x,), {}), model(x),
                               rtol=0, atol=1e-12)

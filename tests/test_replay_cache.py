"""The process-wide cache of memory replays (``passes/memory.py``): a pipe built again for
the same computation (a deep copy, another device count or cap) reuses the replay peaks
of the first, and any change a replay can see (an input's or a parameter's dtype or shape,
a frozen parameter, a constant argument, the recompute grain) is a different key.  Units
the key cannot describe exactly (an opaque leaf module) are never cached.  Every figure
equals the one computed afresh with the cache cleared."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import roundpipe
from roundpipe import RoundPipeRunConfig
from roundpipe.passes import memory as memory_module
from roundpipe.passes.memory import MemoryModel, clear_replay_cache

KINDS = ("fwd", "bwd", "fused")


@pytest.fixture
def runs(monkeypatch):
    """How many replays actually ran (not answered by the cache)."""
    count = [0]
    real = MemoryModel._run_replay

    def counted(self, *args):
        count[0] += 1
        return real(self, *args)

    monkeypatch.setattr(MemoryModel, "_run_replay", counted)
    clear_replay_cache()
    yield count
    clear_replay_cache()


def _mlp(width=16, hidden=32, depth=3, p=0.0, dtype=torch.float32):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width if i == 0 else hidden, hidden), nn.ReLU()]
        if p:
            layers.append(nn.Dropout(p))
    layers.append(nn.Linear(hidden, 4))
    return nn.Sequential(*layers).to(dtype).train()


def _compile(model, x, devices, grain="stage", **options):
    cfg = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain)
    return roundpipe.compile(model, (x,), devices=["cpu"] * devices, model_run_config=cfg,
                             **options)


def _figures(pipe, grain="stage"):
    """The plan's stage memory and every replay of one or two units or all of them."""
    memory = pipe._current.analysis.report.memory
    assert isinstance(memory, MemoryModel)
    n = len(memory.program.units)
    ranges = sorted({(i, j) for i in range(n) for j in (i + 1, i + 2) if j <= n} | {(0, n)})
    replays = [(kind, r, mb, memory.stage_bytes(kind, r, num_microbatch=mb, num_devices=2,
                                                grain=grain))
               for r in ranges for kind in KINDS if kind != "fused" or r[1] == n
               for mb in (1, 2)]
    return [(s.index, s.kind, s.memory_bytes) for s in pipe.plan.stages], replays


def _fresh(model, x, devices, grain="stage", **options):
    clear_replay_cache()
    pipe = _compile(copy.deepcopy(model), x, devices, grain, **options)
    try:
        return _figures(pipe, grain)
    finally:
        pipe.close()


def _cached(model, x, devices, grain="stage", **options):
    pipe = _compile(copy.deepcopy(model), x, devices, grain, **options)
    try:
        return _figures(pipe, grain), pipe._current.analysis.report.memory
    finally:
        pipe.close()


def test_a_second_pipe_of_the_same_model_replays_nothing(runs):
    model, x = _mlp(p=0.5), torch.randn(8, 16)
    fresh, fresh_runs = {}, {}
    for devices in (3, 2):
        runs[0] = 0
        fresh[devices] = _fresh(model, x, devices)
        fresh_runs[devices] = runs[0]
    clear_replay_cache()
    first, _ = _cached(model, x, 3)
    assert first == fresh[3]
    runs[0] = 0
    again, _ = _cached(model, x, 3)  # a deep copy, the same device count
    assert runs[0] == 0, f"{runs[0]} replays ran again"
    assert again == fresh[3]
    runs[0] = 0
    other, _ = _cached(model, x, 2)  # another device count: the ranges both plans try
    assert 0 < fresh_runs[2] and runs[0] < fresh_runs[2]
    assert other == fresh[2]


def _key(memory, kind="bwd", grain="stage"):
    n = len(memory.program.units)
    return memory._replay_key(kind, 0, n, True, grain)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, ids):
        return self.body(self.embed(ids))


@pytest.mark.parametrize("change", [
    "input_dtype", "input_shape", "param_dtype", "param_shape", "frozen", "dropout_p"])
def test_what_a_replay_sees_is_in_the_key(runs, change):
    base = dict(width=16, hidden=32, depth=3, p=0.5)
    x = torch.randn(8, 16)
    model = _mlp(**base)
    if change == "input_dtype":  # the same weights: token ids of int32 instead of int64
        model, x = _Tokens(), torch.randint(0, 50, (8, 12))
        other, y = _Tokens(), x.int()
    elif change == "input_shape":  # the same weights, more rows
        other, y = _mlp(**base), torch.randn(12, 16)
    elif change == "param_dtype":
        other, y = _mlp(**base, dtype=torch.float64), x.double()
    elif change == "param_shape":
        other, y = _mlp(**dict(base, hidden=48)), x
    elif change == "frozen":
        other, y = _mlp(**base), x
        other[0].requires_grad_(False)  # no gradient flows into the next layer's input
    else:  # p=1 draws no mask: the same program but for the constant, less memory
        other, y = _mlp(**dict(base, p=1.0)), x
    (_, replays), memory = _cached(model, x, 2)
    runs[0] = 0
    (plan_b, replays_b), memory_b = _cached(other, y, 2)
    assert runs[0] > 0
    key_a, key_b = _key(memory), _key(memory_b)
    assert key_a is not None and key_b is not None and key_a != key_b
    assert (plan_b, replays_b) == _fresh(other, y, 2)
    if change != "dropout_p":  # (p=1's peak equals p=0.5's in some ranges only)
        assert replays_b != replays


class _Branches(nn.Module):
    """Units that read only the model's input: a backward job of two of them uploads the
    same values at both grains, and holds both graphs at once only at the stage grain."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(16, 64)
        self.c, self.out = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        ha, hb, hc = torch.relu(self.a(x)), torch.relu(self.b(x)), torch.relu(self.c(x))
        return self.out(ha + hb + hc)


def test_the_recompute_grain_is_in_the_key(runs):
    model, x = _Branches(), torch.randn(8, 16)
    stage, memory = _cached(model, x, 2, grain="stage")
    runs[0] = 0
    layer, _ = _cached(model, x, 2, grain="layer")
    assert runs[0] > 0
    assert layer == _fresh(model, x, 2, grain="layer")
    # a job the grain alone tells apart
    n = len(memory.program.units)
    alike = [r for r in [(i, j) for i in range(n) for j in range(i + 2, n + 1)]
             if memory._reads("bwd", *r, "stage") == memory._reads("bwd", *r, "layer")]
    assert any(memory._run_replay("bwd", *r, True, "stage")
               != memory._run_replay("bwd", *r, True, "layer") for r in alike)


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.inner(x)) * 2


def test_a_unit_with_an_opaque_leaf_module_is_never_cached(runs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Opaque(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    _, memory = _cached(model, x, 2, leaf_modules=[_Opaque])
    opaque = [i for i, u in enumerate(memory.program.units)
              if memory_module._unit_key(u) is None]
    assert opaque, "the leaf module's unit was keyed"
    keyed = [i for i in range(len(memory.program.units)) if i not in opaque]
    assert keyed, "no unit without the leaf module to compare with"
    first = runs[0]
    runs[0] = 0
    again, _ = _cached(model, x, 2, leaf_modules=[_Opaque])
    assert 0 < runs[0] < first  # the leaf's ranges replay again, the others do not
    assert again == _fresh(model, x, 2, leaf_modules=[_Opaque])


@settings(max_examples=4, deadline=None, derandomize=True)
@given(conv=st.booleans(), width=st.integers(2, 6), depth=st.integers(1, 3),
       p=st.sampled_from([0.0, 0.3]), devices=st.integers(1, 3), frozen=st.booleans())
def test_cached_figures_equal_fresh_ones(conv, width, depth, p, devices, frozen):
    torch.manual_seed(0)
    if conv:
        layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1)]
        for _ in range(depth):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.Dropout(p)]
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(width * 36, 5))
        x = torch.randn(4, 3, 6, 6)
    else:
        model, x = _mlp(width=width, hidden=2 * width, depth=depth, p=p), torch.randn(4, width)
    if frozen:
        model[0].weight.requires_grad_(False)
    clear_replay_cache()
    try:
        fresh = _fresh(model, x, devices)
        for d in (devices, devices % 3 + 1):  # the same pipe, then another device count
            cached, _ = _cached(model, x, d)
            assert cached == _fresh(model, x, d) if d != devices else cached == fresh
    finally:
        clear_replay_cache()

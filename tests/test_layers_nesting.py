"""Layer units do not depend on where the layers sit: a run of layers (``nn.Sequential(
Linear, ReLU, ...)``), repeated blocks in a ``Sequential`` / ``ModuleList`` / ``ModuleDict``
or as attributes of a module get the same units at the top level, behind wrappers, or as
one attribute among others; a model that stays one unit says why (plan.notes, a warning)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe import backend as rb
from roundpipe.compiler import compile_model

from reference import eager_forward_backward

WIDTH = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def _layers(block: str, n: int) -> list[nn.Module]:
    """The same n layers, as modules to hold in one container."""
    if block == "linear":
        return [nn.Linear(WIDTH, WIDTH) for _ in range(n)]
    if block == "block":
        return [Block() for _ in range(n)]
    if block == "pair":  # Sequentials of Linear/activation pairs
        return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]
    assert block == "run"  # a run of plain layers: Linear, Tanh, Linear, Tanh, ...
    return [m for _ in range(n) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]


class Attributes(nn.Module):
    """Layers as attributes of a custom module (l0, l1, ...), called in order."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.count = len(layers)
        for i, m in enumerate(layers):
            setattr(self, f"l{i}", m)

    def forward(self, x):
        for i in range(self.count):
            x = getattr(self, f"l{i}")(x)
        return x


class Looped(nn.Module):
    """A ModuleList or ModuleDict of layers, looped over by its owner."""

    def __init__(self, layers: list[nn.Module], kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "modulelist":
            self.layers = nn.ModuleList(layers)
        else:
            self.layers = nn.ModuleDict({f"k{i}": m for i, m in enumerate(layers)})

    def forward(self, x):
        for m in (self.layers if self.kind == "modulelist" else self.layers.values()):
            x = m(x)
        return x


class Wrapper(nn.Module):
    """``self.inner = ...``, with optional layers of its own before and after."""

    def __init__(self, inner: nn.Module, extra: bool) -> None:
        super().__init__()
        self.inner = inner
        self.stem = nn.Linear(WIDTH, WIDTH) if extra else None
        self.head = nn.Linear(WIDTH, WIDTH) if extra else None

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        x = self.inner(x)
        return self.head(x) if self.head is not None else x


def build(block: str, n: int, container: str, wrappers: tuple[str, ...],
          extra: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = _layers(block, n)
    if container == "sequential":
        model: nn.Module = nn.Sequential(*layers)
    elif container == "attributes":
        model = Attributes(layers)
    else:
        model = Looped(layers, container)
    for i, kind in enumerate(wrappers):
        last = i == len(wrappers) - 1
        model = nn.Sequential(model) if kind == "sequential" else Wrapper(model, extra and last)
    return model.double()


def _num_units(model: nn.Module) -> int:
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    return len(compile_model(model, (x,), num_devices=4).units)


# Layers as attributes of a custom module are a run only where nothing else sits beside
# them (the trunk): Block(attn, mlp) must stay one unit inside a larger model.
@settings(max_examples=10, deadline=None)
@given(block=st.sampled_from(["linear", "block", "pair", "run"]),
       n=st.integers(2, 4),
       container=st.sampled_from(["sequential", "modulelist", "moduledict", "attributes"]),
       wrappers=st.lists(st.sampled_from(["attribute", "sequential"]), max_size=2),
       extra=st.booleans())
def test_the_units_found_do_not_depend_on_how_the_layers_are_nested(block, n, container,
                                                                    wrappers, extra):
    extra = extra and bool(wrappers) and container != "attributes" and \
        wrappers[-1] == "attribute"
    bare = _num_units(build(block, n, "sequential", (), False))
    assert bare == n
    nested = build(block, n, container, tuple(wrappers), extra)
    assert _num_units(nested) == n + (2 if extra else 0), nested


def _mlp() -> list[nn.Module]:
    return [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
            nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)]


class WrappedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*_mlp())

    def forward(self, x):
        return self.layers(x)


def test_a_wrapped_mlp_gets_the_stages_of_the_bare_one():
    """self.layers = nn.Sequential(Linear, ReLU, ...) was 1 stage over 1 unit on 4 devices,
    with nothing in plan.notes; the bare nn.Sequential of the same children gives 5."""
    x = torch.randn(8, 8)
    torch.manual_seed(0)
    bare = roundpipe.compile(nn.Sequential(*_mlp()), example_args=(x,), devices=["cpu"] * 4)
    torch.manual_seed(0)
    wrapped = roundpipe.compile(WrappedMLP(), example_args=(x,), devices=["cpu"] * 4)
    assert len(bare.plan.stages) == len(wrapped.plan.stages) == 5
    assert [u.name for u in wrapped.plan.units] == [f"layers.{i}" for i in (0, 2, 4, 6, 8)]
    assert [u.module_paths for u in wrapped.plan.units][:2] == [("layers.0", "layers.1"),
                                                                ("layers.2", "layers.3")]


class Net(nn.Module):
    """An embedding-like stem, a ModuleDict of blocks and a run of layers two attributes
    deep (self.body.mlp), and a head: every part is split."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleDict({"a": Block(), "b": Block(), "c": Block()})
        self.body = Wrapper(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                          nn.Linear(WIDTH, WIDTH), nn.Tanh()), False)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks.values():
            x = b(x)
        return self.head(self.body(x))


@pytest.mark.parametrize("build_model, devices", [
    (WrappedMLP, 1), (WrappedMLP, 3), (Net, 3),
    (lambda: Wrapper(Wrapper(Attributes(_layers("block", 3)), False), False), 3),
], ids=["wrapped_mlp-1", "wrapped_mlp-3", "moduledict_and_run-3", "attributes_in_wrappers-3"])
def test_newly_split_layouts_train_like_eager(build_model, devices):
    """forward_backward on the layouts that were one unit before equals eager's
    per-microbatch loop (float64), the plan having several stages."""
    torch.manual_seed(0)
    model = build_model().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, model.layers[0].in_features if isinstance(model, WrappedMLP) else WIDTH,
                    dtype=torch.float64)
    y = torch.randn(6, 2 if isinstance(model, (WrappedMLP, Net)) else WIDTH,
                    dtype=torch.float64)

    def loss_fn(out, label):
        return ((out - label) ** 2).sum()

    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=3)) as pipe:
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        assert len(pipe.plan.units) >= 3, pipe.plan.units
        grads = dict(pipe.optim_named_parameters())
    want = eager_forward_backward(reference, (x,), {}, y, loss_fn, 3)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-10)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-10, atol=1e-10,
                                   msg=name)


@pytest.mark.parametrize("build_model", [
    WrappedMLP,
    lambda: Wrapper(Looped(_layers("block", 3), "moduledict"), True),
    lambda: Wrapper(Attributes(_layers("linear", 3)), False),
], ids=["wrapped_mlp", "moduledict", "attributes"])
def test_the_backend_finds_the_same_units(build_model):
    """The torch.compile backend reads the module tree from Dynamo's graph (a ModuleDict
    is never called, so it has no type there): same units as roundpipe.compile."""
    torch._dynamo.reset()
    rb.reset()
    torch.manual_seed(0)
    model = build_model().double()
    x = torch.randn(4, model.layers[0].in_features if isinstance(model, WrappedMLP) else WIDTH,
                    dtype=torch.float64)
    want = [u.name for u in compile_model(model, (x,), num_devices=3).units]
    torch.compile(model, backend="roundpipe", options={"devices": ["cpu"] * 3})(x)
    (plan,) = rb.plans()
    assert [u.name for u in plan.units] == want and len(want) >= 3
    torch._dynamo.reset()


@pytest.mark.parametrize("build_model, why", [
    (lambda: nn.Linear(4, 4), "the model (Linear) holds its parameters itself"),
    (lambda: Wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), False),
     "its parameters are all in one layer, 'inner.0' (Linear)"),
])
def test_a_model_that_stays_one_unit_says_why(build_model, why, caplog):
    """Before, plan.notes was empty and nothing was said: 1 stage, nothing pipelined."""
    with caplog.at_level(logging.WARNING, logger="roundpipe"):
        plan = compile_model(build_model(), (torch.randn(4, 4),), num_devices=4)
    assert len(plan.units) == 1
    notes = [n for n in plan.notes if "one unit" in n]
    assert len(notes) == 1 and why in notes[0] and "1 stage" in notes[0], plan.notes
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and why in warned[0], warned

"""compile_units: each layer unit's program runs through torch.compile.  Same results as
the traced programs, on any device count; keyed random ops run uncompiled in between."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

import models
from roundpipe import ConfigError, RoundPipe, RoundPipeRunConfig


# Each unit is a program of its own that Dynamo compiles: two blocks (repeated, between
# the embeddings and the head) show everything four did, at fewer compiles.
_LAYERS = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _run(devices: int, compile_units, *, grain: str = "stage", dropout: float = 0.0,
         calls: int = 2):
    torch.manual_seed(0)
    model, (idx,), kwargs = models.gpt(batch=8, dropout=dropout, layers=_LAYERS)
    model = model.double()
    labels = torch.randint(0, 64, idx.shape)
    pipe = RoundPipe(model, devices=["cpu"] * devices, compile_units=compile_units, seed=5,
                     model_run_config=RoundPipeRunConfig(num_microbatch=4,
                                                         recompute_grain=grain))
    losses = [pipe.forward_backward(input_args=(idx,), input_kwargs=kwargs, label=labels,
                                    loss_fn=models.lm_loss) for _ in range(calls)]
    grads = {n: p.grad.clone() for n, p in pipe.model.named_parameters()}
    return pipe, losses, grads


def _close_to(a, b, rtol):
    (la, ga), (lb, gb) = a, b
    assert all(torch.allclose(x, y, rtol=rtol, atol=0) for x, y in zip(la, lb))
    for name in ga:
        assert torch.allclose(ga[name], gb[name], rtol=rtol, atol=1e-14), name


def _check_compiled(pipe):
    """Every unit went through Dynamo, without a graph break."""
    units = pipe.plan.program.units
    assert all(pipe._current.executor.runnable(u) is not u.module for u in units)
    assert counters["stats"]["unique_graphs"] >= len(units)
    assert not counters["graph_break"]


def test_compiled_units_match_the_traced_programs_by_layer():
    pipe, *traced = _run(2, False, grain="layer")
    pipe.close()
    pipe, *compiled = _run(2, "aot_eager", grain="layer")
    _check_compiled(pipe)
    pipe.close()
    _close_to(compiled, traced, 1e-12)


def test_compiled_units_match_the_traced_programs_and_any_device_count():
    """By stage: compiled units on 1 and 3 devices are bitwise alike and match the traced
    programs; on 3 devices, each torch device compiles its own copy of a unit (Dynamo
    keeps compiled versions per code object and guards on the device: one copy shared by
    many GPUs would pass its recompile limit; virtual CPU devices share one)."""
    pipe, *traced = _run(2, False)
    pipe.close()
    results = []
    for devices in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        pipe, losses, grads = _run(devices, "aot_eager")
        _check_compiled(pipe)
        if devices == 3:
            ex = pipe._current.executor
            unit = pipe.plan.program.units[2]
            on_cpu = ex.runnable(unit, torch.device("cpu"))
            assert on_cpu is ex.runnable(unit) and on_cpu._orig_mod is unit.module
            elsewhere = ex.runnable(unit, torch.device("meta"))  # stands for a second GPU
            assert elsewhere is not on_cpu and elsewhere._orig_mod is not unit.module
            assert elsewhere._orig_mod.code == unit.module.code
        pipe.close()
        results.append((losses, grads))
    (l1, g1), (l3, g3) = results
    assert all(torch.equal(a, b) for a, b in zip(l1, l3))
    assert all(torch.equal(g1[n], g3[n]) for n in g1)
    _close_to(results[0], traced, 1e-12)


def test_units_with_random_ops_compile_around_them_with_the_same_masks():
    """Keyed dropout runs uncompiled between a unit's compiled pieces: the masks are the
    traced programs' (bitwise), and later calls and microbatches compile nothing new
    (Dynamo does not guard on the per-microbatch key)."""
    torch.manual_seed(0)
    model, (idx,), kwargs = models.gpt(batch=8, dropout=0.1, layers=_LAYERS)
    model = model.double()
    labels = torch.randint(0, 64, idx.shape)
    results = []
    for compile_units in (False, "aot_eager"):
        torch._dynamo.reset()
        counters.clear()
        pipe = RoundPipe(copy.deepcopy(model), devices=["cpu"] * 2, seed=5,
                         compile_units=compile_units,
                         model_run_config=RoundPipeRunConfig(num_microbatch=4))
        losses, graphs = [], []
        for _ in range(3):
            losses.append(pipe.forward_backward(input_args=(idx,), input_kwargs=kwargs,
                                                label=labels, loss_fn=models.lm_loss))
            graphs.append(counters["stats"]["unique_graphs"])
        units = pipe.plan.program.units
        if compile_units:
            assert any(u.needs_rng for u in units)
            ex = pipe._current.executor
            assert all(ex.runnable(u) is not u.module for u in units)
            assert graphs[0] > 0 and graphs[1] == graphs[0] == graphs[2]
        results.append((losses, {n: p.grad.clone() for n, p in pipe.model.named_parameters()}))
        pipe.close()
    (l0, g0), (l1, g1) = results
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


@pytest.mark.parametrize("value", ["no_such_backend", 3, None])
def test_compile_units_refuses_what_is_not_a_backend(value):
    model, _, _ = models.gpt()
    with pytest.raises(ConfigError, match="compile_units"):
        RoundPipe(model, devices=["cpu"], compile_units=value)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler; none is installed")
def test_inductor_units_match_the_traced_programs():
    pipe, *traced = _run(1, False, calls=1)
    pipe.close()
    pipe, *compiled = _run(1, True, calls=1)
    assert pipe.compile_units == "inductor"
    pipe.close()
    _close_to(compiled, traced, 1e-10)

"""``pipe(x)`` with buffers the forward writes: eager's whole-batch call writes each once,
a pipelined call runs the forward once per microbatch.

A write from values no sample changes (a call counter, an EMA of the weights, spectral
norm's power iteration) is made by every microbatch from the value the call began with,
so each computes eager's one write: outputs, gradients and final buffers equal eager on
the whole batch.  A write from the batch (BatchNorm's running statistics, an EMA of a
batch mean) or from random numbers has no such equivalent and is refused with a
``MergeError`` naming the buffer, before anything runs.  The torch.compile backend runs a
graph that writes buffers as one microbatch, with a warning naming them.

These used to write once per microbatch: a counter read 2 where eager reads 1, and
spectral norm's outputs and gradients were off by up to 0.15 and 2.3 (float64).
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe import MergeError, RoundPipe, RoundPipeRunConfig

WIDTH = 6


# --- blocks that write state -----------------------------------------------------------------

class Counter(nn.Module):
    """Counts its calls (in training mode only, if asked; under no_grad, if asked); the
    output reads the count, so a wrong count is a wrong output too."""

    def __init__(self, training_only: bool = False, no_grad: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.training_only = training_only
        self.no_grad = no_grad
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training or not self.training_only:
            if self.no_grad:
                with torch.no_grad():
                    self.calls.add_(1)
            else:
                self.calls += 1
        return torch.tanh(self.lin(x)) * (1 + self.calls.to(x.dtype) / 10)


class WeightEma(nn.Module):
    """An EMA of its weight's row means: the written value does not depend on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * self.lin.weight.mean(1))
        return torch.tanh(self.lin(x)) + self.ema


class BatchEma(nn.Module):
    """Tracks an EMA of the batch mean (the output does not read it): eager's is the whole
    batch's, each microbatch has its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return torch.tanh(self.lin(x))


class Noise(nn.Module):
    """Draws a new buffer every call: each microbatch would draw its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("noise", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.noise.normal_()
        return torch.tanh(self.lin(x)) + self.noise


class BatchNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


def spectral_old() -> nn.Module:
    return nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH))


def spectral_new() -> nn.Module:
    return nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH))


class Net(nn.Module):
    """Blocks in a ModuleList, a head; ``shared``: the first block runs twice per call."""

    def __init__(self, make: Callable[[], nn.Module], depth: int = 3,
                 shared: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(make() for _ in range(depth))
        self.shared = shared
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        if self.shared:
            x = torch.tanh(self.blocks[0](x))
        return self.head(x)


# --- leaf (opaque) modules that write their own state ----------------------------------------

class CountingLeaf(nn.Module):
    """Kept opaque; counts its calls in any mode, from batch inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.tanh(self.lin(x)) * (1 + self.calls.to(x.dtype))


class PowerIterationLeaf(nn.Module):
    """Kept opaque; called with no batch input: one power-iteration step on its weight
    (spectral norm's write) and the normalised weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.register_buffer("u", F.normalize(torch.randn(WIDTH), dim=0))

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            v = F.normalize(self.weight.t() @ self.u, dim=0)
            self.u.copy_(F.normalize(self.weight @ v, dim=0))
        sigma = self.u @ self.weight @ v
        return self.weight / sigma


class LeafNet(nn.Module):
    def __init__(self, leaf: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.leaf = leaf()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        if isinstance(self.leaf, PowerIterationLeaf):
            x = torch.tanh(x @ self.leaf().t())
        else:
            x = self.leaf(x)
        return self.head(x)


# --- helpers ---------------------------------------------------------------------------------

def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**{n: p.detach().clone() for n, p in model.named_parameters()},
            **{n: b.detach().clone() for n, b in model.named_buffers()}}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed by a refused call"
    assert all(p.grad is None for p in model.parameters())


def _compare(model: nn.Module, eager: nn.Module, *, grads: bool) -> None:
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12, msg=name)
    if grads:
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def _equal_eager(model: nn.Module, devices: int, num_mb: int | tuple[int, ...], *,
                 calls: int = 2, grads: bool = True, batch: int = 7,
                 grain: str | tuple[str, ...] = "stage", **options) -> list[torch.Tensor]:
    """``calls`` calls of ``pipe(x)`` (with a backward each) against eager on the whole
    batch: outputs, gradients and every buffer after each call.  Returns the outputs.
    ``num_mb`` and ``grain`` may name one value per call (run options: one pipe, one
    trace, covers several)."""
    torch.manual_seed(1)
    eager = copy.deepcopy(model)
    x = torch.randn(batch, WIDTH, dtype=torch.double)
    mbs = num_mb if isinstance(num_mb, tuple) else (num_mb,) * calls
    grains = grain if isinstance(grain, tuple) else (grain,) * calls
    assert len(mbs) == len(grains) == calls
    outs = []
    with RoundPipe(model, devices=["cpu"] * devices, **options) as pipe:
        for call in range(calls):
            cfg = RoundPipeRunConfig(num_microbatch=mbs[call], recompute_grain=grains[call])
            out, ref = pipe(x, run_config=cfg), eager(x)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
            if grads:
                out.pow(2).sum().backward()
                ref.pow(2).sum().backward()
            _compare(model, eager, grads=grads)
            outs.append(out.detach())
    return outs


def _refused(model: nn.Module, devices: int, num_mb: int, buffer: str, batch: int = 7,
             random: bool = False, **options) -> None:
    """``pipe(x)`` raises a MergeError naming ``buffer`` and the ways out, and leaves
    every parameter and buffer as it was; one microbatch runs (and equals eager unless
    the model draws ``random`` numbers, which roundpipe keys per microbatch)."""
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH, dtype=torch.double)
    before = _snapshot(model)
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
                   **options) as pipe:
        with pytest.raises(MergeError) as info:
            pipe(x)
        message = str(info.value)
        assert buffer in message
        for way_out in ("num_microbatch=1", "model.eval()", "forward_backward()"):
            assert way_out in message
        _assert_unchanged(model, before)
        # one microbatch is eager: allowed, and exact
        eager = copy.deepcopy(model)
        out = pipe(x, run_config=RoundPipeRunConfig(num_microbatch=1))
        if not random:
            torch.testing.assert_close(out, eager(x), rtol=1e-10, atol=1e-12)
            _compare(model, eager, grads=False)


# --- pipe(x): exact ---------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "counter": Counter,
    "counter_no_grad": lambda: Counter(no_grad=True),
    "counter_training_only": lambda: Counter(training_only=True),
    "weight_ema": WeightEma,
    "spectral_norm": spectral_old,
    "parametrizations.spectral_norm": spectral_new,
}


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_batch_independent_writes_equal_eager(name: str, devices: int) -> None:
    """2 then 3 microbatches (uneven: 4+3, 3+2+2 rows) on one pipe."""
    torch.manual_seed(0)
    _equal_eager(Net(BLOCKS[name]).double(), devices, (2, 3))


@pytest.mark.parametrize("name", ["spectral_norm", "parametrizations.spectral_norm"])
def test_spectral_norm_is_the_same_on_one_and_three_devices(name: str) -> None:
    """(Both recompute grains, a call each: the backward's recompute starts every
    microbatch from the call's first value too.)"""
    torch.manual_seed(0)
    model = Net(BLOCKS[name]).double()
    grains = ("stage", "layer", "stage")
    one = _equal_eager(copy.deepcopy(model), 1, 3, calls=3, grain=grains)
    three = _equal_eager(model, 3, 3, calls=3, grain=grains)
    assert all(torch.equal(a, b) for a, b in zip(one, three))


@pytest.mark.parametrize("devices", [1, 3])
def test_a_block_run_twice_writes_twice_per_call(devices: int) -> None:
    torch.manual_seed(0)
    model = Net(Counter, shared=True).double()
    _equal_eager(model, devices, 3)
    assert [int(b.calls) for b in model.blocks] == [4, 2, 2]


@pytest.mark.parametrize("devices", [1, 3])
def test_training_only_writes_count_once_per_call_in_training_only(devices: int) -> None:
    torch.manual_seed(0)
    model = Net(lambda: Counter(training_only=True)).double()
    _equal_eager(model, devices, 2)
    with torch.no_grad():
        _equal_eager(model.eval(), devices, 2, grads=False)
    assert all(int(b.calls) == 2 for b in model.blocks)


@pytest.mark.parametrize("devices", [1, 3])
def test_no_grad_call_with_writes_equals_eager(devices: int) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        _equal_eager(Net(spectral_new).double(), devices, 3, grads=False)


@pytest.mark.parametrize("devices", [1, 3])
def test_a_leaf_writing_from_batch_independent_values_equals_eager(devices: int) -> None:
    """In eval mode (the real run while tracing shows the write); in training mode,
    opaque code may draw random numbers, and the write is refused."""
    torch.manual_seed(0)
    model = LeafNet(PowerIterationLeaf).double()
    # (leaf modules have static shapes: microbatches of one size)
    _equal_eager(copy.deepcopy(model).eval(), devices, 2, batch=6,
                 leaf_modules=[PowerIterationLeaf])
    _refused(model, devices, 2, "leaf.u", batch=6, random=True,
             leaf_modules=[PowerIterationLeaf])


# --- pipe(x): refused -------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 3])
def test_batchnorm_in_training_is_refused_naming_its_running_statistics(devices: int
                                                                         ) -> None:
    torch.manual_seed(0)
    model = Net(BatchNormBlock).double()
    _refused(model, devices, 2, "blocks.0.bn.running_mean")
    # eval mode writes nothing: exact
    _equal_eager(model.eval(), devices, 2)


@pytest.mark.parametrize("devices", [1, 3])
def test_an_ema_of_the_batch_is_refused(devices: int) -> None:
    torch.manual_seed(0)
    _refused(Net(BatchEma).double(), devices, 3, "blocks.0.ema")


def test_a_write_from_random_numbers_is_refused() -> None:
    torch.manual_seed(0)
    _refused(Net(Noise).double(), 3, 2, "blocks.0.noise", random=True)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_leaf_counting_its_calls_on_the_batch_is_refused(devices: int, train: bool) -> None:
    torch.manual_seed(0)
    model = LeafNet(CountingLeaf).double().train(train)
    _refused(model, devices, 2, "leaf.calls", batch=6, leaf_modules=[CountingLeaf])


def test_merge_output_keeps_per_microbatch_writes() -> None:
    """A merge_output is a request for per-microbatch results; the writes are per
    microbatch too, as in forward_backward."""
    torch.manual_seed(0)
    model = Net(Counter).double()
    with RoundPipe(model, devices=["cpu"] * 2, model_run_config=RoundPipeRunConfig(
            num_microbatch=2, merge_output=0)) as pipe:
        with torch.no_grad():
            pipe(torch.randn(6, WIDTH, dtype=torch.double))
    assert [int(b.calls) for b in model.blocks] == [2, 2, 2]


# --- property: exact or refused before anything changes ---------------------------------------

class _Write(nn.Module):
    """A linear layer with one kind of state write."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.kind == "counter":
                self.state.add_(1)
            elif self.kind == "ema_weight":
                self.state.mul_(0.5).add_(self.lin.weight.sum(0))
            elif self.kind == "ema_batch":  # (tracked only: the output is per sample)
                self.state.mul_(0.5).add_(x.mean(0))
                return torch.tanh(self.lin(x))
        return torch.tanh(self.lin(x)) + 0.1 * self.state


class _Random(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Write(k) for k in kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@settings(max_examples=6, deadline=None)
@given(depth=st.integers(2, 4), where=st.integers(0, 3),
       kind=st.sampled_from(["none", "counter", "ema_weight", "ema_batch"]),
       devices=st.sampled_from([1, 3]), num_mb=st.sampled_from([2, 3]),
       seed=st.integers(0, 100))
def test_property_pipe_call_equals_eager_or_refuses_before_writing(
        depth: int, where: int, kind: str, devices: int, num_mb: int, seed: int) -> None:
    torch.manual_seed(seed)
    kinds = ["none"] * depth
    kinds[where % depth] = kind
    model = _Random(kinds).double()
    eager = copy.deepcopy(model)
    x = torch.randn(7, 4, dtype=torch.double)
    before = _snapshot(model)
    with RoundPipe(model, devices=["cpu"] * devices,
                   model_run_config=RoundPipeRunConfig(num_microbatch=num_mb)) as pipe:
        try:
            out = pipe(x)
        except MergeError as e:
            assert kind == "ema_batch", e  # only a write from the batch has no equivalent
            assert f"layers.{where % depth}.state" in str(e)
            _assert_unchanged(model, before)
            return
        assert kind != "ema_batch"
        ref = eager(x)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        out.sum().backward()
        ref.sum().backward()
        _compare(model, eager, grads=True)


# --- the GAN: two pipes, the discriminator with spectral norm --------------------------------

class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            z = torch.tanh(block(z))
        return self.out(z)


class Discriminator(nn.Module):
    def __init__(self, make: Callable[[int, int], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make(4, WIDTH), make(WIDTH, WIDTH)])
        self.out = make(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.leaky_relu(block(x), 0.2)
        return self.out(x)


SPECTRAL = {
    "spectral_norm": lambda i, o: nn.utils.spectral_norm(nn.Linear(i, o)),
    "parametrizations.spectral_norm":
        lambda i, o: nn.utils.parametrizations.spectral_norm(nn.Linear(i, o)),
}


def _gan_steps(g: nn.Module, d: nn.Module, forward_g: Callable, forward_d: Callable,
               step_g: Callable, step_d: Callable, batches: list) -> list[torch.Tensor]:
    """Alternating discriminator and generator steps (non-saturating loss)."""
    losses = []
    for z, real in batches:
        loss_d = (F.softplus(-forward_d(real)).mean()
                  + F.softplus(forward_d(forward_g(z).detach())).mean())
        loss_d.backward()
        step_d()
        loss_g = F.softplus(-forward_d(forward_g(z))).mean()
        loss_g.backward()
        step_g()
        losses += [loss_d.detach(), loss_g.detach()]
    return losses


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("name", sorted(SPECTRAL))
def test_gan_with_spectral_norm_trains_like_eager(name: str, devices: int) -> None:
    torch.manual_seed(0)
    g, d = Generator().double(), Discriminator(SPECTRAL[name]).double()
    eg, ed = copy.deepcopy(g), copy.deepcopy(d)
    batches = [(torch.randn(6, 3, dtype=torch.double), torch.randn(6, 4, dtype=torch.double))
               for _ in range(3)]
    eopt_g = torch.optim.SGD(eg.parameters(), lr=0.1)
    eopt_d = torch.optim.SGD(ed.parameters(), lr=0.1)

    def eager_step(opt: torch.optim.Optimizer, other: torch.optim.Optimizer) -> Callable:
        def step() -> None:
            opt.step()
            opt.zero_grad()
            other.zero_grad()  # the generator's loss reached the discriminator too
        return step

    want = _gan_steps(eg, ed, eg, ed, eager_step(eopt_g, eopt_d), eager_step(eopt_d, eopt_g),
                      batches)
    config = RoundPipeRunConfig(num_microbatch=2)
    with RoundPipe(g, devices=["cpu"] * devices, model_run_config=config) as pg, \
            RoundPipe(d, devices=["cpu"] * devices, model_run_config=config) as pd:
        opt_g = torch.optim.SGD(pg.optim_parameters(), lr=0.1)
        opt_d = torch.optim.SGD(pd.optim_parameters(), lr=0.1)

        def step(pipe: RoundPipe, opt: torch.optim.Optimizer, other: RoundPipe,
                 other_opt: torch.optim.Optimizer) -> Callable:
            def run() -> None:
                pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
                other.step(other_opt.zero_grad, is_async=False)
            return run

        got = _gan_steps(g, d, pg, pd, step(pg, opt_g, pd, opt_d), step(pd, opt_d, pg, opt_g),
                         batches)
        pg.synchronize()
        pd.synchronize()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for model, ref in ((g, eg), (d, ed)):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=n)
        for (n, b), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12, msg=n)


# --- the torch.compile backend ----------------------------------------------------------------

BACKEND_BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "counter": Counter,
    "weight_ema": WeightEma,
    "batch_ema": BatchEma,
    "batchnorm": BatchNormBlock,
    "spectral_norm": spectral_old,
    "parametrizations.spectral_norm": spectral_new,
}


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("name", sorted(BACKEND_BLOCKS))
def test_backend_with_forward_writes_equals_eager(name: str, devices: int, caplog) -> None:
    """Two steps: outputs, gradients and buffers equal eager on the whole batch, the
    graph runs as one microbatch, and one warning line says so, naming the buffers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(BACKEND_BLOCKS[name]).double()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="roundpipe",
                             options={"devices": ["cpu"] * devices, "num_microbatch": 2})
    x = torch.randn(6, WIDTH, dtype=torch.double)
    try:
        with caplog.at_level(logging.WARNING, logger="roundpipe"):
            for _ in range(2):
                out, ref = compiled(x), eager(x)
                torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
                out.pow(2).sum().backward()
                ref.pow(2).sum().backward()
                _compare(model, eager, grads=True)
    finally:
        torch._dynamo.reset()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "1 microbatch" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "the forward writes blocks.0." in warnings[0]

"""Every write to module state that eager PyTorch makes is committed, whatever the context
around it (no_grad, set_grad_enabled, inference_mode, autocast, nested regions), once per
microbatch and never again in recompute.

Each case trains three calls with SGD steps between them and compares, after every call,
the loss, every gradient and every buffer with eager PyTorch's per-microbatch loop, on 1
and 3 virtual devices.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig

NUM_MB = 2


class EmaBlock(nn.Module):
    """An EMA of activations and a call counter, updated under ``context()``."""

    def __init__(self, width: int, context: Callable[[], object]) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.context = context
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls.add_(1)
        return torch.tanh(self.lin(x)) + self.ema


class EmaNet(nn.Module):
    def __init__(self, context: Callable[[], object], width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EmaBlock(width, context) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Stacked:
    """Several context managers entered in order (``set_grad_enabled`` takes effect when
    made, so the stack is made on entry)."""

    def __init__(self, *makers: Callable[[], object]) -> None:
        self.makers = makers

    def __enter__(self) -> None:
        self.stack = []
        for make in self.makers:
            context = make()
            context.__enter__()  # type: ignore[attr-defined]
            self.stack.append(context)

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self.stack):
            context.__exit__(*exc)  # type: ignore[attr-defined]


CONTEXTS = {
    "no_grad": torch.no_grad,
    "set_grad_enabled": lambda: torch.set_grad_enabled(False),
    "inference_mode": torch.inference_mode,
    "autocast": lambda: _Stacked(lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                                 torch.no_grad),
    "nested": lambda: _Stacked(lambda: torch.set_grad_enabled(False),
                               lambda: torch.autocast("cpu", enabled=False), torch.no_grad),
}


class ConvSpectral(nn.Module):
    """A small conv net with both spectral-norm APIs (their power-iteration vectors are
    buffers updated under no_grad in every training forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.utils.spectral_norm(nn.Conv2d(3, 6, 3, padding=1)),
            nn.utils.parametrizations.spectral_norm(nn.Conv2d(6, 6, 3, padding=1)),
            nn.utils.spectral_norm(nn.Conv2d(6, 6, 3, padding=1)),
            nn.utils.parametrizations.spectral_norm(nn.Conv2d(6, 6, 3, padding=1)),
        ])
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.blocks:
            x = F.gelu(conv(x))
        return self.head(x.mean((2, 3)))


class VQ(nn.Module):
    """A vector quantiser whose codebook is kept by EMA (VQ-VAE v2), with a
    straight-through estimator."""

    def __init__(self, codes: int, width: int, decay: float = 0.8) -> None:
        super().__init__()
        self.decay = decay
        self.register_buffer("codebook", torch.randn(codes, width))
        self.register_buffer("cluster_size", torch.ones(codes))
        self.register_buffer("embed_sum", self.codebook.clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(z, self.codebook)
        idx = d.argmin(-1)
        q = self.codebook[idx]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.codebook.shape[0]).to(z.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(onehot.t() @ z, alpha=1 - self.decay)
                self.codebook.copy_(self.embed_sum / (self.cluster_size.unsqueeze(1) + 1e-5))
        return z + (q - z).detach()


class VQNet(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.vq = VQ(5, width)
        self.dec = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.enc:
            x = torch.tanh(layer(x))
        x = self.vq(x)
        for layer in self.dec:
            x = torch.tanh(layer(x))
        return self.head(x)


def _train_and_compare(model: nn.Module, x: torch.Tensor, devices: int, grain: str = "stage",
                       calls: int = 3) -> None:
    torch.manual_seed(3)
    y = torch.randn(x.shape[0], 1, dtype=x.dtype)
    eager = copy.deepcopy(model)
    pipe = RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB,
                                                         recompute_grain=grain))
    try:
        opt = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
        eager_opt = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad],
                                    lr=0.05)
        for call in range(calls):
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
            ref = reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, NUM_MB)
            assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (call, loss, ref)
            got = dict(pipe.optim_named_parameters())
            for name, p in eager.named_parameters():
                if p.requires_grad:
                    assert got[name].grad is not None, (call, name)
                    torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-10,
                                               atol=1e-12, msg=f"call {call}: {name}")
            for (name, b), (_, rb) in zip(pipe.model.named_buffers(), eager.named_buffers()):
                torch.testing.assert_close(b, rb, rtol=1e-10, atol=1e-12,
                                           msg=f"call {call}: buffer {name}")
            pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            eager_opt.step()
            eager_opt.zero_grad()
    finally:
        pipe.close()


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("context", sorted(CONTEXTS))
def test_buffers_written_in_a_grad_mode_region_are_committed(context: str,
                                                             devices: int) -> None:
    torch.manual_seed(0)
    model = EmaNet(CONTEXTS[context]).double()
    _train_and_compare(model, torch.randn(6, 8, dtype=torch.double), devices)
    # once per microbatch per call, in eager and here alike
    assert [int(b.calls) for b in model.blocks] == [3 * NUM_MB] * 3


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("devices", [1, 3])
def test_spectral_norm_both_apis(devices: int, grain: str) -> None:
    torch.manual_seed(0)
    _train_and_compare(ConvSpectral().double(), torch.randn(4, 3, 6, 6, dtype=torch.double),
                       devices, grain)


@pytest.mark.parametrize("devices", [1, 3])
def test_vq_ema_codebook(devices: int) -> None:
    torch.manual_seed(0)
    _train_and_compare(VQNet().double(), torch.randn(8, 6, dtype=torch.double), devices)


# --- state shared by several blocks ---------------------------------------------------------

class SharedStateBlock(nn.Module):
    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.owner = [owner]  # a plain list: the owner is not a submodule of the block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.owner[0]
        with torch.no_grad():
            owner.steps.add_(1)
            owner.running.mul_(0.5).add_(x.mean())
        return torch.tanh(self.lin(x)) + owner.running


class SharedStateNet(nn.Module):
    """A counter and a running value on the root, updated and read by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("running", torch.ones(()))
        self.blocks = nn.ModuleList(SharedStateBlock(self) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def __deepcopy__(self, memo: dict) -> "SharedStateNet":
        new = SharedStateNet().to(self.head.weight.dtype)
        new.load_state_dict(self.state_dict())
        return new


@pytest.mark.parametrize("devices", [1, 3])
def test_state_shared_by_several_blocks_keeps_eager_order(devices: int) -> None:
    """Pipelining runs a job's blocks on every microbatch before the next job: state that
    several blocks update and read must stay in one unit to see eager's order."""
    torch.manual_seed(0)
    model = SharedStateNet().double()
    _train_and_compare(model, torch.randn(6, 8, dtype=torch.double), devices)
    assert int(model.steps) == 3 * NUM_MB * 4


def test_shared_state_merge_is_noted_in_the_plan() -> None:
    torch.manual_seed(0)
    with RoundPipe(SharedStateNet().double(), devices=["cpu"] * 2) as pipe:
        plan = pipe.compile((torch.randn(6, 8, dtype=torch.double),))
        assert [u.name for u in plan.units] == ["blocks.0", "head"]
        assert any("running" in n and "one unit" in n for n in plan.notes), plan.notes


# --- regions do not constrain the cuts -----------------------------------------------------

class FrozenTrunk(nn.Module):
    """Frozen blocks run under one no_grad region around the whole loop."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)
        for p in self.trunk.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for layer in self.trunk:
                x = torch.tanh(layer(x))
        for layer in self.blocks:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_a_region_around_several_blocks_leaves_them_separate_units() -> None:
    torch.manual_seed(0)
    model = FrozenTrunk().double()
    with RoundPipe(copy.deepcopy(model), devices=["cpu"]) as pipe:
        plan = pipe.compile((torch.randn(6, 8, dtype=torch.double),))
        assert [u.name for u in plan.units][:4] == [f"trunk.{i}" for i in range(4)]
    for devices in (1, 3):
        _train_and_compare(copy.deepcopy(model), torch.randn(6, 8, dtype=torch.double),
                           devices, calls=2)


class InferenceGlue(nn.Module):
    """Eager differentiates only through x: y is made in inference mode."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.blocks:
            x = torch.tanh(layer(x))
            with torch.inference_mode():
                y = x * 2
            x = x + y
        return self.head(x)


@pytest.mark.parametrize("devices", [1, 3])
def test_inference_mode_values_carry_no_gradient(devices: int) -> None:
    torch.manual_seed(0)
    _train_and_compare(InferenceGlue().double(), torch.randn(6, 8, dtype=torch.double),
                       devices, calls=2)


# --- a failure inside a region ---------------------------------------------------------------

class EmbedUnderAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            e = self.emb(idx).float()
        for layer in self.blocks:
            e = layer(e)
        return e.sum(-1)


def test_a_failure_inside_a_region_leaves_no_mode_on_the_worker() -> None:
    torch.manual_seed(0)
    with RoundPipe(EmbedUnderAutocast(), devices=["cpu"]) as pipe:
        idx = torch.randint(0, 10, (4, 3))
        pipe.forward_backward(input_args=(idx,), loss_fn=lambda o, _: o.sum())
        with pytest.raises(Exception, match="index"):
            pipe.forward_backward(input_args=(idx + 10,), loss_fn=lambda o, _: o.sum())
        worker = pipe.devices[0]
        state = worker.submit(lambda: (torch.is_autocast_enabled("cpu"),
                                       torch.is_grad_enabled())).result()
        assert state == (False, True)
        pipe.forward_backward(input_args=(idx,), loss_fn=lambda o, _: o.sum())


# --- the torch.compile backend ---------------------------------------------------------------

def test_backend_commits_writes_in_regions() -> None:
    """(The backend runs a graph that updates buffers as one microbatch: splitting it
    would change what the updates see.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = EmaNet(torch.no_grad).double()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="roundpipe",
                             options={"devices": ["cpu"] * 3, "num_microbatch": 2})
    x = torch.randn(6, 8, dtype=torch.double)
    try:
        for _ in range(2):
            compiled(x).pow(2).sum().backward()
            eager(x).pow(2).sum().backward()
        for (name, b), (_, rb) in zip(model.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, rb, rtol=1e-10, atol=1e-12, msg=name)
        for (name, p), (_, rp) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad, rp.grad, rtol=1e-10, atol=1e-12, msg=name)
    finally:
        torch._dynamo.reset()


# --- forward() + backward(): the recompute reads what the forward read ----------------------

@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("devices", [1, 3])
def test_pipelined_forward_then_backward_recomputes_from_the_forwards_buffers(
        devices: int, grain: str) -> None:
    """forward() commits its buffer updates when it ends; the backward's recompute must
    still start from the buffers the forward started from (else the EMA it reads is
    updated twice and the head's gradient is wrong).  (Each microbatch updates the EMA,
    so the outputs are per-microbatch results, asked for with merge_output=0.)"""
    torch.manual_seed(0)
    model = EmaNet(torch.no_grad).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None,
                   model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB,
                                                       recompute_grain=grain,
                                                       merge_output=0)) as pipe:
        for call in range(2):
            pipe(x).pow(2).sum().backward()
            torch.cat([eager(c) for c in x.chunk(NUM_MB)]).pow(2).sum().backward()
            got = dict(pipe.optim_named_parameters())
            for name, p in eager.named_parameters():
                torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-10, atol=1e-12,
                                           msg=f"call {call}: {name}")
            for (name, b), (_, rb) in zip(model.named_buffers(), eager.named_buffers()):
                torch.testing.assert_close(b, rb, rtol=1e-10, atol=1e-12, msg=name)


# --- the torch.fx fallback -------------------------------------------------------------------

class NoGradGlue(nn.Module):
    """no_grad in the model's own glue code (fx keeps the Linear blocks opaque)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.blocks:
            x = torch.tanh(layer(x))
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0))
                doubled = x * 2
            x = x + doubled + self.ema
        return self.head(x)


@pytest.mark.parametrize("devices", [1, 3])
def test_fx_fallback_sees_no_grad_in_glue(devices: int, monkeypatch) -> None:
    from roundpipe.passes import trace as trace_pass

    def export_fails(*args, **kwargs):
        raise RuntimeError("export is made to fail: this test runs the torch.fx fallback")

    monkeypatch.setattr(trace_pass, "_trace_export_sharing", export_fails)
    torch.manual_seed(0)
    model = NoGradGlue().double()
    with RoundPipe(copy.deepcopy(model), devices=["cpu"]) as pipe:
        assert pipe.compile((torch.randn(6, 8, dtype=torch.double),)).program.trace_method \
            == "fx"
    _train_and_compare(model, torch.randn(6, 8, dtype=torch.double), devices)


# --- writes the trace cannot see ------------------------------------------------------------

class CountingLeaf(nn.Module):
    """Counts its calls in eval mode too (an opaque module's writes are only assumed in
    training mode, like BatchNorm's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.tanh(self.lin(x))


class LeafNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CountingLeaf() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("devices", [1, 3])
def test_writes_of_opaque_modules_in_eval_mode_are_committed(devices: int, caplog) -> None:
    torch.manual_seed(0)
    model = LeafNet().double().eval()
    x = torch.randn(6, 8, dtype=torch.double)
    with RoundPipe(model, devices=["cpu"] * devices, leaf_modules=[CountingLeaf],
                   model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB,
                                                       merge_output=0)) as pipe:
        with torch.no_grad():
            for _ in range(2):
                pipe(x)
    assert [int(b.calls) for b in model.blocks] == [2 * NUM_MB] * 3


class RebindingBlock(nn.Module):
    """Updates its running mean by assigning a new tensor to the buffer, not in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running = self.running * 0.9 + 0.1 * x.mean(0)
        return torch.tanh(self.lin(x)) + self.running


class RebindingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([RebindingBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("leaf", [False, True])
def test_a_buffer_rebound_in_forward_is_refused_not_dropped(leaf: bool) -> None:
    """``self.buf = new`` is no write torch.export records (nor an opaque module's call):
    training went on with the buffer never updated.  Now the trace refuses it."""
    from roundpipe.errors import ModelError
    model = RebindingNet()
    pipe = RoundPipe(model, devices=["cpu"] * 2, leaf_modules=["blocks.1"] if leaf else None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
    with pytest.raises(ModelError, match=r"buffer\(s\) blocks\.\d\.running.*in place"):
        pipe.forward_backward(input_args=(torch.randn(4, 8),), label=torch.randn(4, 8),
                              loss_fn=F.mse_loss)
    assert all(not b.any() for b in model.buffers())
    pipe.close()


class MaxNormEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, max_norm=1.0)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


class ClampedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return self.out(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("case", ["max_norm", "clamp"])
def test_a_parameter_written_in_place_in_forward_is_refused_not_dropped(case: str) -> None:
    """The write reached the device's copy of the weight only: the host parameter (which
    the optimizer steps) kept its old values, where eager's are renormalized/clamped."""
    from roundpipe.errors import ModelError
    torch.manual_seed(0)
    if case == "max_norm":
        model, x, param = MaxNormEmbedding(), torch.randint(0, 10, (4, 3)), "emb.weight"
        model.emb.weight.data.mul_(3)
    else:
        model, x, param = ClampedLinear(), torch.randn(4, 8), "lin.weight"
    pipe = RoundPipe(model, devices=["cpu"] * 2,
                     model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB))
    with pytest.raises(ModelError, match=f"writes parameter {param} in place"):
        pipe.forward_backward(input_args=(x,), label=None,
                              loss_fn=lambda out, _: out.pow(2).mean())
    pipe.close()

"""Model code that depends on grad mode, layouts and output/input structures gives eager's
results under roundpipe (float64, virtual CPU devices), found by an adversarial hunt."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig

W = 8


class GradModeBranch(nn.Module):
    """Python branches on grad mode, as fast paths do (MultiheadAttention's, SDPA's)."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = not torch.is_grad_enabled() if self.on == "grad_mode" else not x.requires_grad
        return torch.sin(x) if fast else torch.tanh(x)


class BranchBlock(nn.Module):
    def __init__(self, on: str) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.act = GradModeBranch(on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(x))


class BranchNet(nn.Module):
    def __init__(self, on: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BranchBlock(on) for _ in range(3))
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _pipe(model: nn.Module, devices: int = 2, num_mb: int = 2) -> RoundPipe:
    return RoundPipe(model, devices=["cpu"] * devices, optim_dtype=None,
                     model_run_config=RoundPipeRunConfig(num_microbatch=num_mb))


@pytest.mark.parametrize("on", ["grad_mode", "requires_grad"])
def test_a_forward_under_no_grad_runs_the_no_grad_branches(on: str) -> None:
    """The program was traced with grad enabled and served no_grad calls too: a model
    branching on grad mode (or on requires_grad) returned its grad-mode values under
    torch.no_grad(), 0.1 off eager's. Programs are now kept per grad mode."""
    torch.manual_seed(0)
    model = BranchNet(on).double()
    eager = copy.deepcopy(model)
    x = torch.randn(6, W, dtype=torch.double)
    y = torch.randn(6, 2, dtype=torch.double)
    with _pipe(model) as pipe:
        with torch.no_grad():  # the first call: traced under no_grad
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-12)
        loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
        ref = reference.eager_forward_backward(eager, (x,), {}, y, F.mse_loss, 2)
        torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
        for p, q in zip(pipe.optim_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
        with torch.no_grad():  # after training: the no_grad program again
            torch.testing.assert_close(pipe(x), eager(x), rtol=0, atol=1e-12)
        torch.testing.assert_close(pipe(x).detach(), eager(x).detach(), rtol=0, atol=1e-12)
        assert len(pipe.plans) == 2


class ReturnsState(nn.Module):
    """Returns a parameter and a buffer themselves beside the prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.head = nn.Linear(W, 2)
        self.register_buffer("scale", torch.arange(1.0, 3.0))

    def forward(self, x: torch.Tensor):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) * self.scale, self.blocks[0].bias, self.head.bias, self.scale


def _state_loss(out, y: torch.Tensor) -> torch.Tensor:
    pred, early, bias, scale = out
    return F.mse_loss(pred, y) + early.pow(2).sum() + 0.1 * bias.sum() + scale.sum()


@pytest.mark.parametrize("num_mb", [1, 3])
def test_a_parameter_or_buffer_returned_itself_is_an_output(num_mb: int) -> None:
    """A model output that is a parameter or buffer itself (no op between) was produced
    by no program: forward_backward failed with 'p_head_bias was not produced before it
    was needed', pipe(x) with a bare KeyError.  Its gradient reaches the parameter."""
    torch.manual_seed(0)
    model = ReturnsState().double()
    x = torch.randn(6, W, dtype=torch.double)
    y = torch.randn(6, 2, dtype=torch.double)
    eager = copy.deepcopy(model)
    ref = reference.eager_forward_backward(eager, (x,), {}, y, _state_loss, num_mb)
    for devices in (1, 3):
        with _pipe(copy.deepcopy(model), devices, num_mb) as pipe:
            loss = pipe.forward_backward(input_args=(x,), label=y, loss_fn=_state_loss)
            torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
            for p, q in zip(pipe.optim_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
            with torch.no_grad():
                out, want = pipe(x), model(x)
            for o, w in zip(out, want):
                torch.testing.assert_close(o, w, rtol=0, atol=1e-12)


class ReadsInputStrides(nn.Module):
    """An output read through the input's strides (``as_strided``), which mixes samples as
    far as the merge can tell: the output tail recomputes it on the merged input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))

    def forward(self, x: torch.Tensor):
        h = x
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h, x.as_strided((x.shape[0], 2), (x.stride(0), x.stride(2)))


def test_a_merged_input_keeps_the_layout_eager_sees() -> None:
    """The input's batch dimension is not its outermost (a transposed tensor): the tail
    read the input concatenated contiguously from the microbatches, and as_strided picked
    other elements than eager's (4.6 off). Concatenation now keeps the pieces' order."""
    torch.manual_seed(0)
    model = ReadsInputStrides().double()
    x = torch.randn(5, 6, W, dtype=torch.double).transpose(0, 1)
    with _pipe(model, 2, 3) as pipe, torch.no_grad():
        out, want = pipe(x), model(x)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, rtol=0, atol=1e-12)
        assert o.stride() == w.stride()


class _Plain:
    def __init__(self, pred: torch.Tensor) -> None:
        self.pred = pred


class PlainObjectOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> _Plain:
        return _Plain(self.lin(x))


def test_an_output_of_an_unknown_class_says_how_to_register_it() -> None:
    """The ways out spoke of data-dependent control flow and leaf modules only."""
    from roundpipe.errors import TraceError
    with _pipe(PlainObjectOut().double(), 1, 1) as pipe:
        with pytest.raises(TraceError, match=r"(?s)output holds a .*_Plain object.*"
                           r"register_pytree_node.*make it a dataclass"):
            pipe(torch.randn(4, W, dtype=torch.double))


class FeatureAlphaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.drop = nn.FeatureAlphaDropout(0.3)
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.drop(torch.tanh(block(x)))
        return self.head(x)


@pytest.mark.parametrize("train", [False, True])
def test_feature_alpha_dropout_keeps_samples_apart_in_pipe_outputs(train: bool) -> None:
    """pipe(x) over several microbatches raised MergeError ('cannot prove it keeps samples
    apart') for nn.FeatureAlphaDropout, even in eval mode where it is the identity; its
    mask is per sample and channel, like the other dropouts the merge knows."""
    torch.manual_seed(0)
    model = FeatureAlphaNet().double().train(train)
    x = torch.randn(6, 5, W, dtype=torch.double)
    outs = []
    for devices in (1, 2):
        with _pipe(copy.deepcopy(model), devices, 3) as pipe, torch.no_grad():
            outs.append(pipe(x))
    assert torch.equal(outs[0], outs[1])
    if not train:
        torch.testing.assert_close(outs[0], model(x), rtol=0, atol=1e-12)


class PaddedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(W, W)
        self.blocks = nn.ModuleList(nn.MultiheadAttention(W, 2, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor):
        h, weights = self.inp(x), []
        for block in self.blocks:
            a, w = block(h, h, h, key_padding_mask=pad)  # need_weights=True: the default
            h, weights = h + a, weights + [w]
        return self.head(h), weights


def test_multihead_attention_with_a_padding_mask_merges_exactly() -> None:
    """nn.MultiheadAttention's default path adds the key padding mask with baddbmm; the
    merge refused any per-sample bias ('aten.baddbmm adds a batch value'), so pipe(x) of
    several microbatches raised MergeError. A bias holding its samples where the product
    does keeps them apart."""
    torch.manual_seed(0)
    model = PaddedAttention().double()
    x = torch.randn(6, 5, W, dtype=torch.double)
    pad = torch.zeros(6, 5, dtype=torch.bool)
    pad[0, -2:] = True
    pad[4, -1] = True
    with _pipe(copy.deepcopy(model), 2, 3) as pipe, torch.no_grad():
        out, want = pipe(x, pad), model(x, pad)
    torch.testing.assert_close(out[0], want[0], rtol=0, atol=1e-12)
    for o, w in zip(out[1], want[1]):
        torch.testing.assert_close(o, w, rtol=0, atol=1e-12)

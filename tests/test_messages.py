"""Error messages a new user meets first: each states the fact and the way out, once,
from the caller's frame."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn as nn

from roundpipe import (ConfigError, InputError, LossError, RoundPipe, RoundPipeRunConfig,
                       UnknownConfigFieldError)
import roundpipe


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for machines without CUDA")
def test_asking_for_cuda_without_cuda_names_the_way_out(monkeypatch) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"devices=\['cpu'\] \* 2"):
        RoundPipe(model, devices=["cuda:0", "cuda:1"])
    monkeypatch.setenv("ROUNDPIPE_DEVICES", "cuda:0")
    with pytest.raises(ConfigError, match="from ROUNDPIPE_DEVICES='cuda:0'.*ROUNDPIPE_DEVICES=cpu"):
        RoundPipe(model)


def test_a_misspelt_option_names_the_close_match() -> None:
    with pytest.raises(UnknownConfigFieldError, match="'device' \\(did you mean 'devices'\\?\\)"):
        RoundPipe(nn.Linear(4, 4), device=["cpu"])
    with pytest.raises(UnknownConfigFieldError, match="did you mean 'num_microbatch'"):
        RoundPipeRunConfig(num_microbatches=2)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1)).double()


def test_an_input_of_the_wrong_dtype_is_found_when_compiling() -> None:
    """Export traces float32 inputs into float64 weights without complaint; the compile
    says so with the example at hand, in a short traceback."""
    with pytest.raises(InputError) as info:
        roundpipe.compile(_net(), (torch.randn(6, 4),), devices=["cpu"])
    message = str(info.value)
    assert "input_args[0] is float32" in message and "float64" in message
    assert "x.to(torch.float64)" in message and "linear" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__ is False


def test_an_input_of_the_wrong_dtype_at_the_first_call_is_one_short_error() -> None:
    with RoundPipe(_net(), devices=["cpu"] * 2) as pipe:
        with pytest.raises(InputError) as info:
            pipe.forward_backward(input_args=(torch.randn(6, 4),),
                                  loss_fn=lambda o, _: o.sum())
    message = str(info.value)
    assert "input_args[0] is float32" in message
    assert "mat1 and mat2 must have the same dtype" in message  # the cause, one line
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert info.value.original is not None  # the whole story, for whoever wants it
    lines = traceback.format_exception(info.value)
    assert len("".join(lines).splitlines()) < 25


def test_a_non_scalar_loss_names_the_microbatch_once() -> None:
    with RoundPipe(_net(), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        with pytest.raises(LossError) as info:
            pipe.forward_backward(input_args=(torch.randn(6, 4, dtype=torch.double),),
                                  label=torch.randn(6, 1, dtype=torch.double),
                                  loss_fn=lambda o, y: (o - y) ** 2)
    message = str(info.value)
    assert message.count("microbatch") == 1, message
    assert "shape (3, 1)" in message


class _SparseEmbedding(nn.Module):
    def __init__(self, functional: bool, frozen: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.emb = nn.Embedding(10, 4, sparse=not functional)
        self.emb.weight.requires_grad_(not frozen)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.functional:
            return self.lin(torch.nn.functional.embedding(x, self.emb.weight, sparse=True))
        return self.lin(self.emb(x))


@pytest.mark.parametrize("functional", [False, True])
def test_sparse_embedding_gradients_are_refused_with_the_way_out(functional) -> None:
    """A sparse gradient failed in the backward stage ('copy_() between dense and sparse
    Tensors'), after the forward had run; it is refused when tracing, naming the weight
    and the way out.  A frozen sparse embedding (no gradient) trains as in eager."""
    x = torch.randint(0, 10, (4, 3))
    with RoundPipe(_SparseEmbedding(functional), devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        with pytest.raises(roundpipe.ModelError, match="sparse=True.*use sparse=False"):
            pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
    torch.manual_seed(0)
    model = _SparseEmbedding(False, frozen=True).double()
    eager = _SparseEmbedding(False, frozen=True).double()
    eager.load_state_dict(model.state_dict())
    eager(x).pow(2).sum().backward()
    with RoundPipe(model, devices=["cpu"] * 2,
                   model_run_config=RoundPipeRunConfig(num_microbatch=2)) as pipe:
        pipe.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.pow(2).sum())
        pipe.synchronize()
        for p, q in zip(model.lin.parameters(), eager.lin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
